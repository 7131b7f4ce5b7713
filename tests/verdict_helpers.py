"""Small verdict filters shared by the property test modules."""


def by(verdicts, **config):
    """The verdicts whose config matches every ``key=value`` given."""
    return [v for v in verdicts if all(v.config.get(k) == x for k, x in config.items())]


def assert_all_pass(verdicts):
    bad = [(v.config, v.status, v.message) for v in verdicts if v.status != "pass"]
    assert verdicts and not bad, bad

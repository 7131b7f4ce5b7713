"""Small verdict filters and runners shared by the test modules."""

import functools

from dpfsdp_verify.gate import run as _gate_run


class KnownUpstreamFailure(Exception):
    """What a strict ``xfail(raises=KnownUpstreamFailure)`` pin of an upstream finding raises, and
    only when upstream fails exactly as pinned: any other outcome fails the test (another
    exception) or passes it (an XPASS, which strict turns into a failure)."""


def by(verdicts, **config):
    """The verdicts whose config matches every ``key=value`` given."""
    return [v for v in verdicts if all(v.config.get(k) == x for k, x in config.items())]


def assert_all_pass(verdicts):
    bad = [(v.config, v.status, v.message) for v in verdicts if v.status != "pass"]
    assert verdicts and not bad, bad


def without_fresh_case(pid):
    """Property ``pid`` with its fresh-process case left out, for tests that judge only the verdicts
    of the warm ranks: that case starts two new sets of rank processes (seconds each) and is judged
    by the tests that assert its verdict."""
    import dataclasses

    from dpfsdp_verify.properties import PROPERTIES

    prop = PROPERTIES[pid]
    return dataclasses.replace(prop, cases=lambda point: [c for c in prop.cases(point) if not c.fresh_groups])


def without_extra_noise_cases():
    """noise_calibration with only its statistical verdicts on the warm ranks: no fresh-process
    case, no exact-only cases (one step of the transformer, of a wide mlp and of a one-row mlp, run
    beside the default mlp) and no default bf16 case (at the smallest world size >= 2), for tests that
    judge the statistical verdict alone."""
    import dataclasses

    from dpfsdp_verify.properties import PROPERTIES
    from dpfsdp_verify.properties.engine.contract import DEFAULT_PRECISION_FACT

    prop = PROPERTIES["noise_calibration"]
    return dataclasses.replace(prop, cases=lambda point: [c for c in prop.cases(point)
                                                          if not c.fresh_groups and not c.facts.get("exact_only")
                                                          and not c.facts.get(DEFAULT_PRECISION_FACT)])


def run_gate(pool, monkeypatch, capsys, *args):
    """``dpfsdp-verify ARGS`` in this process on the tests' warm pool (what the console script does,
    minus starting Python and the ranks again; ``test_cli.run_cli`` runs the script itself):
    an object with ``returncode``, ``stdout`` and ``stderr``."""
    from types import SimpleNamespace

    from dpfsdp_verify.gate import cli

    # the gate's own launcher, minus its own pool: the plan loaded and run on the tests' warm one
    monkeypatch.setattr(_gate_run, "execute_spawned",
                        lambda plan, _shared=pool: _gate_run.execute(plan.loaded(), _shared))
    capsys.readouterr()
    code = cli.main(list(args))
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


@functools.lru_cache(maxsize=None)
def repeatable_options() -> frozenset:
    """The ``run`` command's options given once per value (``action="append"``, e.g. ``--mode-env``)."""
    import argparse

    from dpfsdp_verify.gate import cli

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return frozenset(o for a in sub.choices["run"]._actions if isinstance(a, argparse._AppendAction)
                     for o in a.option_strings)


def message_problems(v) -> list:
    """What is broken in a verdict's words: an empty list ("at steps  in", "[]", ", ,") in its
    message, or a replay line naming an option twice or one value twice in an option's comma list
    (``--properties noise_calibration,noise_calibration``)."""
    import re
    import shlex
    # "run()" is a call, and "gloo:barrier []" a collective's tensor shapes (a barrier has none): no empty list
    bad = [f"empty list {m.group(0)!r}" for m in re.finditer(
        r"\b(?:steps?|ranks?|coordinates|tensors|values) +(?=[,;:)]|in a run| in |\s*$)|(?<![\w.])(?:\[\]|\(\))|, ,",
        v.message) if not re.search(r"\w+:\w+ $", v.message[:m.start()])]
    words = shlex.split(v.repro) if v.repro else []
    repeatable = repeatable_options()
    flags = [w for w in words if w.startswith("--") and w not in repeatable]
    bad += [f"option {f} twice" for f in sorted({f for f in flags if flags.count(f) > 1})]
    for flag, value in zip(words, words[1:]):
        items = value.split(",") if flag.startswith("--") and not value.startswith("--") else []
        if len(items) != len(set(items)):
            bad.append(f"{flag} {value}: a value twice")
    return bad


def is_post_processing(target_ref: str) -> bool:
    """Whether the specimen ``target_ref`` ("module:Class") only post-processes its noisy releases
    (its class sets ``post_processing``): the privacy of such a target is intact."""
    import importlib

    module, _, name = target_ref.partition(":")
    if not module.startswith("fixtures."):
        return False
    try:
        return bool(getattr(getattr(importlib.import_module(module), name, None), "post_processing", False))
    except ImportError:
        return False


def verdict_word_problems(v, target_ref: str) -> list:
    """``message_problems`` plus "PRIVACY VIOLATION" said of a post-processing specimen's verdict."""
    bad = message_problems(v)
    if "PRIVACY VIOLATION" in v.message and is_post_processing(target_ref):
        bad.append("PRIVACY VIOLATION said of a post-processing specimen (privacy intact)")
    return bad

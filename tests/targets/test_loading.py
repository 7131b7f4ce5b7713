"""Loading targets: the built-in opacus adapter, module:Attr references, entry points, clear errors."""

import pytest

from dpfsdp_verify.targets import Target, TargetLoadError, load_target, target_info
from dpfsdp_verify.targets.opacus_target import OpacusTarget
from fixtures import specimens


def make_correct():
    return specimens.Correct()


def make_nothing():
    return 42


NOT_A_TARGET = object()


def test_builtin_opacus_is_the_default_target():
    t = load_target("opacus")
    assert isinstance(t, OpacusTarget)
    assert target_info("opacus")["version"] == __import__("opacus").__version__


def test_module_attr_class_factory_and_instance():
    assert type(load_target("fixtures.specimens:AllReduceNorms")) is specimens.AllReduceNorms
    assert type(load_target("tests.targets.test_loading:make_correct")) is specimens.Correct
    inst = specimens.NoClipMin()
    specimens._test_instance = inst
    try:
        assert load_target("fixtures.specimens:_test_instance") is inst
    finally:
        del specimens._test_instance


@pytest.mark.parametrize("ref, words", [
    ("no_such_module_xyz:Thing", "cannot import module 'no_such_module_xyz'"),
    ("fixtures.specimens:Nope", "has no attribute 'Nope'"),
    ("no-such-target", "unknown target 'no-such-target'"),
    ("tests.targets.test_loading:NOT_A_TARGET", "raised TypeError"),
    ("fixtures.specimens:DEFERRED_ENV", "raised TypeError"),
    ("fixtures.specimens:", "must look like 'package.module:Attr'"),
    ("", "non-empty string"),
])
def test_bad_references_raise_one_line_reason(ref, words):
    with pytest.raises(TargetLoadError) as e:
        load_target(ref)
    assert words in str(e.value)
    assert "\n" not in str(e.value)


def test_factory_returning_a_non_target_is_refused():
    with pytest.raises(TargetLoadError, match="not a dpfsdp_verify.targets.Target"):
        load_target("tests.targets.test_loading:make_nothing")


def test_entry_point_group(monkeypatch):
    import importlib.metadata as md

    class EP:
        name, value = "my-fork", "fixtures.specimens:ShardOnlyNorms"

    monkeypatch.setattr(md, "entry_points", lambda group=None: [EP] if group == "dpfsdp_verify.targets" else [])
    assert type(load_target("my-fork")) is specimens.ShardOnlyNorms
    with pytest.raises(TargetLoadError, match="no entry point named 'other'"):
        load_target("other")


def test_every_specimen_is_a_target_with_one_marked_bug():
    import inspect

    for name, cls in specimens.SPECIMENS.items():
        assert issubclass(cls, Target)
        if cls is not specimens.Correct:
            assert cls.__bases__ == (specimens.Correct,), name
            assert "BUG" in inspect.getsource(cls), f"{name} does not mark its bug"

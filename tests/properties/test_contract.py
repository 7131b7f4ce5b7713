"""The property contract: CONTRIBUTING.md's example property runs (and fails on the bug it targets),
options are checked, the rule for comparing properties lives in one place, and no module outside
``properties/`` names a property."""

from __future__ import annotations

import dataclasses
import os
import re
import types

import pytest

from dpfsdp_verify.config import modes
from dpfsdp_verify.properties import PROPERTIES, REGISTRY, Options, fuzzable, modes_problem
import dpfsdp_verify.properties as props  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "dpfsdp_verify")


def doc_block(tag: str, doc: str = "CONTRIBUTING.md") -> str:
    text = open(os.path.join(REPO, doc)).read()
    block = text.split(f"<!-- {tag} -->", 1)[1].split(f"<!-- /{tag} -->", 1)[0]
    return "\n".join(line for line in block.splitlines() if not line.startswith("```"))


@pytest.fixture(scope="module")
def example_property():
    code = doc_block("property-example")
    assert len(code.strip().splitlines()) < 40, "CONTRIBUTING.md promises an example under 40 lines"
    module = types.ModuleType("contributing_loss_fidelity")
    exec(compile(code, "CONTRIBUTING.md:property-example", "exec"), module.__dict__)
    return module.PROPERTY


def test_contributing_example_property_passes_a_correct_target(pool, example_property):
    verdicts = props.run(example_property, "fixtures.specimens:Correct", pool=pool, world_sizes=(1, 2))
    assert [(v.config["world_size"], v.config["reduction"], v.status) for v in verdicts] == [
        (1, "mean", "pass"), (1, "sum", "pass"), (2, "mean", "pass"), (2, "sum", "pass")]
    assert verdicts[0].repro.startswith("dpfsdp-verify run --target fixtures.specimens:Correct --properties "
                                        "loss_fidelity --world-sizes 1")


def test_contributing_example_property_fails_the_bug_it_targets(pool, example_property):
    verdicts = props.run(example_property, "fixtures.specimens:LossAllReduced", pool=pool, world_sizes=(1, 2),
                                reductions=("sum",))
    one, two = verdicts
    assert one.status == "pass"  # one rank: a sum over ranks is the rank's own loss
    assert (two.status, two.diagnosis) == ("fail", "mismatch")
    assert "rank 0 reports loss" in two.message


def test_unknown_option_is_refused_naming_the_property_options():
    with pytest.raises(TypeError, match=r"deadlock_free: unknown option\(s\) repeats; its own options: local_batches"):
        props.run("deadlock_free", "opacus", repeats=3)


def test_options_from_the_python_api():
    opts = Options.build("t", world_sizes=[2], modes={"a": {"X": "1"}, "b": {}}, models=["mlp"], steps=4)
    assert opts.world_sizes == (2,) and opts.models == ("mlp",) and dict(opts.params) == {"steps": 4}
    assert opts.modes == (modes.Mode("a", (("X", "1"),)), modes.Mode("b", ()))
    assert Options.build("t").modes == modes.DEFAULT_MODES


def test_comparing_properties_need_two_modes_and_get_pairs():
    comparing = [p for p in REGISTRY if p.compares_modes]
    assert comparing, "some property compares modes"
    # with a built-in pair (mode_equivalence: unsplit vs physical batches) one mode is enough
    assert all(modes_problem(p, modes.DEFAULT_MODES) is None for p in comparing if p.default_pair)
    prop = dataclasses.replace(comparing[0], default_pair=None)
    assert "needs two or more --mode-env" in modes_problem(prop, modes.DEFAULT_MODES)
    [skip] = prop.plan(prop.with_defaults(Options.build("t")))
    assert skip.status == "skip" and "--mode-env" in skip.message
    three = Options.build("t", world_sizes=[2], models=["mlp"], modes={"a": {}, "b": {"X": "1"}, "c": {"X": "2"}})
    labels = [c.config()["mode"] for c in prop.plan(prop.with_defaults(three))]
    assert labels == ["a vs b", "a vs c"]


def test_mode_env_parse_and_format_round_trip():
    m = modes.parse("deferred:B=2,A=1")
    assert m == modes.Mode("deferred", (("A", "1"), ("B", "2")))
    assert modes.parse(m.to_arg()) == m and m.describe_env() == "A=1,B=2"
    for bad, says in (("deferred", "expected LABEL:VAR=VAL"), ("x:A", "is not VAR=VAL")):
        with pytest.raises(modes.ModeSyntaxError, match=says):
            modes.parse(bad)
    with pytest.raises(modes.ModeSyntaxError, match="given twice"):
        modes.parse_all(["a:X=1", "a:X=2"])


def test_fuzzable_is_derived_from_the_recipes():
    assert fuzzable() == [p.id for p in REGISTRY if p.fuzz is not None] and fuzzable()


def test_no_module_outside_properties_names_a_property():
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, PROPERTIES)) + r")\b")
    offenders = []
    for root, _, files in os.walk(PACKAGE):
        if os.path.join(PACKAGE, "properties") in root or "__pycache__" in root:
            continue
        for name in files:
            path = os.path.join(root, name)
            for n, line in enumerate(open(path, errors="replace"), 1):
                if pattern.search(line):
                    offenders.append(f"{os.path.relpath(path, REPO)}:{n}: {line.strip()}")
    assert offenders == []


def test_diagnoses_have_one_home_per_property_and_the_schema_lists_exactly_them():
    """Each diagnosis is given by the runner (``RUN_DIAGNOSES``) or declared by a property
    (``Property.diagnoses``); ``verdict.DIAGNOSES`` is their union and the report schema's enum is
    that list; every diagnosis a property module names literally in a verdict is one it declares."""
    import json
    import re
    from importlib import resources

    from dpfsdp_verify import properties as properties_pkg
    from dpfsdp_verify.verdict import DIAGNOSES, RUN_DIAGNOSES

    declared = set(RUN_DIAGNOSES).union(*(p.diagnoses for p in REGISTRY))
    assert declared == set(DIAGNOSES) and len(DIAGNOSES) == len(set(DIAGNOSES))
    schema = json.loads(resources.files("dpfsdp_verify").joinpath("schema/report.schema.json").read_text())
    assert set(schema["$defs"]["diagnosis"]["enum"]) == set(DIAGNOSES) | {None}
    for prop in REGISTRY:
        module = getattr(properties_pkg, prop.id)  # the registry imports each check module under its id
        source = open(module.__file__).read()
        named = set(re.findall(r'verdict\("(?:fail|hang|error)", "([a-z_]+)"', source))
        assert named <= set(prop.diagnoses) | set(RUN_DIAGNOSES), (prop.id, named - set(prop.diagnoses))
        assert set(prop.diagnoses) <= set(DIAGNOSES), prop.id

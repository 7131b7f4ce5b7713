"""Reports a CI reads: unique labels everywhere, JSON valid against the shipped schema and
alone on stdout with ``--json -``, a markdown page a step summary can render, exit 3 for a bug
inside the suite, and one-line exit-2 messages for a missing optional dependency."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib import resources

import jsonschema
import pytest

from dpfsdp_verify.gate import cli, report
from dpfsdp_verify.gate.result import judge
from dpfsdp_verify.properties import PROPERTIES, REGISTRY, Case
from dpfsdp_verify.verdict import CONFIG_KEYS
from tests.gate.test_cli import REPO, run_cli

SCHEMA = json.loads(resources.files("dpfsdp_verify").joinpath("schema/report.schema.json").read_text())


def validate(report_json: dict) -> None:
    jsonschema.validate(report_json, SCHEMA, cls=jsonschema.Draft202012Validator)


def test_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["properties"]["schema_version"]["const"] == report.SCHEMA_VERSION


@pytest.mark.slow
def test_deadlock_free_scenarios_have_unique_labels_in_every_report(tmp_path):
    """The four deadlock_free scenarios of one world size used to share one label (and so one
    JUnit classname+name): reporters that key on them merged four results into one."""
    x, md = tmp_path / "r.xml", tmp_path / "r.md"
    r = run_cli("run", "--target", "fixtures.specimens:Correct", "--properties", "deadlock_free", "--world-sizes",
                "2", "--models", "mlp", "--loss-reductions", "mean", "--json", "-", "--junit", str(x), "--markdown",
                str(md), "-v")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)  # --json -: stdout is the JSON report and nothing else
    validate(rep)
    results = rep["results"]
    # the 8 scenarios at 2 ranks, the long run (poisson_horizon), one process asked twice for its epsilon
    # (history_twice) and uneven_accum at the third rank
    assert sorted(v["config"]["local_batches"] for v in results) == ["empty", "even", "history_twice",
                                                                     "poisson_horizon",
                                                                     "poisson_per_rank", "poisson_per_rank_accum",
                                                                     "poisson_same", "single", "uneven",
                                                                     "uneven_accum", "uneven_accum"]
    labels = [v["label"] for v in results]
    assert len(set(labels)) == 11 and all("local_batches=" in lab and "None" not in lab for lab in labels)
    assert all(set(v["config"]) <= set(CONFIG_KEYS) for v in results)
    # the terminal table went to stderr, one row per verdict, each with its own label
    assert "11 passed" in r.stderr and all(lab in r.stderr for lab in labels)
    cases = ET.parse(x).getroot().findall("testsuite/testcase")
    names = [(c.get("classname"), c.get("name")) for c in cases]
    assert len(names) == 11 and len(set(names)) == 11 and {n for _, n in names} == set(labels)
    page = md.read_text()
    rows = [line for line in page.splitlines() if line.startswith("| `deadlock_free`")]
    assert len(rows) == 11 and len(set(rows)) == 11
    assert "![" not in page and ".png" not in page  # nothing a GitHub step summary cannot show


def test_labels_leave_out_absent_values_and_keep_fuzz_settings():
    # the row gate.run_plan emits for a mode_equivalence without --mode-env labels
    skipped = {"world_size": None, "data_layout": None, "model": None, "mode": "default",
               "grad_sample_mode": "ghost_fsdp"}
    assert report.config_label(skipped) == "mode=default grad_sample_mode=ghost_fsdp"
    fuzz_pass = {"world_size": 2, "data_layout": "fuzzed", "model": "fuzzed:mlp", "mode": "default",
                 "grad_sample_mode": "ghost_fsdp", "reduction": "fuzzed",
                 "fuzz": {"examples": 10, "seed": 0, "statuses": {"pass": 10}}}
    assert report.config_label(fuzz_pass) == ("ws=2 fuzzed fuzzed:mlp fuzzed mode=default fuzz(examples=10,seed=0) "
                                              "grad_sample_mode=ghost_fsdp")
    other = dict(fuzz_pass, fuzz={"examples": 20, "seed": 0})
    assert report.config_label(other) != report.config_label(fuzz_pass)


@pytest.mark.slow
def test_every_config_key_a_property_can_emit_is_known():
    """Expectation files are checked against ``verdict.CONFIG_KEYS`` and the schema lists the same
    keys: every case of every property (its plan; nothing runs) must stay within them."""
    modes = {"immediate": {}, "deferred": {"SOME_SWITCH": "1"}}
    seen = set()
    for prop in REGISTRY:
        for item in prop.plan(prop.options("opacus", world_sizes=(1, 2), modes=modes, meshes=("hsdp:2x2", "tp:2x2"))):
            cfg = item.config() if isinstance(item, Case) else item.config
            seen |= set(cfg)
    assert seen <= set(CONFIG_KEYS), seen - set(CONFIG_KEYS)
    assert "local_batches" in seen and "mesh" in seen
    assert set(CONFIG_KEYS) <= set(SCHEMA["$defs"]["result"]["properties"]["config"]["properties"])


def _raising_cases(point):
    raise ZeroDivisionError("planted bug in a check")


def test_a_bug_inside_a_check_exits_3(tmp_path, capsys, monkeypatch):
    """An exception raised by property code in the gate process is the suite's bug, not the
    target's: diagnosis internal_error, exit 3 (a failing target is 1) -- even with --expect."""
    monkeypatch.setitem(PROPERTIES, "clipped_step", dataclasses.replace(PROPERTIES["clipped_step"],
                                                                        cases=_raising_cases))
    j = tmp_path / "r.json"
    code = cli.main(["run", "--properties", "clipped_step", "--models", "mlp", "--world-sizes", "1", "-q",
                     "--expect", "opacus-1.6.0", "--json", str(j)])
    assert code == 3
    rep = json.loads(j.read_text())
    validate(rep)
    v, = rep["results"]
    assert (v["status"], v["diagnosis"], v["expected"]) == ("error", "internal_error", False)
    assert "planted bug in a check" in v["message"] and rep["exit_code"] == 3
    out = capsys.readouterr().out
    assert "bug in dpfsdp-verify" in out and "ZeroDivisionError" in out


def _raising_prepare(spec):
    raise ZeroDivisionError("planted bug in a fuzz recipe")


def test_a_bug_in_fuzzing_keeps_the_property_verdicts(pool, tmp_path, capsys, monkeypatch):
    """A fuzz recipe that raises is one internal_error verdict (exit 3) beside the verdicts the
    property's own cases already earned: the report keeps them."""
    from tests.verdict_helpers import run_gate

    prop = PROPERTIES["norm_fidelity"]
    monkeypatch.setitem(PROPERTIES, "norm_fidelity", dataclasses.replace(
        prop, fuzz=dataclasses.replace(prop.fuzz, prepare=_raising_prepare)))
    j = tmp_path / "r.json"
    r = run_gate(pool, monkeypatch, capsys, "run", "--target", "fixtures.specimens:Correct", "--properties",
                 "norm_fidelity", "--models", "mlp", "--world-sizes", "1", "--wide-world-size", "0",
                 "--node-world-size", "0", "--fuzz", "2",
                 "-q",
                 "--json", str(j))
    assert r.returncode == 3, r.stderr
    rep = json.loads(j.read_text())
    validate(rep)
    *cases, error = rep["results"]
    assert cases and all(v["status"] == "pass" for v in cases), [v["message"] for v in cases]
    assert (error["status"], error["diagnosis"]) == ("error", "internal_error")
    assert error["message"].startswith("fuzzing norm_fidelity failed: ZeroDivisionError: planted bug in a fuzz recipe")


def test_a_crash_of_the_cli_itself_exits_3(capsys, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("planted crash in the table")

    monkeypatch.setitem(PROPERTIES, "clipped_step", dataclasses.replace(PROPERTIES["clipped_step"],
                                                                        cases=lambda point: []))
    monkeypatch.setattr(report, "counts_text", boom)
    assert cli.main(["run", "--properties", "clipped_step", "--world-sizes", "1", "-q"]) == 3
    err = capsys.readouterr().err
    assert "planted crash in the table" in err and "internal error" in err


def test_target_opacus_without_opacus_exits_2(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "opacus", None)  # import opacus -> ImportError
    assert cli.main(["run"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--target opacus: no opacus is importable" in err
    assert "pip install opacus, after a CPU torch" in err


@pytest.fixture
def without_optional_deps(tmp_path):
    """An environment where hypothesis, pytest and jsonschema cannot be imported (by the gate or by
    its ranks): packages of those names that raise ImportError, first on PYTHONPATH."""
    for name in ("hypothesis", "pytest", "_pytest", "jsonschema"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} hidden by the test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    return env


@pytest.mark.slow
def test_gate_needs_only_its_runtime_dependencies(without_optional_deps):
    exe = os.path.join(os.path.dirname(sys.executable), "dpfsdp-verify")
    r = subprocess.run([exe, "run", "--properties", "clipped_step", "--models", "mlp", "--world-sizes", "1",
                        "--loss-reductions", "mean", "--dtypes", "float64", "--sampling", "fixed", "-q"], cwd=REPO,
                       env=without_optional_deps,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.rstrip().splitlines()[-1] == "dpfsdp-verify: PASSED (exit 0): 1 passed"
    r = subprocess.run([exe, "run", "--fuzz", "2"], cwd=REPO, env=without_optional_deps, capture_output=True,
                       text=True, timeout=600)
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1, err
    assert "--fuzz needs hypothesis" in err and "pip install hypothesis" in err


def test_junit_message_is_a_headline_cut_at_a_clause_and_the_body_keeps_it_all(tmp_path):
    """JUnit's ``message`` attribute is short by convention: a long message is cut at its last
    clause boundary (never mid-word) and marked; the testcase's text holds the whole message."""
    from dpfsdp_verify.harness.rank_groups import grouped
    from dpfsdp_verify.verdict import Verdict

    states = {r: f"began step {r % 7 + 1} after {r % 7} finished step(s) and never finished it" for r in range(64)}
    long = "the run deadlocked: " + grouped(states) + ". " + "A collective issued by only some ranks; " * 12
    short = "the run deadlocked: ranks 0-63 can never finish"
    config = {"world_size": 64, "data_layout": "split", "model": "mlp", "mode": "default",
              "grad_sample_mode": "ghost_fsdp"}
    verdicts = [Verdict("deadlock_free", "hang", dict(config, loss_reduction=red), "deadlock", msg)
                for red, msg in (("mean", long), ("sum", short))]
    path = tmp_path / "r.xml"
    report.write_junit(str(path), judge(verdicts, {"name": "t"}))
    errors = ET.parse(path).getroot().findall(".//error")
    assert len(long) > 600 and len(errors) == 2
    cut = errors[0].get("message")
    assert len(cut) <= 500 and cut.endswith(" [...]") and f"[deadlock] {long}".startswith(cut[:-len(" [...]")])
    assert cut[:-len(" [...]")].endswith(("it", "ranks")) and long in errors[0].text
    assert errors[1].get("message") == f"[deadlock] {short}"

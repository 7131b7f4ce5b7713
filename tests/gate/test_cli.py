"""dpfsdp-verify as a CI job uses it: exit codes, one-line usage errors, reports, verdicts on
upstream opacus and on a fork-like specimen, and a crashing mode that must not hang the gate."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from dpfsdp_verify.gate import cli
from dpfsdp_verify.properties import PROPERTIES
from tests.verdict_helpers import run_gate

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args, cwd=REPO):
    """The installed console script in a subprocess, as CI runs it (``test_upstream_opacus_verdicts``
    and the other modules' end-to-end runs; the rest run the same ``cli.main`` in this process on
    the warm pool, ``verdict_helpers.run_gate``)."""
    exe = os.path.join(os.path.dirname(sys.executable), "dpfsdp-verify")
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("args, says", [
    (["run", "--properties", "norm_fidelity,bogus"], "unknown property bogus"),
    (["run", "--world-sizes", "1,two"], "not a comma list of integers"),
    (["run", "--world-sizes", "0"], "world sizes must be >= 1"),
    (["run", "--world-sizes", "64"], "more than this gate runs on one host"),
    (["run", "--target", "no_such_pkg.mod:Target"], "cannot import module 'no_such_pkg.mod'"),
    (["run", "--mode-env", "deferred"], "expected LABEL:VAR=VAL"),
    (["run", "--mode-env", "a:X=1", "--mode-env", "a:X=2"], "given twice"),
    (["run", "--models", "resnet"], "unknown model resnet"),
    (["run", "--loss-reductions", "max"], "choose from mean,sum"),
    (["run", "--timeout", "0"], "must be > 0"),
    (["run", "--physical-batch-size", "0"], "must be an integer >= 1"),
    (["run", "--json", "/no/such/dir/r.json"], "directory does not exist"),
    (["run", "--frobnicate"], "unrecognized arguments"),
    (["run", "--sampling", "bernoulli"], "--sampling bernoulli: choose from fixed,poisson"),
    (["run", "--seeding", "same,random"], "--seeding same,random: choose from same,per_rank,unseeded"),
    (["run", "--sample-rate", "0"], "must be in (0, 1]"),
    (["run", "--sample-rate", "1.5"], "must be in (0, 1]"),
    (["run", "--dataset-size", "1", "--world-sizes", "2"], "smaller than the world size 2"),
    (["run", "--dataset-size", "3", "--sample-rate", "0.1"], "expected batch int(q * dataset size)"),
    (["run", "--seed", "-1"], "--seed -1: must be in"),
])
def test_usage_errors_exit_2_with_one_line(capsys, args, says):
    assert cli.main(args) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert says in err and err.startswith("dpfsdp-verify: error:") and "hint:" in err
    assert len(err.splitlines()) == 1


def test_sampling_axis_selects_and_the_seed_replays(tmp_path, pool, monkeypatch, capsys):
    """--sampling picks the DP-step properties' sampling; Poisson knobs reach the spec; a property
    that runs under Poisson only is a skip that says why under --sampling fixed; --seed replays."""
    from dpfsdp_verify.gate.plan import RunPlan

    plan = RunPlan.from_args(cli.build_parser().parse_args(
        ["run", "--sampling", "poisson", "--seeding", "same,per_rank", "--sample-rate", "0.5", "--dataset-size", "6",
         "--seed", "7"]))
    opts = plan.options
    assert (opts.samplings, opts.seedings, opts.sample_rate, opts.dataset_size, opts.seed) == \
        (("poisson",), ("same", "per_rank"), 0.5, 6, 7)
    points = PROPERTIES["clipped_step"].points(PROPERTIES["clipped_step"].with_defaults(opts))
    assert {(p.sampling, p.seeding) for p in points} == {("poisson", "same"), ("poisson", "per_rank")}
    spec = points[0].spec()
    assert (spec.sampling, spec.sample_rate, spec.dataset_size, spec.expected_batch_size) == ("poisson", 0.5, 6, 3)
    fixed = RunPlan.from_args(cli.build_parser().parse_args(["run", "--sampling", "fixed"])).options
    v, = PROPERTIES["sampling_accounting"].plan(PROPERTIES["sampling_accounting"].with_defaults(fixed))
    assert v.status == "skip" and "poisson sampling only" in v.message
    seeds = {RunPlan.from_args(cli.build_parser().parse_args(["run"])).options.seed for _ in range(3)}
    assert len(seeds) == 3  # a fresh seed per run
    # the cheapest statistical property (no training): its evidence is a function of the draws
    sel = ["run", "--properties", "sampling_accounting", "--world-sizes", "1", "--seeding", "per_rank",
           "--target", "fixtures.specimens:Correct", "-q"]
    reports = []
    for seed in ("12345", "12345", "54321"):
        j = tmp_path / f"{len(reports)}.json"
        assert run_gate(pool, monkeypatch, capsys, *sel, "--seed", seed, "--json", str(j)).returncode == 0
        reports.append(json.loads(j.read_text()))
    a, b, c = reports
    assert a["seed"] == b["seed"] == 12345 and c["seed"] == 54321
    draws = [r["evidence"] for r in a["results"]]
    assert draws == [r["evidence"] for r in b["results"]]      # same seed: the same draws
    assert draws != [r["evidence"] for r in c["results"]]      # another seed: fresh draws
    assert all("--seed 12345" in r["repro"] for r in a["results"])


def test_nccl_without_gpus_is_a_usage_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("GPUs present")
    assert cli.main(["run", "--backend", "nccl"]) == cli.EXIT_USAGE
    assert "needs CUDA GPUs" in capsys.readouterr().err


def test_list_and_version(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(pid in out for pid in PROPERTIES) and "MODULE:ATTR" in out
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and "dpfsdp-verify 0.1.0" in capsys.readouterr().out


def test_help_shows_groups_and_imports_no_torch():
    # --help is what a newcomer runs first: it answers without importing torch (seconds), the
    # run options grouped, the three options they need first at the top
    for args in (["--help"], ["run", "--help"]):
        res = subprocess.run([sys.executable, "-X", "importtime", "-m", "dpfsdp_verify", *args], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        imported = [line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines()
                    if line.startswith("import time:")]
        assert "dpfsdp_verify.gate.cli" in imported
        assert not [m for m in imported if m == "torch" or m.startswith("torch.")], args
    out = res.stdout
    groups = ["\nwhat to check:", "\nreports:", "\nmatrix (", "\nsampling (", "\nloop shapes:", "\nexecution:"]
    assert all(g in out for g in groups) and [out.index(g) for g in groups] == sorted(out.index(g) for g in groups)
    first = out.index("what to check:")
    where = lambda opt: out.index("\n  " + opt, first)  # noqa: E731 - its line in the groups, not the usage
    assert where("--target") < where("--expect") < where("--json") < out.index("\nmatrix (")
    from dpfsdp_verify.config.defaults import POISSON_DEFAULTS

    assert f"q in (0, 1] (default {POISSON_DEFAULTS[0]:g})" in out


@pytest.mark.slow
def test_upstream_opacus_verdicts(tmp_path):
    """Upstream opacus 1.6.0 ghost_fsdp: norms exact at 1 and 2 ranks on both layouts; the
    one-step update is right under "mean" and, at 2 ranks under "sum", half the DP-SGD sum (a
    real upstream finding: FSDP averages gradients and opacus only compensates under "mean")."""
    j, x, md = tmp_path / "r.json", tmp_path / "r.xml", tmp_path / "r.md"
    r = run_cli("run", "--properties", "norm_fidelity,clipped_step", "--world-sizes", "1,2", "--models", "mlp",
                "--precisions", "fp32", "--json", str(j), "--junit", str(x), "--markdown", str(md))
    assert r.returncode == 1, r.stderr
    report = json.loads(j.read_text())
    assert report["tool"] == "dpfsdp-verify" and report["target"]["name"] == "opacus"
    assert report["target"]["version"] == "1.6.0" and report["environment"]["backend"] == "gloo"
    # which opacus was imported: the report names its version and where it came from
    import opacus

    assert report["schema_version"] == 1 and report["target"]["opacus"]["version"] == opacus.__version__
    assert report["target"]["opacus"]["path"] == os.path.dirname(opacus.__file__)
    assert f"[opacus {opacus.__version__} from {os.path.dirname(opacus.__file__)}]" in r.stderr
    verdicts = {(v["property"], v["config"]["model"], v["config"]["world_size"], v["config"]["data_layout"],
                 v["config"]["reduction"], v["config"]["dtype"], v["config"].get("sampling", "fixed")):
                (v["status"], v["diagnosis"]) for v in report["results"] if not v["config"].get("horizon")}
    # float64 and float32 by default for these two; clipped_step under fixed and Poisson sampling (the
    # layer zoo rides only beside the property's own models, not a --models selection); beyond the
    # matrix (docs/horizon.md) norm_fidelity at the third and the fourth rank and clipped_step's long run
    assert len(verdicts) + 1 == len(report["results"]) == 35  # the long run is keyed apart (below)
    assert verdicts[("norm_fidelity", "mlp", 3, "split", "mean", "float64", "fixed")] == ("pass", None)
    assert verdicts[("norm_fidelity", "mlp", 4, "split", "mean", "float64", "fixed")] == ("pass", None)
    long_run, = [v for v in report["results"] if v["config"].get("horizon")]
    assert (long_run["property"], long_run["status"], long_run["config"]["world_size"]) == ("clipped_step", "pass", 2)
    for dtype in ("float64", "float32"):
        for ws in (1, 2):
            for layout in ("replicated", "split"):
                for red in ("mean", "sum"):
                    assert verdicts[("norm_fidelity", "mlp", ws, layout, red, dtype, "fixed")] == ("pass", None)
        for sampling in ("fixed", "poisson"):
            assert verdicts[("clipped_step", "mlp", 1, "split", "mean", dtype, sampling)] == ("pass", None)
            assert verdicts[("clipped_step", "mlp", 1, "split", "sum", dtype, sampling)] == ("pass", None)
            assert verdicts[("clipped_step", "mlp", 2, "split", "mean", dtype, sampling)] == ("pass", None)
            assert verdicts[("clipped_step", "mlp", 2, "split", "sum", dtype, sampling)] == ("fail", "mismatch")
    assert report["summary"] == {"pass": 31, "fail": 4, "hang": 0, "error": 0, "skip": 0, "expected": 0}
    assert isinstance(report["seed"], int) and f"--seed {report['seed']}" in r.stderr  # the run's seed, replayable
    assert "[" in r.stderr and "norm_fidelity" in r.stderr  # progress on stderr
    # one cause, one finding: the four failures are one block, and the last line says so
    assert "4 unexpected failure(s), 1 cause(s)" in r.stdout and "[1] clipped_step fail (mismatch)" in r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith("dpfsdp-verify: FAILED (exit 1): 31 passed, 4 failed")
    suite = ET.parse(x).getroot().find("testsuite")
    assert suite.get("tests") == "35" and suite.get("failures") == "4"
    assert "1/world_size" in suite.find("testcase/failure").text
    assert "clipped_step" in md.read_text()


@pytest.mark.slow
def test_fork_with_planted_sqrt_n_bug(tmp_path, pool, monkeypatch, capsys):
    j, md = tmp_path / "r.json", tmp_path / "r.md"
    r = run_gate(pool, monkeypatch, capsys, "run", "--target", "fixtures.sqrtn_fork.target:ForkTarget",
                 "--properties", "norm_fidelity",
                "--world-sizes", "1,2", "--models", "mlp", "--loss-reductions", "mean", "--json", str(j),
                "--markdown", str(md))
    assert r.returncode == 1, r.stderr
    got = {(v["config"]["world_size"], v["config"]["data_layout"]): (v["status"], v["diagnosis"])
           for v in json.loads(j.read_text())["results"]}
    assert got[(1, "replicated")] == got[(1, "split")] == ("pass", None)
    assert got[(2, "replicated")] == ("fail", "sqrt_n_inflation")
    # on split data the same all-reduce adds *different* samples' norms: the precise diagnosis
    assert got[(2, "split")] == ("fail", "sample_mixing")
    assert "sqrt(2)" in r.stdout
    # the CI summary page: measured ratio next to the sqrt(N) line (exactly on it when replicated)
    assert "| 2 | replicated | mlp | mean | float64 | 1.414214 | 1.414214 | fail sqrt_n_inflation |" in md.read_text()
    assert "| 1 | replicated | mlp | mean | float64 | 1.000000 | 1.000000 | pass  |" in md.read_text()


@pytest.mark.slow
def test_crashing_mode_is_an_error_not_a_hang(tmp_path, pool, monkeypatch, capsys):
    j = tmp_path / "r.json"
    r = run_gate(pool, monkeypatch, capsys, "run", "--target", "fixtures.gate_specimens:DeferredCrashesOnRank1",
                 "--properties",
                "mode_equivalence", "--world-sizes", "2", "--models", "mlp", "--loss-reductions", "mean",
                "--mode-env", "immediate:OPACUS_USE_DEFERRED_NORM=0", "--mode-env",
                "deferred:OPACUS_USE_DEFERRED_NORM=1", "--timeout", "30", "--json", str(j))
    assert r.returncode == 1, r.stderr
    results = json.loads(j.read_text())["results"]
    assert results and all(v["status"] == "error" and v["diagnosis"] == "rank_crash" for v in results)
    msg = results[0]["message"]
    assert "deferred" in msg and "rank 1" in msg and "planted crash" in msg


def test_fuzz_option_adds_shrunk_fuzz_verdicts(tmp_path, pool, monkeypatch, capsys):
    """--fuzz N: N hypothesis examples per fuzzable property; on the shape-edge specimen the
    failure comes back shrunk to the minimal shape, with a replay command."""
    import contextlib

    from dpfsdp_verify import harness

    j = tmp_path / "r.json"
    r = run_gate(pool, monkeypatch, capsys, "run", "--target", "fixtures.shape_edge:FloorShardNorms", "--properties",
                 "norm_fidelity",
                "--world-sizes", "2", "--models", "mlp", "--loss-reductions", "mean", "--fuzz", "10",
                "--json", str(j))
    assert r.returncode == 1, r.stderr
    fuzzed = [v for v in json.loads(j.read_text())["results"] if "fuzz" in v["config"]]
    assert len(fuzzed) == 1
    v = fuzzed[0]
    assert (v["status"], v["diagnosis"]) == ("fail", "undercount")
    assert dict(v["config"]["model_kwargs"]) == {"d_in": 1, "hidden": 1, "classes": 2}
    assert v["repro"].startswith("dpfsdp-verify replay ")
    # the repro line is a verb of the same CLI: it re-runs exactly that spec and fails again
    args = shlex.split(v["repro"])
    # replay's own Pool() is the warm pool here (the pool fixture proves its ranks are gone)
    monkeypatch.setattr(harness, "Pool", lambda *a, **k: contextlib.nullcontext(pool))
    again = run_gate(pool, monkeypatch, capsys, *args[1:])
    assert again.returncode == 1, again.stderr
    assert "norm_fidelity: FAIL (undercount)" in again.stdout


@pytest.mark.parametrize("args, says", [
    (["--property", "noise_calibration", "--world-size", "2", "--spec", "{}"], "cannot be fuzzed"),
    (["--property", "norm_fidelity", "--world-size", "0", "--spec", "{}"], "must be an integer >= 1"),
    (["--property", "norm_fidelity", "--world-size", "2", "--spec", "{nope"], "not a RunSpec in JSON"),
    (["--property", "norm_fidelity", "--world-size", "2", "--spec", '{"bogus": 1}'], "not a RunSpec in JSON"),
    (["--property", "norm_fidelity", "--world-size", "2"], "--spec"),
])
def test_replay_usage_errors_exit_2_with_one_line(capsys, args, says):
    assert cli.main(["replay", *args]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert says in err and err.startswith("dpfsdp-verify: error:") and len(err.splitlines()) == 1


def test_skips_are_printed_with_their_reason(monkeypatch, capsys):
    from dpfsdp_verify.gate.session import Session
    from dpfsdp_verify.verdict import Verdict

    skip = Verdict("sensitivity_bound", "skip", {"world_size": 2, "data_layout": "replicated", "model": "mlp",
                                                  "mode": "default", "grad_sample_mode": "ghost_fsdp"},
                   message="leave-one-out needs split data")
    monkeypatch.setattr(Session, "run", lambda self: [skip])
    assert cli.main(["run", "--properties", "sensitivity_bound", "--world-sizes", "2", "-q"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "skipped:" in out and "sensitivity_bound [ws=2 replicated mlp" in out
    assert "leave-one-out needs split data" in out


def test_a_listing_cut_short_by_its_reader_is_no_internal_error():
    """``dpfsdp-verify list | head -1``: the reader closes the pipe; exit 0 and nothing on stderr
    (it was a traceback and "internal error", exit 3)."""
    import subprocess
    import sys

    done = subprocess.run(f"{sys.executable} -m dpfsdp_verify list | head -1; exit ${{PIPESTATUS[0]}}", shell=True,
                          executable="/bin/bash", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("properties") and done.stderr == "", done.stderr

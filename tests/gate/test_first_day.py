"""A fork's first day with the gate (docs/gate.md): a crash names the fork's line, one cause is one
finding, a baseline in one command that a following ``--expect`` run accepts, a green run that
reads green. On the specimen forks of ``fixtures/fork_specimens.py``."""

from __future__ import annotations

import json
import os

from dpfsdp_verify.gate import causes, report
from dpfsdp_verify.gate import expectations
from dpfsdp_verify.gate.expectations import baseline, generalise
from dpfsdp_verify.gate.result import judge
from dpfsdp_verify.harness.frames import HARNESS_DIR, user_frames
from dpfsdp_verify.targets.crash_site import locate
from dpfsdp_verify.verdict import Verdict
from fixtures import fork_specimens
from tests.verdict_helpers import run_gate

F = "fixtures.fork_specimens:"
#: a narrow, fixed selection: a few cases per world size
NARROW = ("--properties", "clipped_step", "--models", "mlp", "--loss-reductions", "mean", "--dtypes", "float64",
          "--sampling", "fixed", "--explore", "0", "--horizon", "0", "--wide-world-size", "0",
          "--node-world-size", "0", "--seed", "7", "-q")


def planted(function: str) -> str:
    """``fixtures/fork_specimens.py:LINE`` of the line marked BUG in ``function``."""
    lines = open(fork_specimens.__file__).read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(f"def {function}("))
    n = next(i for i in range(start, len(lines)) if "# BUG" in lines[i]) + 1
    return f"fixtures/fork_specimens.py:{n}"


def test_crash_site_is_the_innermost_frame_of_the_target_not_the_harness_or_torch():
    here = os.path.abspath(fork_specimens.__file__)
    frames = [(os.path.join(HARNESS_DIR, "rank.py"), 305, "_run_job", "value = fn(*args, **kwargs)"),
              (os.path.join(os.path.dirname(HARNESS_DIR.rstrip(os.sep)), "targets", "__init__.py"), 116,
               "run_many_on_rank", "out.append(target.run(s))"),
              (here, 36, "clip_coefficients", "return coef.view(len(norms), 2)"),
              ("/usr/lib/python3/site-packages/torch/_tensor.py", 9, "view", "")]
    site = locate(1, "RuntimeError", "shape '[4, 2]' is invalid\nsecond line", frames, F + "CrashesMidStep")
    assert (site.at, site.in_target) == ("fixtures/fork_specimens.py:36 in clip_coefficients", True)
    assert site.exception == "RuntimeError: shape '[4, 2]' is invalid"  # one line
    assert [f["origin"] for f in site.evidence()["traceback"]] == ["harness", "suite", "target", "library"]
    assert [f[2] for f in user_frames(frames)] == ["run_many_on_rank", "clip_coefficients", "view"]
    # no frame of the target's: say where it was raised, and that it is not the target's line
    assert "no frame of the target's own" in locate(0, "E", "", frames[:2], F + "X").phrase()


def _v(prop, ws, status="fail", diagnosis="mismatch", at=None, **config):
    ev = {"crash": {"at": at, "exception": "TypeError: x"}} if at else {}
    return Verdict(prop, status, {"world_size": ws, "model": "mlp", **config}, diagnosis, "m", ev)


def test_identical_crashes_are_one_cause_and_the_baseline_generalises():
    crash = [_v(p, ws, "error", "rank_crash", at="fork.py:3 in wrap", dtype=d)
             for p in ("clipped_step", "trajectory") for ws in (2, 3) for d in ("float32", "float64")]
    found = causes.group(crash + [_v("clipped_step", 1)])
    assert [len(c.verdicts) for c in found] == [8, 1]
    text = found[0].block(1, 80)
    assert text.startswith("[1] error (rank_crash) at fork.py:3 in wrap: TypeError: x")
    assert "8 verdicts in clipped_step, trajectory; world_size 2-3" in " ".join(text.split())
    assert all(len(line) <= 80 for line in text.splitlines() if "repro:" not in line)
    passed = [_v("clipped_step", 1, "pass", None, dtype="float64")]
    group = [v for v in crash if v.property == "clipped_step"]
    assert generalise(group, passed) == {"world_size": ">= 2"}  # dtype left out: both dtypes failed alike
    assert generalise(group, []) == {}
    # a message with characters beyond the BMP (math italic sigma) and quotes stays valid TOML
    odd = Verdict("clipped_step", "fail", {"world_size": 1}, "mismatch", 'std \U0001d70e "2x" \\ off', {})
    text = baseline([odd], {"opacus": "1.6.0", "torch": "2.13.0", "backend": "gloo"}, "d", causes.group([odd]))
    assert expectations.parse(text).entries[0].reason.endswith('std \U0001d70e "2x" \\ off')


def test_counts_in_pytest_words_and_a_last_line_that_states_the_outcome():
    vs = [_v("p", 1, "pass", None), _v("p", 2), _v("p", 3, "error", "rank_crash")]
    assert report.counts_text(judge(vs, {})) == "1 passed, 1 failed, 1 error"
    assert report.last_line(0, "1 passed", 0) == "dpfsdp-verify: PASSED (exit 0): 1 passed"
    assert report.last_line(1, "1 failed", 2) == "dpfsdp-verify: FAILED (exit 1): 1 failed; 2 causes above"


def test_a_setup_crash_names_the_forks_line_and_its_baseline_accepts_it(tmp_path, pool, monkeypatch, capsys):
    j, base = tmp_path / "r.json", tmp_path / "baseline.toml"
    r = run_gate(pool, monkeypatch, capsys, "run", "--target", F + "CrashesAtSetup", "--world-sizes", "1,2", *NARROW,
                 "--json", str(j), "--write-expect", str(base))
    assert r.returncode == 1, r.stdout + r.stderr
    head = " ".join(" ".join(r.stdout.splitlines()[:40]).split())  # wrapped to the terminal: words only
    assert f"at {planted('wrap_for_fsdp')} in wrap_for_fsdp: TypeError" in head and "1 cause(s)" in head
    assert "rank.py" not in r.stdout and "_run_job" not in r.stdout  # the harness's frames stay in the JSON
    results = json.loads(j.read_text())["results"]
    assert len(results) > 1 and all(v["diagnosis"] == "rank_crash" for v in results)
    frames = results[0]["evidence"]["crash"]["traceback"]
    assert frames[-1]["origin"] == "target" and frames[-1]["function"] == "wrap_for_fsdp"
    assert any(f["origin"] == "harness" for f in frames)
    assert base.read_text().count("[[expect]]") == 1  # one cause, one property: one entry, no config
    again = run_gate(pool, monkeypatch, capsys, "run", "--target", F + "CrashesAtSetup", "--world-sizes", "1,2",
                     *NARROW, "--expect", str(base))
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.rstrip().splitlines()[-1] == (f"dpfsdp-verify: PASSED (exit 0): 0 passed, {len(results)} "
                                                      "xfailed, 0 unmet")


def test_a_mid_step_crash_names_the_forks_line(pool, monkeypatch, capsys):
    r = run_gate(pool, monkeypatch, capsys, "run", "--target", F + "CrashesMidStep", "--world-sizes", "2", *NARROW)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"at {planted('clip_coefficients')} in clip_coefficients: RuntimeError: shape" in " ".join(r.stdout.split())


def test_mixed_causes_baseline_then_expect_exits_0_and_a_new_failure_exits_1(tmp_path, pool, monkeypatch, capsys):
    one, both = tmp_path / "ws1.toml", tmp_path / "ws12.toml"
    r = run_gate(pool, monkeypatch, capsys, "run", "--target", F + "MixedCauses", "--world-sizes", "1", *NARROW,
                 "--write-expect", str(one))
    assert r.returncode == 1 and "[1] clipped_step fail (mismatch)" in r.stdout, r.stdout
    # the world size 2 crash is news to a baseline of world size 1: exit 1, naming it
    r = run_gate(pool, monkeypatch, capsys, "run", "--target", F + "MixedCauses", "--world-sizes", "1,2", *NARROW,
                 "--expect", str(one), "--write-expect", str(both))
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"at {planted('aggregate_norms')} in aggregate_norms" in " ".join(r.stdout.split())
    text = both.read_text()
    assert text.count("[[expect]]") == 2 and 'world_size = ">= 2"' in text and 'diagnosis = "rank_crash"' in text
    r = run_gate(pool, monkeypatch, capsys, "run", "--target", F + "MixedCauses", "--world-sizes", "1,2", *NARROW,
                 "--expect", str(both))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.rstrip().splitlines()[-1].startswith("dpfsdp-verify: PASSED (exit 0): 0 passed, ")


def test_usage_errors_answer_before_torch_or_the_target_is_imported():
    """What keeps a usage error under a second (measured 0.9-1.7 s on a loaded 2-core box, as
    ``--help``; 6-15 s before): neither torch nor opacus is imported to find it."""
    import subprocess
    import sys

    code = ("import sys; from dpfsdp_verify.gate import cli; "
            "rc = [cli.main(a) for a in (['run', '--world-sizes', 'abc'], ['run', '--models', 'resnet'], "
            "['run', '--meshes', 'bogus'], ['run', '--expect', '/no/such.toml'], ['run', '--frobnicate'])]; "
            "print(rc, 'torch' in sys.modules, 'opacus' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split("\n")[0] == "[2, 2, 2, 2, 2] False False", done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 5  # one line each

"""``benchmarks/run.py --quick``: the benchmark script still runs, end to end, so it cannot rot.

It stopped once at its first section on a message's old wording; its checks now judge statuses,
diagnoses and ranks. The short form runs every section with a few repeats (the gate's cheapest
property, the HookCollective gate on ``deadlock_free`` only); its figures are not the benchmark's
(docs/benchmarks.md). Slow: about a minute of rank start-ups on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from tests.plugin.test_plugin import assert_no_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~1-2 min on 2 idle cores; 6-7 min when the machine is shared
def test_benchmark_script_quick_form_runs_every_section(tmp_path):
    tag = uuid.uuid4().hex  # every rank the script starts carries it: proven gone below
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "DPFSDP_TEST_TAG": tag})
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = json.loads(out.read_text())
        assert set(results) == {"harness", "reference", "fuzz", "gate", "hang_gate", "cli_gate"}
        # the table: one header per section, then its figures
        for section in results:
            assert f"[{section}]" in proc.stdout
        assert results["harness"]["warm_pool_ms_per_test"] > 0
        # upstream's only non-passing verdicts there: its pinned float32 overflow (docs/findings.md, finding 15)
        assert results["gate"]["verdicts"] > 0
        assert {tuple(c) for c in results["gate"]["not_pass_cases"]} <= {
            ("sensitivity_bound", "extreme", "fail", "non_finite")}
        # the CLI gate as a user runs it: upstream's pinned findings expected, so exit 0
        assert results["cli_gate"]["exit_code"] == 0 and results["cli_gate"]["verdicts"] > 0
        hang = results["hang_gate"]
        # HookCollective hangs in every 2-rank job: each deadlock_free case is a proven deadlock, exit 1
        assert hang["gate_hook_collective_exit_code"] == 1
        assert hang["gate_hook_collective_hang_verdicts"] == hang["gate_hook_collective_verdicts"] > 0, (
            hang["gate_hook_collective_other_verdicts"], proc.stdout[-3000:])
    finally:
        assert_no_ranks(tag)


def test_gate_runs_counts_a_run_that_does_not_exit_0_and_its_unexpected_verdicts(tmp_path, monkeypatch):
    """``benchmarks/gate_runs.py`` (whole default-gate runs, docs/benchmarks.md): each run's exit code
    and the report's non-passing verdicts that are not expected are what it counts; an expected
    failure (``--expect``, upstream) and a skip are not false alarms. The CLI is replaced by a fake
    that writes a report (the real gate runs take a minute each)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import gate_runs
    finally:
        sys.path.pop(0)
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        target, seed = cmd[cmd.index("--target") + 1], int(cmd[cmd.index("--seed") + 1])
        bad = target == "opacus" and seed == 2
        results = [{"property": "clipped_step", "status": "pass", "config": {}, "expected": False},
                   {"property": "clipped_step", "status": "fail", "diagnosis": "mismatch", "config": {},
                    "expected": target == "opacus" and not bad, "message": "m"},
                   {"property": "deadlock_free", "status": "pass", "config": {"explore": {"draws": 3}},
                    "expected": False},
                   {"property": "privacy_audit", "status": "skip", "config": {}, "expected": False}]
        if target != "opacus":
            results = [r for r in results if r["status"] != "fail"]
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump({"results": results}, f)
        return subprocess.CompletedProcess(cmd, 1 if bad else 0, "", "")

    monkeypatch.setattr(gate_runs.subprocess, "run", fake_run)
    out = tmp_path / "runs.jsonl"
    assert gate_runs.main(["--runs", "2", "--seed", "1", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["target"], r["seed"], r["exit"]) for r in rows] == [
        ("fixtures.specimens:Correct", 1, 0), ("opacus", 1, 0), ("fixtures.specimens:Correct", 2, 0), ("opacus", 2, 1)]
    assert all("--expect" in c for c in calls if "opacus" in c) and not any("--expect" in c for c in calls
                                                                             if "opacus" not in c)
    assert [len(r["unexpected"]) for r in rows] == [0, 0, 0, 1] and all(r["explored"] == 3 for r in rows)


@pytest.mark.slow
def test_gate_profile_reads_the_ranks_jobs_and_splits_their_cpu(tmp_path):
    """``benchmarks/gate_profile.py`` on a one-property gate: every rank job left a CPU profile
    (``harness/rank.py``'s ``PROFILE_DIR_ENV``), the entries it splits them by are found in them
    (the opacus adapter's training loop), and no rank is left behind."""
    tag = uuid.uuid4().hex  # every rank the script starts carries it: proven gone below
    out = tmp_path / "profile.json"
    try:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gate_profile.py"), "--out", str(out),
                               "--", "--properties", "clipped_step", "--world-sizes", "1", "--explore", "0"],
                              cwd=ROOT, capture_output=True, text=True, timeout=240,
                              env={**os.environ, "DPFSDP_TEST_TAG": tag})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        got = json.loads(out.read_text())
        assert got["jobs"] > 0 and got["jobs_cpu_s"] > 0 and got["self_cpu_s"] > 0
        train = got["entries"]["the target's training loop (forward, backward, clip, noise, step)"]
        assert 0 < train <= got["jobs_cpu_s"] * 1.01
    finally:
        assert_no_ranks(tag)


def _doc_table():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import doc_table
    finally:
        sys.path.pop(0)
    return doc_table


def test_doc_table_keeps_one_current_table_and_moves_the_replaced_one_to_the_dated_history():
    """``benchmarks/run.py --doc``: the sections measured replace their rows, the others keep theirs
    (and their dates), and the table replaced goes, dated, under the history heading."""
    t = _doc_table()
    doc = "# Benchmarks\n\nWhat this is.\n\n## Older\n\ntext\n\n## History\n\nold things\n"
    first = t.rewrite(doc, {"gate": {"wall_s": 61.234567, "cases": ["a", "b"]}, "fuzz": {"ex_s": 19.5}},
                      {"gate": "day 1, load 1.0", "fuzz": "day 1, load 1.1"}, "day 1")
    assert first.count(t.BEGIN) == 1 and first.count(t.END) == 1
    assert first.index(t.BEGIN) < first.index("## Older")  # after the first paragraph
    assert t.current_rows(first) == [("gate", "wall_s", "61.23", "day 1, load 1.0"),
                                     ("gate", "cases", "a; b", "day 1, load 1.0"),
                                     ("fuzz", "ex_s", "19.5", "day 1, load 1.1")]
    assert "### The current table until" not in first  # nothing replaced yet
    second = t.rewrite(first, {"gate": {"wall_s": 58.0}, "harness": {"warm_ms": 1.3}},
                       {"gate": "day 2, load 0.9", "harness": "day 2, load 0.9"}, "day 2")
    assert second.count(t.BEGIN) == 1 and second.count(t.END) == 1
    # gate replaced (its old "cases" row gone with it), fuzz kept with its own date, harness added last
    assert t.current_rows(second) == [("gate", "wall_s", "58", "day 2, load 0.9"),
                                      ("fuzz", "ex_s", "19.5", "day 1, load 1.1"),
                                      ("harness", "warm_ms", "1.3", "day 2, load 0.9")]
    history = second[second.index("## History"):]
    assert "### The current table until day 2 (its rows measured day 1, load 1.0, day 1, load 1.1)" in history
    assert "| gate | wall_s | 61.23 | day 1, load 1.0 |" in history and "old things" in history
    with pytest.raises(ValueError, match="History"):
        t.rewrite("# no history here\n", {"gate": {"x": 1}}, {"gate": "now"}, "now")


def test_the_benchmarks_doc_has_one_written_current_table():
    """docs/benchmarks.md: one current table, the script's (between its markers), above the history."""
    t = _doc_table()
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        doc = f.read()
    assert doc.count(t.BEGIN) == 1 and doc.count(t.END) == 1
    assert doc.index(t.END) < doc.index(t.HISTORY + "\n")
    rows = t.current_rows(doc)
    assert rows and {s for s, _, _, _ in rows} >= {"cli_gate"}

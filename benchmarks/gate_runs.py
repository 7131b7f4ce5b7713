"""False alarms of the whole default gate, as a user runs it: ``dpfsdp-verify run`` (no option but
the target, the run seed and the report) on correct targets, one run per seed, exploration included.

    python benchmarks/gate_runs.py --runs N [--seed S] [--targets fixtures.specimens:Correct,opacus]
        [--out results.jsonl] [--budget-s SECONDS]

For each run seed S, S+1, ... and each target in turn: the CLI in a fresh process (the target
``opacus`` with ``--expect opacus-1.6.0``: its pinned findings are expected, anything else is not);
one JSON line per gate run appended to ``--out`` (target, seed, exit code, wall seconds, verdicts,
the non-passing verdicts that are not expected, the explored configurations judged: the
exploration summary's ``draws``), then the tally per target: runs, runs that did not exit 0 (a
false alarm: a correct target must pass the gate), verdicts judged, explored configurations. The
gate's statistical checks state their false-alarm bounds (``noise_calibration`` 1e-4 + 1e-5 per gate
run, the release judge 1e-4, ``sampling_accounting`` 1.1e-4; docs/properties.md), so the expected
count over N runs is ~N x 3.3e-4.
``--budget-s`` stops starting new runs after that many seconds (the results so far are kept; a
later call with ``--seed`` past the last one adds to them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

EXPECT = {"opacus": ["--expect", "opacus-1.6.0"]}


def gate_run(target: str, seed: int) -> dict:
    """One default gate run of ``target`` at run seed ``seed`` (module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = ["dpfsdp-verify", "run", "--target", target, "--seed", str(seed), "--json", report,
               *EXPECT.get(target, [])]
        env = {k: v for k, v in os.environ.items() if k != "DPFSDP_VERIFY_EXPLORE"}  # the default budget
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.monotonic() - t0
        row = {"target": target, "seed": seed, "exit": proc.returncode, "wall_s": round(wall, 1)}
        try:
            with open(report) as f:
                rep = json.load(f)
        except (OSError, ValueError):
            row["problem"] = (proc.stderr or proc.stdout)[-2000:]
            return row
    results = rep.get("results", [])
    row["verdicts"] = len(results)
    row["explored"] = sum(int((v.get("config", {}).get("explore") or {}).get("draws", 0)) for v in results)
    row["unexpected"] = [{"property": v["property"], "status": v["status"], "diagnosis": v.get("diagnosis"),
                          "config": v.get("config"), "message": v.get("message", "")[:600]}
                         for v in results if v["status"] not in ("pass", "skip") and not v.get("expected")]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=20_000)
    ap.add_argument("--targets", default="fixtures.specimens:Correct,opacus")
    ap.add_argument("--out", default="gate_runs.jsonl")
    ap.add_argument("--budget-s", type=float, default=0.0, help="start no run after this many seconds (0: none)")
    args = ap.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    t0 = time.monotonic()
    tally: dict = defaultdict(lambda: {"runs": 0, "alarms": 0, "verdicts": 0, "explored": 0, "wall": []})
    for seed in range(args.seed, args.seed + args.runs):
        for target in targets:
            if args.budget_s and time.monotonic() - t0 > args.budget_s:
                break
            row = gate_run(target, seed)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            t = tally[target]
            t["runs"] += 1
            t["alarms"] += row["exit"] != 0
            t["verdicts"] += row.get("verdicts", 0)
            t["explored"] += row.get("explored", 0)
            t["wall"].append(row["wall_s"])
            print(f"{target} seed {seed}: exit {row['exit']}, {row.get('verdicts', '?')} verdicts, "
                  f"{row.get('explored', '?')} explored, {row['wall_s']} s"
                  + (f"; NOT PASSING: {[(u['property'], u['status'], u['diagnosis']) for u in row['unexpected']]}"
                     if row.get("unexpected") else "") + (f"; {row['problem'][-300:]}" if "problem" in row else ""),
                  flush=True)
    for target, t in tally.items():
        walls = sorted(t["wall"])
        print(f"{target}: {t['alarms']} of {t['runs']} gate runs did not exit 0; {t['verdicts']} verdicts, "
              f"{t['explored']} explored configurations; wall median {walls[len(walls) // 2]:.0f} s, "
              f"max {walls[-1]:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

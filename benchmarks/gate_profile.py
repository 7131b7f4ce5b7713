"""Where a default gate's CPU goes: the gate process, its ranks, and inside the ranks' jobs.

    python benchmarks/gate_profile.py [--target opacus] [--seed 11] [-- EXTRA GATE OPTIONS]

Runs ``dpfsdp-verify run --target T --seed S`` (``--expect opacus-1.6.0`` for the built-in
``opacus``) once, every rank job profiled by cProfile on CPU time (``harness/rank.py``'s
``DPFSDP_VERIFY_PROFILE_DIR``), and prints: the gate process's own CPU seconds, its descendants'
(zygotes, ranks: start-up included), the jobs' CPU in all, and the share of the jobs' CPU under a
few entry points (the target's training steps, its FSDP wrapping, its accountant's epsilon, the
target's import, the suite's own code). Profiling slows pure-Python code several times over (the
accountant's most), so the shares are upper bounds for Python-heavy parts and the wall time is not
the gate's: measure that with ``benchmarks/run.py --sections gate``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pstats
import subprocess
import sys
import tempfile

#: (label, the file and function name a job's cumulative CPU is read under)
ENTRIES = (
    ("the target's training loop (forward, backward, clip, noise, step)", "opacus_target.py", "_train"),
    ("  of which the optimizer step (pre_step: clip, noise)", "opacus/optimizers/optimizer.py", "step"),
    ("the target's FSDP wrapping (opacus FSDP2Wrapper)", "fsdp_utils.py", "FSDP2Wrapper"),
    ("the target's accountant asked its epsilon (get_epsilon)", "opacus_target.py", "_report_accountant"),
    ("loading the target (imports in the job)", "dpfsdp_verify/targets/__init__.py", "load_target"),
)

_WRAPPER = """
import json, resource, runpy, sys, time
t0 = time.time()
try:
    sys.argv = ["dpfsdp-verify"] + sys.argv[1:]
    runpy.run_module("dpfsdp_verify", run_name="__main__")
finally:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print("GATE_PROFILE " + json.dumps({"self_cpu_s": s.ru_utime + s.ru_stime, "children_cpu_s": c.ru_utime
          + c.ru_stime, "children_sys_s": c.ru_stime, "wall_s": time.time() - t0}), file=sys.stderr)
"""


def _cumulative(stats: pstats.Stats, filename: str, name: str) -> float:
    return sum(v[3] for (f, _, n), v in stats.stats.items() if n == name and f.endswith(filename))  # type: ignore[attr-defined]


def _own_code(stats: pstats.Stats) -> float:
    """Self CPU of the suite's own functions (``dpfsdp_verify/``) inside the jobs."""
    return sum(v[2] for (f, _, _), v in stats.stats.items() if "/dpfsdp_verify/" in f)  # type: ignore[attr-defined]


def profile(target: str, seed: int, extra: list) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, DPFSDP_VERIFY_PROFILE_DIR=tmp)
        expect = ["--expect", "opacus-1.6.0"] if target == "opacus" else []
        cmd = [sys.executable, "-c", _WRAPPER, "run", "--target", target, "--seed", str(seed), "-q", *expect, *extra]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [x for x in proc.stderr.splitlines() if x.startswith("GATE_PROFILE ")]
        if not line:
            raise RuntimeError(f"the gate did not finish (exit {proc.returncode}): {proc.stderr[-2000:]}")
        out = dict(json.loads(line[-1].split(" ", 1)[1]), exit_code=proc.returncode)
        stats, paths = None, glob.glob(os.path.join(tmp, "*.prof"))
        out["jobs"] = len(paths)
        for path in paths:
            try:
                one = pstats.Stats(path)
            except (EOFError, ValueError):  # a job cut off mid-write (a hang the watchdog ended)
                continue
            stats = one if stats is None else (stats.add(one) or stats)
    jobs = stats.total_tt if stats is not None else 0.0  # type: ignore[attr-defined]
    out["jobs_cpu_s"] = jobs
    out["entries"] = {label: _cumulative(stats, f, n) if stats else 0.0 for label, f, n in ENTRIES}
    out["entries"]["the suite's own code (self time: adapter, reference, gathers)"] = _own_code(stats) if stats else 0.0
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="opacus")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "dpfsdp-verify-gate-profile.json"))
    ap.add_argument("extra", nargs="*", help="more gate options, after --")
    args = ap.parse_args(argv)
    out = profile(args.target, args.seed, args.extra)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"gate exit {out['exit_code']}, wall {out['wall_s']:.1f} s (profiled: not the gate's wall time)")
    print(f"CPU: gate process {out['self_cpu_s']:.1f} s; its descendants {out['children_cpu_s']:.1f} s "
          f"({out['children_sys_s']:.1f} s of it system); {out['jobs']} rank jobs {out['jobs_cpu_s']:.1f} s")
    for label, s in out["entries"].items():
        share = s / out["jobs_cpu_s"] if out["jobs_cpu_s"] else 0.0
        print(f"  {share:6.1%}  {s:7.1f} s  {label}")
    print(f"(JSON: {args.out})")
    return 0 if out["exit_code"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

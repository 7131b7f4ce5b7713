"""The default gate's time against the cores it is given, side by side; prints a table, writes JSON.

    python benchmarks/cores.py [--cpus 0 0,1] [--threads 8] [--out PATH]

Each ``--cpus`` set runs ``benchmarks/run.py --sections gate`` (the default gate on the installed
opacus, property by property on one warm pool) pinned to those CPUs with ``taskset -c``. Per run:
wall seconds per property and in all, the CPU seconds (user + system) of the run and every rank it
started, and the load average before and after -- on a machine shared with other work, CPU time
is the steadier figure. ``--threads N`` also runs the last CPU set with ``OMP_NUM_THREADS=N`` given
to the ranks (the harness gives them 1 unless the user sets it): N torch threads per rank on few
cores, what a rank that took one thread per core would cost on a many-core box.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _cpu import children_cpu_s  # noqa: E402


def gate_on(cpus: str, threads: int = 0) -> dict:
    """The default gate, property by property, pinned to ``cpus`` (``taskset -c``)."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gate.json")
        load0 = os.getloadavg()[0]
        cpu0, t0 = children_cpu_s(), time.perf_counter()
        cmd = ["taskset", "-c", cpus, sys.executable, os.path.join(HERE, "run.py"), "--sections", "gate", "--out", out]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall, cpu = time.perf_counter() - t0, children_cpu_s() - cpu0
        if proc.returncode != 0:
            raise RuntimeError(f"the gate on CPUs {cpus} failed: {proc.stderr[-2000:]}")
        with open(out) as f:
            gate = json.load(f)["gate"]
    return {"cpus": cpus, "cores": len(cpus.split(",")), "omp_num_threads": threads or None, "wall_s": wall,
            "cpu_s": cpu, "load_before": load0, "load_after": os.getloadavg()[0], **gate}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpus", nargs="+", default=["0", "0,1"], help="CPU sets for taskset -c (default: 0 and 0,1)")
    ap.add_argument("--threads", type=int, default=0, help="also run the last CPU set with OMP_NUM_THREADS=N ranks")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "dpfsdp-verify-cores.json"))
    args = ap.parse_args(argv)
    runs = [(c, 0) for c in args.cpus] + ([(args.cpus[-1], args.threads)] if args.threads else [])
    results = []
    for cpus, threads in runs:
        print(f"== CPUs {cpus}" + (f", OMP_NUM_THREADS={threads}" if threads else ""), file=sys.stderr, flush=True)
        results.append(gate_on(cpus, threads))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    keys = [k for k in results[0] if k.endswith("_s") or k in ("verdicts", "not_pass", "load_before", "load_after")]
    head = ["cpus"] + [r["cpus"] + (f" x{r['omp_num_threads']}thr" if r["omp_num_threads"] else "") for r in results]
    print("  ".join(f"{h:>24}" for h in head))
    for k in keys:
        cells = [f"{r[k]:>24.1f}" if isinstance(r[k], float) else f"{r[k]:>24}" for r in results]
        print("  ".join([f"{k:>24}"] + cells))
    print(f"(written to {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

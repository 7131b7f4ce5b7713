"""The suite's own speed, measured side by side in one run; prints a table and writes JSON.

    python benchmarks/run.py [--sections harness,fuzz,gate,reference,cli_gate] [--out FILE.json] [--quick]
        [--doc docs/benchmarks.md]

``--doc``: the figures measured go into that doc's one current table (``benchmarks/doc_table.py``):
the rows of the sections measured are replaced, the others kept with their own dates, and the
table replaced is moved, dated, under the doc's history.

Sections:
  harness    per-test overhead of a 2-rank distributed test: warm pool vs a fresh group per test
             (forked from the pool's zygotes) vs a spawned group per test (new interpreters) vs
             torch.multiprocessing.spawn per test (how MultiProcessTestCase/mp.spawn work);
             hang-verdict latency beyond the deadline, and until every rank process is gone.
  fuzz       hypothesis throughput (examples/s) of a small-MLP property at world sizes 1 and 2.
  gate       the default gate's wall time on the installed opacus, split by property.
  reference  reference cost on the transformer: torch.func fast path vs the per-sample loop.
  cli_gate   the default gate as a user runs it (``dpfsdp-verify run --target opacus --expect
             opacus-1.6.0 --seed 11``), 3 runs in a row: median wall and CPU seconds.
  hang_gate  a proven deadlock's latency from the divergence to the verdict (60 s deadline), and
             the default gate's wall time on fixtures.specimens:HookCollective (hangs everywhere).
--quick: every section in a short form (a few repeats, the gate's cheapest property, the
HookCollective gate on deadlock_free only) that checks the script still runs -- CI's slow set runs
it (tests/test_benchmarks.py); its figures are not the benchmark's.
Every check judges a verdict's status, diagnosis and ranks, never its wording.
Targets: warm overhead <= 50 ms and >= 50x below spawn; verdict <= deadline + 3 s; >= 20
examples/s; default gate <= 60 s on 2 cores; proven deadlock verdict <= 3 s after the divergence;
the gate on HookCollective <= 90 s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_jobs  # noqa: E402  (module-level job functions the ranks import)
from _cpu import children_cpu_s  # noqa: E402


def _median_ms(run_one, n: int) -> float:
    """Median wall time of ``n`` calls of ``run_one`` (which must return True), in ms."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        assert run_one()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def bench_harness(n_warm: int = 50, n_fresh: int = 5, hangs: int = 3) -> dict:
    from dpfsdp_verify.harness import Pool, pid_gone

    out = {}
    with Pool() as pool:
        pool.run(bench_jobs.tiny_test, world_size=2)  # start the group (not counted)
        out["warm_pool_ms_per_test"] = _median_ms(lambda: pool.run(bench_jobs.tiny_test, world_size=2).ok, n_warm)
    with Pool(reuse=False) as pool:  # ranks forked from the pool's zygotes (started first, not counted)
        pool.run(bench_jobs.tiny_test, world_size=2)
        out["fresh_group_ms_per_test"] = _median_ms(lambda: pool.run(bench_jobs.tiny_test, world_size=2).ok, n_fresh)
    with Pool(reuse=False, zygote_preload=None) as pool:  # every rank a new interpreter
        out["spawned_group_ms_per_test"] = _median_ms(lambda: pool.run(bench_jobs.tiny_test, world_size=2).ok,
                                                      n_fresh)
    out["mp_spawn_ms_per_test"] = _median_ms(lambda: bench_jobs.mp_spawn_tiny_test(2) or True, n_fresh)
    out["spawn_over_warm_ratio"] = out["mp_spawn_ms_per_test"] / out["warm_pool_ms_per_test"]

    deadline = 2.0
    lat, gone = [], []
    with Pool(spares=False) as pool:
        for _ in range(hangs):
            g = pool.group(2)
            pids = g.pids()
            t = time.perf_counter()
            # a hang no probe can prove, so the deadline is what ends it
            res = pool.run(bench_jobs.hang_outside_collectives, world_size=2, timeout=deadline)
            t_verdict = time.perf_counter() - t
            assert (res.status, res.diagnosis, res.busy_ranks) == ("hang", "timeout", [1]), res.message
            while not all(pid_gone(p) for p in pids):
                time.sleep(0.01)
            lat.append(t_verdict - deadline)
            gone.append(time.perf_counter() - t - deadline)
    out["hang_verdict_s_after_deadline"] = max(lat)
    out["hang_all_gone_s_after_deadline"] = max(gone)
    return out


def bench_hang_gate(repeats: int = 3, gate_args: tuple = ()) -> dict:
    """(a) divergence -> verdict latency of a proven deadlock under a 60 s deadline, for a rank that
    finished while its peer waits ("skip") and for mismatched collectives; (b) the default gate's
    wall time on ``fixtures.specimens:HookCollective`` (a hang in every distributed job)."""
    import subprocess

    from dpfsdp_verify.harness import Pool

    out = {}
    with Pool() as pool, tempfile.TemporaryDirectory() as tmp:
        pool.run(bench_jobs.tiny_test, world_size=2)
        for kind in ("skip", "mismatch"):
            lat = []
            for i in range(repeats):
                stamp = os.path.join(tmp, f"{kind}{i}")
                res = pool.run(bench_jobs.diverge_after, 1.5, kind, stamp, world_size=2, timeout=60.0)
                t_verdict = time.time()
                assert (res.status, res.diagnosis) == ("hang", "deadlock"), res.message
                with open(stamp) as f:
                    lat.append(t_verdict - float(f.read()))
            out[f"proven_{kind}_divergence_to_verdict_s_median"] = statistics.median(lat)
            out[f"proven_{kind}_divergence_to_verdict_s_max"] = max(lat)
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "hook.json")
        cmd = [sys.executable, "-m", "dpfsdp_verify", "run", "--target", "fixtures.specimens:HookCollective",
               "--timeout", "60", "-q", "--json", report, *gate_args]
        cpu0 = children_cpu_s()
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=os.path.dirname(HERE), capture_output=True, text=True)
        out["gate_hook_collective_wall_s"] = time.perf_counter() - t
        out["gate_hook_collective_cpu_s"] = children_cpu_s() - cpu0
        out["gate_hook_collective_exit_code"] = proc.returncode
        with open(report) as f:
            verdicts = json.load(f)["results"]
    out["gate_hook_collective_verdicts"] = len(verdicts)
    out["gate_hook_collective_hang_verdicts"] = sum((v["status"], v["diagnosis"]) == ("hang", "deadlock")
                                                    for v in verdicts)
    # the verdicts that are not a proven deadlock, shortened: what a failing check shows
    out["gate_hook_collective_other_verdicts"] = [
        f'{v["status"]}/{v["diagnosis"]}: {v["message"][:400]}' for v in verdicts
        if (v["status"], v["diagnosis"]) != ("hang", "deadlock")]
    return out


def bench_reference(repeats: int = 3) -> dict:
    import torch

    from dpfsdp_verify import models, reference

    model = models.build_model("transformer", 0)
    batch = models.make_batch("transformer", 32, 1)
    out = {}
    for method in ("loop", "vmap"):
        reference.per_sample_grads(model, batch, "mean", method)  # warm-up
        t = time.perf_counter()
        for _ in range(repeats):
            reference.per_sample_grads(model, batch, "mean", method)
        out[f"transformer_b32_{method}_ms"] = 1000 * (time.perf_counter() - t) / repeats
    out["loop_over_vmap_ratio"] = out["transformer_b32_loop_ms"] / out["transformer_b32_vmap_ms"]
    del torch
    return out


def bench_fuzz(**kw) -> dict:
    return bench_jobs.fuzz_throughput(**kw)


def bench_gate(**kw) -> dict:
    return bench_jobs.gate_wall_time(**kw)


def bench_cli_gate(repeats: int = 3, gate_args: tuple = ()) -> dict:
    """The default gate as a user runs it: ``dpfsdp-verify run --target opacus --expect opacus-1.6.0
    --seed 11`` in a fresh process, ``repeats`` times in a row: wall and CPU seconds (the gate
    process and every rank it started), the exit code and the verdicts of the last run."""
    walls, cpus, code, verdicts = [], [], None, None
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "gate.json")
        base = ["dpfsdp-verify", "run", "--target", "opacus", "--expect", "opacus-1.6.0", "--seed", "11", *gate_args]
        cmd = base + ["-q", "--json", report]
        env = {k: v for k, v in os.environ.items() if k != "DPFSDP_VERIFY_EXPLORE"}  # the default draws
        for _ in range(repeats):
            cpu0, t0 = children_cpu_s(), time.perf_counter()
            code = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
            walls.append(time.perf_counter() - t0)
            cpus.append(children_cpu_s() - cpu0)
        with open(report) as f:
            verdicts = len(json.load(f).get("results", []))
    return {"wall_s_median": statistics.median(walls), "wall_s_min": min(walls), "wall_s_max": max(walls),
            "cpu_s_median": statistics.median(cpus), "runs": repeats, "exit_code": code, "verdicts": verdicts,
            "command": " ".join(base)}


SECTIONS = {"harness": bench_harness, "reference": bench_reference, "fuzz": bench_fuzz, "gate": bench_gate,
            "hang_gate": bench_hang_gate, "cli_gate": bench_cli_gate}
#: ``--quick``: each section's arguments for a short run that proves the script works
QUICK = {"harness": {"n_warm": 5, "n_fresh": 1, "hangs": 1}, "reference": {"repeats": 1},
         "fuzz": {"n_examples": 3, "repeats": 1}, "gate": {"properties": ("sensitivity_bound",)},
         "hang_gate": {"repeats": 1, "gate_args": ("--properties", "deadlock_free", "--world-sizes", "2")},
         "cli_gate": {"repeats": 1, "gate_args": ("--properties", "sensitivity_bound", "--explore", "0")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "dpfsdp-verify-bench.json"))
    ap.add_argument("--quick", action="store_true", help="a short form of every section (CI: the script still runs)")
    ap.add_argument("--doc", help="write the figures into this doc's current table (docs/benchmarks.md; "
                                  "benchmarks/doc_table.py): the sections measured replace their rows")
    args = ap.parse_args(argv)
    if args.doc and args.quick:
        ap.error("--doc writes measured figures: not with --quick (its figures are not the benchmark's)")
    results, measured = {}, {}
    for name in [s.strip() for s in args.sections.split(",") if s.strip()]:
        if name not in SECTIONS:
            ap.error(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
        print(f"== {name}", file=sys.stderr, flush=True)
        measured[name] = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load "
                          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        try:
            results[name] = SECTIONS[name](**(QUICK[name] if args.quick else {}))
        except NotImplementedError as e:
            results[name] = {"skipped": str(e)}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    width = max((len(k) for sec in results.values() for k in sec), default=10)
    for name, sec in results.items():
        print(f"[{name}]")
        for k, v in sec.items():
            print(f"  {k:<{width}}  {v:.3f}" if isinstance(v, float) else f"  {k:<{width}}  {v}")
    print(f"(written to {args.out})")
    if args.doc:
        import doc_table

        with open(args.doc) as f:
            text = f.read()
        when = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
        with open(args.doc, "w") as f:
            f.write(doc_table.rewrite(text, results, measured, when))
        print(f"(the current table of {args.doc} rewritten: {', '.join(results)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

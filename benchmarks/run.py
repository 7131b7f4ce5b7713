"""The suite's own speed, measured side by side in one run; prints a table and writes JSON.

    python benchmarks/run.py [--sections harness,fuzz,gate,reference] [--out benchmarks/results.json]

Sections:
  harness    per-test overhead of a 2-rank distributed test: warm pool vs a fresh group per test
             vs torch.multiprocessing.spawn per test (how MultiProcessTestCase/mp.spawn work);
             hang-verdict latency beyond the deadline, and until every rank process is gone.
  fuzz       hypothesis throughput (examples/s) of a small-MLP property at world sizes 1 and 2.
  gate       the default gate's wall time on the installed opacus, split by property.
  reference  reference cost on the transformer: torch.func fast path vs the per-sample loop.
  hang_gate  a proven deadlock's latency from the divergence to the verdict (60 s deadline), and
             the default gate's wall time on fixtures.specimens:HookCollective (hangs everywhere).
Targets: warm overhead <= 50 ms and >= 50x below spawn; verdict <= deadline + 3 s; >= 20
examples/s; default gate <= 60 s on 2 cores; proven deadlock verdict <= 3 s after the divergence;
the gate on HookCollective <= 90 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_jobs  # noqa: E402  (module-level job functions the ranks import)


def _median_ms(run_one, n: int) -> float:
    """Median wall time of ``n`` calls of ``run_one`` (which must return True), in ms."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        assert run_one()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def bench_harness(n_warm: int = 50, n_fresh: int = 5) -> dict:
    from dpfsdp_verify.harness import Pool, pid_gone

    out = {}
    with Pool() as pool:
        pool.run(bench_jobs.tiny_test, world_size=2)  # start the group (not counted)
        out["warm_pool_ms_per_test"] = _median_ms(lambda: pool.run(bench_jobs.tiny_test, world_size=2).ok, n_warm)
    with Pool(reuse=False) as pool:
        out["fresh_group_ms_per_test"] = _median_ms(lambda: pool.run(bench_jobs.tiny_test, world_size=2).ok, n_fresh)
    out["mp_spawn_ms_per_test"] = _median_ms(lambda: bench_jobs.mp_spawn_tiny_test(2) or True, n_fresh)
    out["spawn_over_warm_ratio"] = out["mp_spawn_ms_per_test"] / out["warm_pool_ms_per_test"]

    deadline = 2.0
    lat, gone = [], []
    with Pool(spares=False) as pool:
        for _ in range(3):
            g = pool.group(2)
            pids = g.pids()
            t = time.perf_counter()
            # a hang no probe can prove, so the deadline is what ends it
            res = pool.run(bench_jobs.hang_outside_collectives, world_size=2, timeout=deadline)
            t_verdict = time.perf_counter() - t
            assert res.status == "hang" and "never by rank 1" in res.message, res.message
            while not all(pid_gone(p) for p in pids):
                time.sleep(0.01)
            lat.append(t_verdict - deadline)
            gone.append(time.perf_counter() - t - deadline)
    out["hang_verdict_s_after_deadline"] = max(lat)
    out["hang_all_gone_s_after_deadline"] = max(gone)
    return out


def bench_hang_gate(repeats: int = 3) -> dict:
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
                assert res.status == "hang" and res.message.startswith("deadlock proven"), res.message
                with open(stamp) as f:
                    lat.append(t_verdict - float(f.read()))
            out[f"proven_{kind}_divergence_to_verdict_s_median"] = statistics.median(lat)
            out[f"proven_{kind}_divergence_to_verdict_s_max"] = max(lat)
    cmd = [sys.executable, "-m", "dpfsdp_verify", "run", "--target", "fixtures.specimens:HookCollective",
           "--timeout", "60", "-q"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=os.path.dirname(HERE), capture_output=True, text=True)
    out["gate_hook_collective_wall_s"] = time.perf_counter() - t
    out["gate_hook_collective_exit_code"] = proc.returncode
    out["gate_hook_collective_hang_verdicts"] = proc.stdout.count("hang (deadlock)")
    return out


def bench_reference() -> dict:
    import torch

    from dpfsdp_verify import models, reference

    model = models.build_model("transformer", 0)
    batch = models.make_batch("transformer", 32, 1)
    out = {}
    for method in ("loop", "vmap"):
        reference.per_sample_grads(model, batch, "mean", method)  # warm-up
        t = time.perf_counter()
        for _ in range(3):
            reference.per_sample_grads(model, batch, "mean", method)
        out[f"transformer_b32_{method}_ms"] = 1000 * (time.perf_counter() - t) / 3
    out["loop_over_vmap_ratio"] = out["transformer_b32_loop_ms"] / out["transformer_b32_vmap_ms"]
    del torch
    return out


def bench_fuzz() -> dict:
    return bench_jobs.fuzz_throughput()


def bench_gate() -> dict:
    return bench_jobs.gate_wall_time()


SECTIONS = {"harness": bench_harness, "reference": bench_reference, "fuzz": bench_fuzz, "gate": bench_gate,
            "hang_gate": bench_hang_gate}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "dpfsdp-verify-bench.json"))
    args = ap.parse_args(argv)
    results = {}
    for name in [s.strip() for s in args.sections.split(",") if s.strip()]:
        if name not in SECTIONS:
            ap.error(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
        print(f"== {name}", file=sys.stderr, flush=True)
        try:
            results[name] = SECTIONS[name]()
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
    return 0


if __name__ == "__main__":
    sys.exit(main())

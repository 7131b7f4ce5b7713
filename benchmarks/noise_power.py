"""Measured power of noise_calibration: run one target's noise verdicts (not the fresh-process
case) ``--runs`` times, each with its own run seed, and count how often each fails, with a 95%
Clopper-Pearson interval; next to it, the exact power of the scale test on the deficient shard
of ``fixtures.noise_specimens:NoiseDeficit5pct`` / ``NoiseDeficitAtStatedPower`` (their ``FACTOR``).

    python benchmarks/noise_power.py --target fixtures.noise_specimens:NoiseDeficit5pct --runs 100
    python benchmarks/noise_power.py --target fixtures.noise_specimens:NoiseDeficitAtStatedPower --runs 100
    python benchmarks/noise_power.py --target fixtures.specimens:Correct --runs 40   # false alarms

Numbers measured on this repository are in docs/noise.md.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpfsdp_verify.harness import Pool  # noqa: E402
from dpfsdp_verify.properties import PROPERTIES  # noqa: E402
from dpfsdp_verify.properties.engine.runner import judge_cases  # noqa: E402
from dpfsdp_verify.properties.analysis.stats import chi2_cdf, chi2_quantile, chi2_sf  # noqa: E402


def clopper_pearson(k: int, n: int, level: float = 0.95):
    """Exact binomial interval (bisection on the binomial tail; no scipy)."""
    def tail_ge(p):  # P(X >= k)
        return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))

    def solve(f, target):
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if f(mid) < target:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2
    a = (1 - level) / 2
    low = 0.0 if k == 0 else solve(tail_ge, a)
    high = 1.0 if k == n else solve(lambda p: 1 - (1 - tail_ge(p) + math.comb(n, k) * p ** k * (1 - p) ** (n - k)),
                                    1 - a)
    return low, high


def exact_power(ratio: float, n: int, alpha: float) -> float:
    """P(the two-sided chi^2 scale test on ``n`` values rejects) when the std is ``ratio`` x expected."""
    q_lo, q_hi = chi2_quantile(alpha / 2, n), chi2_quantile(1 - alpha / 2, n)
    return chi2_cdf(q_lo / ratio ** 2, n) + chi2_sf(q_hi / ratio ** 2, n)


def _load(ref: str):
    import importlib

    module, _, attr = ref.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="fixtures.noise_specimens:NoiseDeficit5pct")
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--world-sizes", default="2")
    ap.add_argument("--samplings", default="fixed")
    ap.add_argument("--reductions", default="mean")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    prop = PROPERTIES["noise_calibration"]
    first = args.seed if args.seed is not None else random.randrange(1, 2 ** 31 - args.runs)
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    counts, stated, per_run = collections.Counter(), [], []
    t0 = time.perf_counter()
    with Pool(max_groups=2) as pool:
        for run in range(args.runs):
            # planned as the default gate plans them (world sizes 1, 2; every sampling and reduction),
            # so each verdict's per-test level and draws are the gate's; only the selected ones run
            opts = prop.options(args.target, world_sizes=(1, 2), seed=first + run, timeout=120)
            cases = [c for c in prop.plan(opts) if not c.fresh_groups and c.world_size in world_sizes
                     and c.spec.sampling in args.samplings.split(",")
                     and c.spec.reduction in args.reductions.split(",")]
            verdicts = judge_cases(prop, cases, pool, opts.timeout)
            failed = [v for v in verdicts if v.status != "pass"]
            counts["runs with a failure"] += bool(failed)
            for v in verdicts:
                counts[(v.status, v.diagnosis)] += 1
                if v.status == "pass":
                    stated.append(v.evidence.get("detects_std_error_big_shards"))
                per_run.append((v.seconds, v.evidence.get("draws"), v.evidence.get("alpha_per_test"),
                                v.config["world_size"]))
            if failed and args.target.endswith("Correct"):
                print(f"  run seed {first + run}: {failed[0].message}", file=sys.stderr)
            print(f"run {run + 1}/{args.runs}: {counts['runs with a failure']} with a failure "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    k, n = counts["runs with a failure"], args.runs
    lo, hi = clopper_pearson(k, n)
    print(f"target {args.target}, run seeds {first}..{first + n - 1}, world sizes {args.world_sizes}, "
          f"samplings {args.samplings}, reductions {args.reductions}")
    print(f"runs with a failing verdict: {k}/{n} = {k / n:.3f} (95% CI {lo:.3f}..{hi:.3f})")
    print("verdicts by (status, diagnosis):", dict((key, c) for key, c in counts.items() if isinstance(key, tuple)))
    if per_run:
        secs = sorted(s for s, _, _, _ in per_run)
        print(f"seconds per verdict: median {secs[len(secs) // 2]:.2f}, max {secs[-1]:.2f}")
        _, draws, alpha, ws = per_run[0]
        factor = getattr(_load(args.target), "FACTOR", None)
        if factor and draws and alpha:
            shard = 16 * 64 // ws  # fc2.weight's last shard
            print(f"exact power of the scale test on fc2.weight's last shard ({shard} coordinates x {draws} draws, "
                  f"alpha {alpha:.2g}) at std ratio {factor}: {exact_power(factor, shard * draws, alpha):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

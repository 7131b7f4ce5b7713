"""Calibration and power of ``sampling_accounting``'s across-steps tests, on synthetic inclusion
matrices (no ranks, no target): the statistics the property computes (``across_steps``) on

* the null: every sample in every step independently with probability q (Correct's sampler) --
  the rejection rate of each test, Bonferroni over its lags, against its nominal level;
* a sampler that reuses the mask of L steps back with probability p, else draws fresh, so that
  P(in step t+L | in step t) = q + delta -- the detection rate at the property's per-test level
  (alpha / tests: 1e-4 / 6 at one rank, 1e-4 / 7 at two), for the gate's shapes (N = 8, q = 1/8;
  N = 16, q = 1/8; N = 17, q = 1/9; T = 2000 steps).

    python benchmarks/sampling_lags.py [--null 20000] [--power 200]

The figures in docs/sampling.md come from this script (and from the property itself on the
specimens, ``tests/properties/test_sampling_lags.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpfsdp_verify.properties.sampling.check import ALPHA, across_steps  # noqa: E402

T = 2000
#: (label, N, q, tests in the case): the default gate's sampling_accounting shapes
SHAPES = (("ws=1", 8, 1 / 8, 6), ("ws=2 divisible", 16, 1 / 8, 7), ("ws=2 indivisible", 17, 1 / 9, 7))
NAMES = ("batch_size_lags", "membership_lags", "membership_portmanteau")


def reuse(n: int, q: float, p: float, lag: int, g: torch.Generator) -> torch.Tensor:
    x = (torch.rand(T, n, generator=g) < q).double()
    if p > 0:
        u = torch.rand(T, generator=g) < p
        for t in range(lag, T):
            if u[t]:
                x[t] = x[t - lag]
    return x


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--null", type=int, default=20000, help="null matrices per shape")
    ap.add_argument("--power", type=int, default=200, help="matrices per alternative")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    levels = (1e-1, 1e-2, 1e-3, 1e-4)
    for label, n, q, _ in SHAPES:
        ps = {k: [] for k in NAMES}
        for _ in range(args.null):
            x = reuse(n, q, 0.0, 1, g)
            s = across_steps(x, x.sum(1))
            for k in NAMES:
                ps[k].append(s[k])
        expected = ", ".join(f"{a * args.null:g}" for a in levels)
        print(f"null {label} (N={n}, q={q:.4g}), {args.null} matrices: rejections at level "
              + ", ".join(f"{a:g}" for a in levels) + f" (expected {expected})")
        for k in NAMES:
            p = torch.tensor(ps[k])
            print(f"  {k:<24} " + ", ".join(str(int((p < a).sum())) for a in levels))
    for label, n, q, m in SHAPES:
        level = ALPHA / m
        for delta in (0.04, 0.055, 0.07):
            p = delta / (1 - q)  # P(in t+L | in t) = p + (1 - p) q = q + delta
            row = []
            for lag in (1, 2, 100):
                hits = 0
                for _ in range(args.power):
                    x = reuse(n, q, p, lag, g)
                    s = across_steps(x, x.sum(1))
                    hits += any(s[k] < level for k in NAMES)
                row.append(f"lag {lag}: {hits / args.power:.3f}")
            print(f"power {label}: P(in t+L | in t) = q + {delta:g} (q = {q:.4g}) at level {level:.3g}: "
                  + "; ".join(row))
    print(f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""False alarms of the properties on the correct specimen: run every property N times on
``fixtures.specimens:Correct`` (both norm modes, world sizes 1 and 2) and count verdicts that are
not ``pass``. noise_calibration is the one statistical check: each run uses fresh noise seeds, so
its two-sided tests at alpha=1e-3 (3 tests per verdict) are exercised for real; the others are
deterministic and must never fail.

    python benchmarks/false_alarms.py [--runs 10]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpfsdp_verify.harness import Pool  # noqa: E402
from dpfsdp_verify.properties import PROPERTIES  # noqa: E402

TARGET = "fixtures.specimens:Correct"
MODES = {"immediate": {"OPACUS_USE_DEFERRED_NORM": "0"}, "deferred": {"OPACUS_USE_DEFERRED_NORM": "1"}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args(argv)
    counts = collections.Counter()
    alarms = []
    t0 = time.perf_counter()
    with Pool(max_groups=4) as pool:
        for run in range(args.runs):
            for pid, prop in PROPERTIES.items():
                kw = {"noise_seed": 100_000 * (run + 1)} if pid == "noise_calibration" else {}
                for v in prop(TARGET, pool=pool, world_sizes=(1, 2), modes=MODES, **kw):
                    counts[(pid, v.status)] += 1
                    if v.status not in ("pass", "skip"):
                        alarms.append(f"run {run}: {pid} {v.config} {v.status} {v.diagnosis}: {v.message}")
            print(f"run {run + 1}/{args.runs} done, {len(alarms)} false alarm(s) so far "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    for pid in PROPERTIES:
        row = {s: n for (p, s), n in counts.items() if p == pid}
        print(f"{pid:<18} {row}")
    print(f"false alarms: {len(alarms)} in {sum(counts.values())} verdicts over {args.runs} runs")
    for a in alarms:
        print("  " + a)
    return 1 if alarms else 0


if __name__ == "__main__":
    sys.exit(main())

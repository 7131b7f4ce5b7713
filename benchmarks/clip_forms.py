"""False alarms of ``clipped_step`` on the exact clip forms: ``C/max(||g||, C)``
(``fixtures.clip_form_specimens:ClipByMaxNormC``) and ``where(||g|| > C, C/||g||, 1)``
(``ClipExactWhere``) are DP-SGD's ``min(1, C/||g||)`` with no epsilon, an accepted clip form
(docs/clipping.md); read back through float64 rounding they fit an epsilon of ~1e-15 of either sign,
which the gate must count as 0 (``clipfit.epsilon_rounding``), never as a looser clip.

    python benchmarks/clip_forms.py [--seeds 200] [--seed S] [--targets ClipByMaxNormC,ClipExactWhere]

Each target runs ``clipped_step`` as the gate does (world sizes 1 and 2, the 48-step long run) once
in full at seed S; at seeds S+1 .. S+N-1 only the cases whose draws the seed changes (the Poisson
points and the long run: the fixed-batch cases are deterministic, judged once). Prints the pass
counts per target: a correct clip must pass every one. ``--long-only``: after the first seed only the
long run, the one case the false alarm was seen in (~1/8 of the time), for more seeds in a budget
(``--budget SECONDS``: no new seed after it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpfsdp_verify.harness import Pool  # noqa: E402
from dpfsdp_verify.properties import PROPERTIES  # noqa: E402
from dpfsdp_verify.properties.engine.contract import Case  # noqa: E402
from dpfsdp_verify.properties.engine.horizon import HORIZON_STEPS  # noqa: E402
from dpfsdp_verify.properties.engine.runner import judge_cases  # noqa: E402

PREFIX = "fixtures.clip_form_specimens:"


def verdicts(target: str, seed: int, pool, full: bool, long_only: bool):
    prop = PROPERTIES["clipped_step"]
    opts = prop.options(target, world_sizes=(1, 2), seed=seed, horizon=HORIZON_STEPS, timeout=120)
    cases = [c for c in prop.plan(opts) if isinstance(c, Case)
             and (full or ("horizon" in c.labels if long_only else c.spec.poisson))]
    return judge_cases(prop, cases, pool, opts.timeout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--seed", type=int, default=12345, help="first run seed (12345 failed before the fix)")
    ap.add_argument("--targets", default="ClipByMaxNormC,ClipExactWhere")
    ap.add_argument("--long-only", action="store_true",
                    help="after the first seed, only the 48-step long run (where the rounding-level fit failed)")
    ap.add_argument("--budget", type=float, default=0, help="stop starting seeds after this many seconds (0: none)")
    args = ap.parse_args(argv)
    targets = [t if ":" in t else PREFIX + t for t in args.targets.split(",")]
    counts = {t: [0, 0, 0] for t in targets}  # seeds all-pass, seeds run, verdicts
    bad = []
    t0 = time.perf_counter()
    with Pool(max_groups=2) as pool:
        for i in range(args.seeds):
            if args.budget and time.perf_counter() - t0 > args.budget:
                break
            seed = args.seed + i
            for t in targets:
                vs = verdicts(t, seed, pool, full=(i == 0), long_only=args.long_only)
                wrong = [v for v in vs if v.status not in ("pass", "skip")]
                counts[t][0] += not wrong
                counts[t][1] += 1
                counts[t][2] += len(vs)
                bad += [f"seed {seed} {t} {v.config} {v.status} {v.diagnosis}: {v.message}" for v in wrong]
            print(f"seed {seed} done ({time.perf_counter() - t0:.0f} s), {len(bad)} failure(s)", file=sys.stderr,
                  flush=True)
    for t, (ok, n, nv) in counts.items():
        print(f"{t}: passed clipped_step at {ok} of {n} seeds ({args.seed}..{args.seed + n - 1}; {nv} verdicts)")
    print(f"{time.perf_counter() - t0:.0f} s")
    for b in bad:
        print("  " + b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""The privacy audit's false alarms, power and cost (``privacy_audit``, docs/audit.md).

    python benchmarks/audit.py --false-alarms N [--world-sizes 1] [--meshes hsdp:2x2] [--seed S]
                               [--canaries M --steps T]
    python benchmarks/audit.py --power R [--clip-factors 1.5,2,3] [--noise-factors 0.7,0.5,0.35] [--world-sizes 1]
    python benchmarks/audit.py --simulate N [--canaries M --steps T]

``--false-alarms N``: the audit on ``fixtures.specimens:Correct`` with N run seeds (S, S+1, ...),
each a fresh draw of secrets, Poisson masks and noise, through the target contract on warm ranks;
prints the number of ``audit_violation`` verdicts (the theorem bounds each at 1 - confidence = 5%;
the audit is far from tight, so the expected count is ~0), the eps_lb distribution against the
claimed epsilon, and the seconds per audit (its verdict's ``seconds``).

``--power R``: R runs (distinct seeds) per factor of ``fixtures.audit_specimens:ClipBoundScaled``
(clip at f C while the accountant is told C) and ``NoiseScaled`` (noise at f sigma), the factor
passed to the ranks in their environment; prints the fraction flagged per factor and the smallest
clip factor / largest noise factor flagged in >= 95% of runs.

``--simulate N`` (no ranks, seconds): the same audit -- the property's own scores, guesses and
bound -- on N releases drawn from the mechanism's definition (``y = f Bernoulli(q) + N(0, (g
sigma)^2)`` per canary and step), for the false-alarm and power figures at counts the real runs
cannot reach in a benchmark's time; the real runs above check that the target path matches it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dpfsdp_verify import models  # noqa: E402
from dpfsdp_verify.harness import Pool  # noqa: E402
import dpfsdp_verify.properties as props  # noqa: E402
from dpfsdp_verify.properties.audit import bound as audit_bound  # noqa: E402
from dpfsdp_verify.properties.audit import check as pa  # noqa: E402
from dpfsdp_verify.targets import accounting  # noqa: E402
from fixtures.audit_specimens import CLIP_FACTOR_ENV, NOISE_FACTOR_ENV  # noqa: E402


def audits(pool, target, seeds, world_sizes, size, modes=None, meshes=()):
    """``[(seed, verdict)]`` of the audit on ``target`` for each run seed (at ``world_sizes`` and on
    the 2-D ``meshes``)."""
    out = []
    for seed in seeds:
        kw = dict(world_sizes=world_sizes, seed=seed, pool=pool, meshes=meshes, **size)
        if modes:
            kw["modes"] = modes
        for v in props.run("privacy_audit", target, **kw):
            out.append((seed, v))
    return out


def summary(rows, label):
    eps = [v.evidence.get("eps_lb", float("nan")) for _, v in rows]
    tight = [v.evidence.get("tightness", float("nan")) for _, v in rows]
    fdp = [v.evidence.get("eps_lb_fdp", float("nan")) for _, v in rows]
    counting = [v.evidence.get("eps_lb_counting", float("nan")) for _, v in rows]
    claimed = rows[0][1].evidence.get("claimed_epsilon", float("nan")) if rows else float("nan")
    secs = [v.seconds for _, v in rows]
    flagged = sum(v.diagnosis == "audit_violation" for _, v in rows)
    other = [(s, v.status, v.diagnosis) for s, v in rows if v.status != "pass" and v.diagnosis != "audit_violation"]
    print(f"{label}: {flagged} of {len(rows)} audits flagged (audit_violation); eps_lb median "
          f"{statistics.median(eps):.3f}, max {max(eps):.3f} (f-DP median {statistics.median(fdp):.3f}, counting "
          f"{statistics.median(counting):.3f}); eps_lb / claimed median {statistics.median(tight):.2f}; "
          f"claimed epsilon {claimed:.4g}; "
          f"{statistics.median(secs):.1f} s per audit (median; max {max(secs):.1f})"
          + (f"; other non-pass verdicts: {other}" if other else ""), flush=True)
    return flagged


def simulate(n, size, seed0, clip_factor=1.0, noise_factor=1.0):
    """``(flagged, eps_lbs)`` of ``n`` audits of releases drawn from the mechanism (module doc)."""
    m, t = size["audit_canaries"], size["audit_steps"]
    q, sigma = pa.SAMPLE_RATE, pa.SIGMA
    claimed = accounting.epsilon([(sigma, q, t)], pa.DELTA)
    flagged, eps = 0, []
    for i in range(n):
        g = torch.Generator().manual_seed(seed0 + i)
        secrets = models.canary_secrets(m, seed0 + i)
        drawn = (torch.rand(t, m, generator=g, dtype=torch.float64) < q) & (secrets > 0)
        y = clip_factor * drawn + noise_factor * sigma * torch.randn(t, m, generator=g, dtype=torch.float64)
        found = pa.bounds(y, q, sigma, secrets.tolist(), audit_bound.CONFIDENCE)
        eps.append(found["eps_lb"])
        flagged += found["eps_lb"] > claimed
    return flagged, eps, claimed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--false-alarms", type=int, default=0, metavar="N")
    ap.add_argument("--power", type=int, default=0, metavar="R")
    ap.add_argument("--simulate", type=int, default=0, metavar="N")
    ap.add_argument("--clip-factors", default="1.5,2,3")
    ap.add_argument("--noise-factors", default="0.7,0.5,0.35")
    ap.add_argument("--upstream", type=int, default=0, metavar="N", help="the false-alarm runs on upstream opacus too")
    ap.add_argument("--world-sizes", default="1", help="comma-separated; '' for none (meshes only)")
    ap.add_argument("--meshes", default="", help="2-D meshes too, e.g. hsdp:2x2")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--canaries", type=int, default=pa.CANARIES)
    ap.add_argument("--steps", type=int, default=pa.STEPS)
    args = ap.parse_args(argv)
    size = dict(audit_canaries=args.canaries, audit_steps=args.steps)
    ws = tuple(int(w) for w in args.world_sizes.split(",") if w)
    meshes = tuple(m for m in args.meshes.split(",") if m)
    print(f"privacy_audit: {args.canaries} canaries, {args.steps} steps, q={pa.SAMPLE_RATE:g}, sigma={pa.SIGMA:g}, "
          f"delta={pa.DELTA:g}; world sizes {ws}" + (f", meshes {meshes}" if meshes else ""), flush=True)
    if args.simulate:
        t0 = time.monotonic()
        flagged, eps, claimed = simulate(args.simulate, size, args.seed)
        print(f"simulated Correct: {flagged} of {args.simulate} flagged; eps_lb median {statistics.median(eps):.3f} "
              f"({statistics.median(eps) / claimed:.2f}x), max {max(eps):.3f}; claimed (RDP) {claimed:.4g} "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
        for f in (float(x) for x in args.clip_factors.split(",")):
            flagged, eps, _ = simulate(args.simulate, size, args.seed, clip_factor=f)
            print(f"simulated clip x{f:g}: {flagged} of {args.simulate} flagged ({flagged / args.simulate:.0%}); "
                  f"eps_lb median {statistics.median(eps):.3f}", flush=True)
        for f in (float(x) for x in args.noise_factors.split(",")):
            flagged, eps, _ = simulate(args.simulate, size, args.seed, noise_factor=f)
            print(f"simulated noise x{f:g}: {flagged} of {args.simulate} flagged ({flagged / args.simulate:.0%}); "
                  f"eps_lb median {statistics.median(eps):.3f}", flush=True)
    if not (args.false_alarms or args.power or args.upstream):
        return 0
    pool = Pool(max_groups=2)
    try:
        if args.false_alarms:
            rows = []
            for start in range(args.seed, args.seed + args.false_alarms, 20):  # a line every 20 seeds
                rows += audits(pool, "fixtures.specimens:Correct",
                               range(start, min(start + 20, args.seed + args.false_alarms)), ws, size,
                               meshes=meshes)
                summary(rows, f"Correct (false alarms), seeds {args.seed}..{start + 19}")
        if args.upstream:
            rows = []
            for start in range(args.seed, args.seed + args.upstream, 20):
                rows += audits(pool, "opacus", range(start, min(start + 20, args.seed + args.upstream)), ws, size,
                               meshes=meshes)
                summary(rows, f"upstream opacus (false alarms), seeds {args.seed}..{start + 19}")
        if args.power:
            seeds = range(args.seed + 100_000, args.seed + 100_000 + args.power)
            for env, name, factors in ((CLIP_FACTOR_ENV, "ClipBoundScaled", args.clip_factors),
                                       (NOISE_FACTOR_ENV, "NoiseScaled", args.noise_factors)):
                for f in factors.split(","):
                    rows = audits(pool, f"fixtures.audit_specimens:{name}", seeds, ws, size, modes={f"x{f}": {env: f}},
                                  meshes=meshes)
                    summary(rows, f"{name} x{f}")
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

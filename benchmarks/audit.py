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
import math
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
from dpfsdp_verify.properties.audit import fdp as audit_fdp  # noqa: E402
from dpfsdp_verify.properties.audit import tail as audit_tail  # noqa: E402
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


def simulate(n, size, seed0, clip_factor=1.0, noise_factor=1.0, confidence=pa.AUDIT_CONFIDENCE):
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
        found = pa.bounds(y, q, sigma, secrets.tolist(), confidence)
        eps.append(found["eps_lb"])
        flagged += found["eps_lb"] > claimed
    return flagged, eps, claimed


def thresholds(m, claimed, confidence):
    """``[(group, first, end, score, k, v_star)]``: for every guess choice ``pa.bounds`` makes (the f-DP
    choices, ``pa.fdp_choices``, and the counting bound's), the fewest right guesses ``v_star`` with
    which that choice alone proves an epsilon above ``claimed`` (a choice's bound rises with its right
    guesses). A release fails the audit exactly when some choice reaches its ``v_star``."""
    out = []
    mu_claim = _mu_of(claimed)
    for c in pa.fdp_choices(m, 1.0 - confidence):
        r, n = c.k_plus + c.k_minus, c.end - c.first
        v_star = _first(_proves(c.analysis, r, n, mu_claim, c.level), r)
        out.append((c.group, c.first, c.end, c.score, c.k_plus, v_star))
    counting = pa.guess_choices(m, pa.GUESS_FRACTIONS, pa.COUNTING_GUESSES)
    scores = ("llr", "llr_fitted")  # the two score vectors pa.bounds gives the counting bound
    at = (1.0 - pa.counting_confidence(m, confidence)) / (len(scores) * len(counting))  # audit_bound.audit's split
    for score in scores:
        for k_plus, k_minus in counting:
            r = k_plus + k_minus
            out.append(("all", 0, m, score, k_plus,
                        _first(lambda v: audit_bound.p_value(claimed, r, v, m, pa.DELTA) < at, r)))  # noqa: B023
    return out


def _proves(analysis, r, n, mu, level):
    """``v -> whether v right of r guesses about n canaries reject mu-GDP`` by the choice's analysis."""
    if analysis == "tail":
        return lambda v: audit_tail.rejects(r, v, n, mu, level)
    return lambda v: audit_fdp.rejects(audit_fdp.gdp_inverse_blow_up(mu), r, v, n, level)


def _first(proves, r):
    """The smallest v in 0..r with ``proves(v)`` (monotone), r + 1 when none."""
    lo, hi = 0, r + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if mid <= r and proves(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _mu_of(eps):
    lo, hi = 0.0, 20.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if audit_fdp.gdp_epsilon(mid, pa.DELTA) < eps:
            lo = mid
        else:
            hi = mid
    return hi


def false_alarm_sim(n, size, seed0, claimed, confidence, batch=25):
    """``(failed, runs, closest)``: ``n`` releases drawn from the correct mechanism, each judged by the
    audit's decision rule through ``thresholds`` (no bisection per release: thousands per minute);
    ``closest`` is the largest ``v / v_star`` seen (1 would be a false alarm)."""
    m, t = size["audit_canaries"], size["audit_steps"]
    q, sigma = pa.SAMPLE_RATE, pa.SIGMA
    table = thresholds(m, claimed, confidence)
    failed, runs, closest = 0, 0, 0.0
    g = torch.Generator().manual_seed(seed0)
    while runs < n:
        b = min(batch, n - runs)
        secrets = torch.where(torch.rand(b, m, generator=g) < 0.5, 1, -1)
        drawn = (torch.rand(b, t, m, generator=g, dtype=torch.float64) < q) & (secrets.unsqueeze(1) > 0)
        y = drawn + sigma * torch.randn(b, t, m, generator=g, dtype=torch.float64)
        llr = torch.logaddexp(torch.full_like(y, math.log1p(-q)), math.log(q) + (y - 0.5) / sigma ** 2).sum(1)
        fitted_s = y.std(1, unbiased=False).clamp(min=pa.SIGMA_FLOOR).unsqueeze(1)
        fitted = torch.logaddexp(torch.full_like(y, math.log1p(-q)), math.log(q) + (y - 0.5) / fitted_s ** 2).sum(1)
        scores = {"llr": llr, "llr_fitted": fitted}
        worst = torch.zeros(b, dtype=torch.float64)
        for _group, lo, hi, score, k, v_star in table:
            sc, se = scores[score][:, lo:hi], secrets[:, lo:hi]
            order = torch.argsort(sc, dim=1, stable=True)
            v = (se.gather(1, order[:, -k:]) == 1).sum(1) + (se.gather(1, order[:, :k]) == -1).sum(1)
            worst = torch.maximum(worst, v.to(torch.float64) / v_star)
        failed += int((worst >= 1.0).sum())
        closest = max(closest, float(worst.max()))
        runs += b
    return failed, runs, closest


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--false-alarms", type=int, default=0, metavar="N")
    ap.add_argument("--power", type=int, default=0, metavar="R")
    ap.add_argument("--simulate", type=int, default=0, metavar="N")
    ap.add_argument("--false-alarm-sim", type=int, default=0, metavar="N",
                    help="N correct releases judged by the audit's decision rule (no ranks)")
    ap.add_argument("--clip-factors", default="1.5,2,3")
    ap.add_argument("--noise-factors", default="0.7,0.5,0.35")
    ap.add_argument("--upstream", type=int, default=0, metavar="N", help="the false-alarm runs on upstream opacus too")
    ap.add_argument("--world-sizes", default="1", help="comma-separated; '' for none (meshes only)")
    ap.add_argument("--meshes", default="", help="2-D meshes too, e.g. hsdp:2x2")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--confidence", type=float, default=pa.AUDIT_CONFIDENCE,
                    help="the simulated audits' confidence (the property's default)")
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
        flagged, eps, claimed = simulate(args.simulate, size, args.seed, confidence=args.confidence)
        print(f"simulated Correct: {flagged} of {args.simulate} flagged; eps_lb median {statistics.median(eps):.3f} "
              f"({statistics.median(eps) / claimed:.2f}x), max {max(eps):.3f}; claimed (RDP) {claimed:.4g} "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
        for f in (float(x) for x in args.clip_factors.split(",")):
            flagged, eps, _ = simulate(args.simulate, size, args.seed, clip_factor=f, confidence=args.confidence)
            print(f"simulated clip x{f:g}: {flagged} of {args.simulate} flagged ({flagged / args.simulate:.0%}); "
                  f"eps_lb median {statistics.median(eps):.3f}", flush=True)
        for f in (float(x) for x in args.noise_factors.split(",")):
            flagged, eps, _ = simulate(args.simulate, size, args.seed, noise_factor=f, confidence=args.confidence)
            print(f"simulated noise x{f:g}: {flagged} of {args.simulate} flagged ({flagged / args.simulate:.0%}); "
                  f"eps_lb median {statistics.median(eps):.3f}", flush=True)
    if args.false_alarm_sim:
        from opacus.accountants import PRVAccountant
        prv = PRVAccountant()
        for _ in range(args.steps):
            prv.step(noise_multiplier=pa.SIGMA, sample_rate=pa.SAMPLE_RATE)
        for name, claimed in (("PRV", prv.get_epsilon(pa.DELTA)),
                              ("RDP", accounting.epsilon([(pa.SIGMA, pa.SAMPLE_RATE, args.steps)], pa.DELTA))):
            t0 = time.monotonic()
            failed, runs, closest = false_alarm_sim(args.false_alarm_sim, size, args.seed, claimed, args.confidence)
            upper = 1 - 0.05 ** (1 / runs) if failed == 0 else float("nan")
            print(f"false alarms, simulated correct releases against the {name} claim {claimed:.4g} (confidence "
                  f"{args.confidence:g}): {failed} of {runs} (0 of N: rate <= {upper:.2g} at 95%); the closest release "
                  f"reached {closest:.3f} of a failing count ({time.monotonic() - t0:.0f} s)", flush=True)
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

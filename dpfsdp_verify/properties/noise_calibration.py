"""noise_calibration: the added noise has std sigma*C/D on every coordinate, is independent across
shards, and is identical on replicas that must agree.

DP meaning: the Gaussian mechanism's guarantee is for noise of exactly std sigma*C on the summed
clipped gradient (sigma*C/D after dividing by D). Less noise (e.g. drawn on every rank and
averaged, or divided by N twice) is a privacy violation: the released gradient reveals more than
accounted for. More noise (not divided by N) is a utility bug: accuracy is lost for nothing.
Noise that repeats across shards (ranks seeded alike) is not the independent noise the analysis
assumes either.

Measured on the target itself: one run with noise 0 and ``REPEATS`` runs with noise on and
different noise seeds, same data and parameters; noise = gradient(sigma) - gradient(0) for every
coordinate (signal bugs cancel, ``clipped_step`` judges those). Tests, each two-sided at
``ALPHA``; the false-alarm probability of a correct target is at most ``3 * ALPHA`` per verdict
(over the choice of seeds; with the fixed default seeds the verdict is deterministic):

* scale: ``sum(noise^2) / s^2`` ~ chi^2(n) for ``s = sigma*C/D``;
* mean: ``sum(noise) / (s sqrt(n))`` ~ N(0, 1);
* independence across shards: the Pearson correlation of the noise on shard r vs shard r' of each
  parameter (FSDP's dim-0 chunks), Fisher z ~ N(0, 1) (world_size > 1 only);

and, exactly: every rank reports the same full gradient (replicas agree).
"""

from __future__ import annotations

import math

import torch

from ..targets import RunSpec
from ..verdict import Verdict
from .contract import Case, Outputs, Point, Property

ALPHA = 1e-3
REPEATS = 6
SIGMA = 1.0
CLIP = 1.0


def cases(point: Point):
    spec = point.spec(global_batch_size=4 * point.world_size, max_grad_norm=CLIP, noise_multiplier=SIGMA,
                      noise_seed=point.param("noise_seed"))
    draws = [spec.with_(noise_seed=spec.noise_seed + 7919 * i) for i in range(point.param("repeats"))]
    yield point.case(spec, [spec.with_(noise_multiplier=0.0)] + draws, doing="DP steps with noise")


def _noise(run, base, names):
    return {n: (run[0].steps[0].gradient[n] - base[0].steps[0].gradient[n]).to(torch.float64) for n in names}


def judge(case: Case, outputs: Outputs) -> Verdict:
    spec, ws, runs = case.spec, case.world_size, outputs[0]
    d = float(spec.global_batch_size) if spec.reduction == "mean" else 1.0
    s = spec.noise_multiplier * spec.max_grad_norm / d
    names = sorted(runs[0][0].steps[0].gradient)
    # replicas must agree: every rank's full gradient is the same tensor
    for i, run in enumerate(runs):
        for r in range(1, ws):
            for n in names:
                a, b = run[0].steps[0].gradient[n], run[r].steps[0].gradient[n]
                if not torch.equal(a, b):
                    return case.verdict("fail", "mismatch", (
                        f"ranks 0 and {r} report different full gradients for {n!r} (max difference "
                        f"{float((a - b).abs().max()):.3g}, run {i}): replicas that must agree do not; a "
                        "parameter replicated on several ranks would be updated with different noise."),
                        {"run": i, "parameter": n})
    draws = [_noise(run, runs[0], names) for run in runs[1:]]
    x = torch.cat([dr[n].reshape(-1) for dr in draws for n in names])
    n = x.numel()
    t = float((x / s).pow(2).sum())
    p_scale = 2 * min(_chi2_cdf(t, n), _chi2_sf(t, n))
    ratio = math.sqrt(t / n)  # measured std / expected std
    z_mean = float(x.sum()) / (s * math.sqrt(n))
    p_mean = 2 * _norm_sf(abs(z_mean))
    evidence = {"expected_std": s, "measured_std": ratio * s, "std_ratio": ratio, "coordinates": n,
                "p_scale": p_scale, "z_mean": z_mean, "p_mean": p_mean, "alpha": ALPHA}
    where = (f"at world_size={ws}, reduction={spec.reduction} (sigma={spec.noise_multiplier}, "
             f"C={spec.max_grad_norm}, D={d:g}; {n} coordinates, {len(draws)} draws)")
    if p_scale < ALPHA:
        hint = ""
        for k, what in ((1 / math.sqrt(ws), "1/sqrt(N): noise drawn on every rank and averaged"),
                        (1 / ws, "1/N: noise divided by N once too often"),
                        (float(ws), "N: noise not divided by N although the ranks' gradients are averaged")):
            if ws > 1 and abs(ratio - k) < 0.15 * k:
                hint = f" The ratio is close to {what}."
        if ratio < 1:
            return case.verdict("fail", "mismatch", (
                f"PRIVACY VIOLATION: too little noise {where}: measured std {ratio * s:.4g} = {ratio:.3f} x the "
                f"required sigma*C/D = {s:.4g} (two-sided chi-square p={p_scale:.2g} < {ALPHA}).{hint} The "
                "released gradient is less private than the accounting states."), evidence)
        return case.verdict("fail", "mismatch", (
            f"UTILITY LOSS: too much noise {where}: measured std {ratio * s:.4g} = {ratio:.3f} x sigma*C/D = "
            f"{s:.4g} (two-sided chi-square p={p_scale:.2g} < {ALPHA}).{hint} Privacy holds, but the model "
            "trains on more noise than the guarantee needs."), evidence)
    if p_mean < ALPHA:
        return case.verdict("fail", "mismatch", (
            f"the noise is biased {where}: mean z={z_mean:.3g} (p={p_mean:.2g} < {ALPHA}); Gaussian DP noise "
            "has mean 0."), evidence)
    if ws > 1:
        r_corr, m, p_ind = shard_correlation(draws, names, ws)
        evidence.update({"shard_correlation": r_corr, "shard_pairs": m, "p_independence": p_ind})
        if p_ind < ALPHA:
            return case.verdict("fail", "mismatch", (
                f"PRIVACY VIOLATION: the noise is not independent across shards {where}: correlation "
                f"{r_corr:.3f} between the noise on different ranks' shards over {m} coordinate pairs "
                f"(Fisher z test p={p_ind:.2g} < {ALPHA}). Ranks seeded alike add the same noise to every "
                "shard; the mechanism assumes independent noise per coordinate."), evidence)
    return case.verdict("pass", None, (
        f"noise std {ratio * s:.4g} = {ratio:.3f} x sigma*C/D {where}; two-sided tests at alpha={ALPHA} "
        f"(scale p={p_scale:.2g}, mean p={p_mean:.2g}" + (f", shard independence p={evidence['p_independence']:.2g}"
                                                         if ws > 1 else "") + ")"), evidence)


def _chi2_cdf(t: float, k: int) -> float:
    # chi^2_k CDF is the regularised lower incomplete gamma P(k/2, t/2) (no scipy needed)
    return float(torch.special.gammainc(torch.tensor(k / 2, dtype=torch.float64), torch.tensor(t / 2, dtype=torch.float64)))


def _chi2_sf(t: float, k: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(k / 2, dtype=torch.float64), torch.tensor(t / 2, dtype=torch.float64)))


def _norm_sf(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2))


def shard_correlation(draws, names, ws):
    """``(r, pairs, p)``: Pearson correlation of noise on shard a vs shard b (FSDP dim-0 chunks),
    over every parameter, draw and pair of shards (truncated to the shorter chunk)."""
    xs, ys = [], []
    for dr in draws:
        for n in names:
            t = dr[n]
            if t.dim() == 0:
                continue
            chunks = [c.reshape(-1) for c in torch.chunk(t, ws, dim=0)]
            for a in range(len(chunks)):
                for b in range(a + 1, len(chunks)):
                    k = min(chunks[a].numel(), chunks[b].numel())
                    xs.append(chunks[a][:k])
                    ys.append(chunks[b][:k])
    if not xs:
        return 0.0, 0, 1.0
    x, y = torch.cat(xs), torch.cat(ys)
    m = x.numel()
    if m < 4:
        return 0.0, m, 1.0
    r = float(torch.corrcoef(torch.stack([x, y]))[0, 1])
    r = max(min(r, 1 - 1e-15), -1 + 1e-15)
    z = math.atanh(r) * math.sqrt(m - 3)
    return r, m, 2 * _norm_sf(abs(z))


PROPERTY = Property(
    id="noise_calibration",
    meaning=("the Gaussian noise has std sigma*C/D per coordinate (less: privacy violation; more: utility "
             "loss), independent across shards and identical on replicas"),
    cases=cases, judge=judge, models=("mlp",), layouts=("split",), reductions=("mean", "sum"),
    params=(("noise_seed", RunSpec.noise_seed), ("repeats", REPEATS)))

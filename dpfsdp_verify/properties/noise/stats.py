"""The statistics of ``noise_calibration`` (no wording: ``noise_messages.py`` words them), on the
noise of every draw stacked per tensor (``[draws, *shape]``), cut into FSDP's dim-0 shards
(``shards``, ``shard_sizes``):

* per coordinate: ``scale_stats`` (each shard's ``sum(noise^2) / s^2 ~ chi^2``, each tensor's mean,
  each shard's sum, the 1-D tensors pooled), ``shape_stats`` (the excess kurtosis of every
  coordinate's noise, each shard standardised by its own RMS);
* per release: ``step_scales`` (each draw's scale over all its coordinates) and
  ``late_scale_change`` (a scale that changes part-way through a run);
* dependence *between* the tensors of one release and *within* a noise matrix, which the
  per-coordinate tests and the exact repeat check cannot see:

  * ``independence``: correlation across FSDP shards, consecutive steps and consecutive runs.
  * ``tensor_pair_dependence``: for every pair of parameter tensors of equal shape, the correlation
    of their flattened noise in each draw. Independent noise gives ``m r_d^2 ~ chi^2_1`` per draw
    (``m`` coordinates, uncentred correlation ``r_d``), so ``t = m sum_d r_d^2 ~ chi^2(draws)``; its
    upper tail and that of the largest ``m r_d^2`` (Bonferroni over the draws) are combined (x2) and
    the pair p-values Bonferroni-corrected over the pairs. A negated copy (``r = -1``), a linear
    mix ``a noise(A) + b fresh`` (``r = a / sqrt(a^2 + b^2)``), in every draw or in one, all show.
  * ``low_rank``: the top singular value of each draw of each noise matrix over its RMS. An
    ``r x c`` matrix of i.i.d. N(0, s^2) has ``sigma_1 <= s (sqrt(r) + sqrt(c) + t)`` except with
    probability ``exp(-t^2/2)`` (Gordon's bound with Gaussian concentration: sigma_1 is 1-Lipschitz),
    and its RMS^2 ``>= s^2 (1 - 2 sqrt(x / rc))`` except with probability ``exp(-x)`` (Laurent and
    Massart's chi^2 lower tail). The bound at ``alpha`` splits it between the two; noise of rank k
    has ``sigma_1 / RMS ~ sqrt(rc / k)``, far above it (a rank-1 64 x 32 matrix: 45 against ~20).
    Self-normalised by the RMS, so a scale error is the scale test's, never this one's.

All are exact bounds or chi^2 / normal tails (no fitted constants); their false-alarm rate is the
``alpha`` the caller passes (``noise_calibration`` shares its family alpha over its tests). The
distributions themselves are ``stats.py``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, cast

from ...lazy import torch

from ..analysis.stats import (chi2_cdf, chi2_sf, chi2_two_sided_p, correlation_p, detectable_excess_kurtosis,
                    detectable_std_ratios, kurtosis_z, normal_two_sided_p)


@dataclass(frozen=True)
class PairDependence:
    """The most dependent pair of equal-shape tensors (``tensor_pair_dependence``)."""

    a: str
    b: str
    p: float            # Bonferroni-corrected over every pair tested
    mean_r: float       # mean correlation of the pair's noise over the draws
    worst_draw: int     # the draw with the largest |r|
    worst_r: float
    pairs: int          # pairs of equal-shape tensors tested
    draws: int


def tensor_pair_dependence(stacked: Dict[str, torch.Tensor], names: Sequence[str]) -> Optional[PairDependence]:
    """The pair of equal-shape tensors (``stacked[name]``: ``[draws, *shape]``) whose noise is most
    dependent (module docstring); ``None`` if no two tensors share a shape."""
    groups: Dict[tuple, List[str]] = {}
    for n in names:
        if stacked[n][0].numel() >= 2:
            groups.setdefault(tuple(stacked[n].shape), []).append(n)
    pairs = [(a, b) for group in groups.values() for i, a in enumerate(group) for b in group[i + 1:]]
    if not pairs:
        return None
    best = None
    for a, b in pairs:
        x = stacked[a].reshape(stacked[a].shape[0], -1).to(torch.float64)
        y = stacked[b].reshape(stacked[b].shape[0], -1).to(torch.float64)
        k, m = x.shape
        r = (x * y).sum(dim=1) / (x.norm(dim=1) * y.norm(dim=1)).clamp_min(1e-300)
        t = float(m * r.pow(2).sum())
        worst = int(r.abs().argmax())
        top = float(m * r[worst] ** 2)
        p = min(1.0, 2 * min(chi2_sf(t, k), k * chi2_sf(top, 1))) if math.isfinite(t) else 0.0
        if best is None or p < best[0]:
            best = (p, a, b, float(r.mean()), worst, float(r[worst]), k)
    p, a, b, mean_r, worst, worst_r, k = cast(Tuple[float, str, str, float, int, float, int], best)  # pairs: not empty
    return PairDependence(a, b, min(1.0, p * len(pairs)), mean_r, worst, worst_r, len(pairs), k)


def low_rank_bound(rows: int, cols: int, alpha: float) -> float:
    """The largest ``sigma_1 / RMS`` an ``rows x cols`` matrix of i.i.d. Gaussian noise exceeds with
    probability at most ``alpha`` (module docstring; ``inf`` where the RMS bound is void)."""
    t = math.sqrt(2 * math.log(2 / alpha))
    x = math.log(2 / alpha)
    shrink = 1 - 2 * math.sqrt(x / (rows * cols))
    if shrink <= 0:
        return math.inf
    return (math.sqrt(rows) + math.sqrt(cols) + t) / math.sqrt(shrink)


@dataclass(frozen=True)
class LowRank:
    """The noise matrix draw furthest above its bound (``low_rank``)."""

    name: str
    draw: int
    ratio: float        # sigma_1 / RMS of that draw
    bound: float        # low_rank_bound at alpha / (draws x matrices)
    full_rank: float    # what i.i.d. noise gives: sqrt(rows) + sqrt(cols)
    share: float        # sigma_1^2 / ||noise||_F^2: the fraction of the noise's energy in one direction


def low_rank(stacked: Dict[str, torch.Tensor], names: Sequence[str], alpha: float) -> Optional[LowRank]:
    """The draw of a 2-D noise tensor (both dims >= 2) whose ``sigma_1 / RMS`` most exceeds the bound
    at ``alpha`` shared over every draw of every such tensor; ``None`` if none exceeds it (or none
    is a matrix)."""
    mats = [n for n in names if stacked[n].dim() == 3 and min(stacked[n].shape[1:]) >= 2]
    if not mats:
        return None
    tests = sum(stacked[n].shape[0] for n in mats)
    worst = None
    for n in mats:
        w = stacked[n].to(torch.float64)
        rows, cols = w.shape[1:]
        bound = low_rank_bound(rows, cols, alpha / tests)
        top = torch.linalg.matrix_norm(w, ord=2)
        fro = torch.linalg.matrix_norm(w).clamp_min(1e-300)
        ratio = top / (fro / math.sqrt(rows * cols))
        d = int(ratio.argmax())
        excess = float(ratio[d]) / bound
        if excess > 1 and (worst is None or excess > worst[0]):
            worst = (excess, LowRank(n, d, float(ratio[d]), bound, math.sqrt(rows) + math.sqrt(cols),
                                     float((top[d] / fro[d]) ** 2)))
    return None if worst is None else worst[1]


def independence(noise, names, ws):
    """``{test: (r, p, pairs)}``: Pearson correlation with its Fisher z p-value (``stats.correlation_p``)
    of the noise of FSDP shard pairs (ws > 1), consecutive steps and consecutive runs (``noise[run][step][name]``)."""
    def pairs_of(get_a, get_b):
        xs, ys = [], []
        for a, b in zip(get_a, get_b):
            k = min(a.numel(), b.numel())
            xs.append(a.reshape(-1)[:k])
            ys.append(b.reshape(-1)[:k])
        x, y = torch.cat(xs), torch.cat(ys)
        r, p = correlation_p(x, y)
        return r, p, x.numel()

    out = {}
    draws = [step for run in noise for step in run]
    if ws > 1:
        a, b = [], []
        for step in draws:
            for n in names:
                if step[n].dim() == 0:
                    continue
                chunks = torch.chunk(step[n], ws, dim=0)
                for i in range(len(chunks)):
                    for j in range(i + 1, len(chunks)):
                        a.append(chunks[i])
                        b.append(chunks[j])
        if a:
            out["shard"] = pairs_of(a, b)
    out["step"] = pairs_of([run[k][n] for run in noise for k in range(1, len(run)) for n in names],
                           [run[k - 1][n] for run in noise for k in range(1, len(run)) for n in names])
    out["run"] = pairs_of([noise[i][k][n] for i in range(1, len(noise)) for k in range(len(noise[i])) for n in names],
                          [noise[i - 1][k][n] for i in range(1, len(noise)) for k in range(len(noise[i]))
                           for n in names])
    return out


def shards(x: torch.Tensor, ws: int):
    """FSDP's dim-0 chunks of every draw of a tensor (``x``: ``[draws, *shape]``)."""
    return torch.chunk(x, ws, dim=1) if x.dim() > 1 else [x]


def shard_sizes(shape: Sequence[int], ws: int) -> List[int]:
    """The coordinates of each of FSDP's ``ws`` dim-0 shards of a tensor of ``shape``:
    ``torch.chunk``'s split (chunks of ``ceil(rows / ws)`` rows, the last shorter, fewer chunks
    than ``ws`` where the rows run out), computed without torch (a plan asks it)."""
    if not len(shape):
        return [1]
    rows, rest = shape[0], math.prod(shape[1:])
    if rows == 0:
        return [0] * ws
    size = -(-rows // ws)
    return [min(size, rows - i * size) * rest for i in range(-(-rows // size))]


def step_scales(noise, names, s: float) -> List[Tuple[int, int, float, float]]:
    """``(run, step, std ratio, two-sided chi-square p)`` of each release's noise over all its
    coordinates: ``sum(noise^2) / s^2 ~ chi^2(coordinates)``."""
    out = []
    for i, run in enumerate(noise):
        for k, step in enumerate(run):
            t = sum(float((step[n] / s).pow(2).sum()) for n in names)
            m = sum(step[n].numel() for n in names)
            out.append((i, k, math.sqrt(t / m), chi2_two_sided_p(t, m)))
    return out


def scale_dispersion(noise, names) -> Optional[Tuple[float, int, float, float, float]]:
    """Whether the noise std varies from release to release, whatever its level and shape:
    ``(statistic, degrees of freedom, p, smallest, largest per-release std / pooled std)``, ``None``
    with fewer than 2 releases. Each release's mean square ``v_k`` over its ``m_k`` coordinates
    has variance ``v^2 (kappa - 1) / m_k`` under one scale, ``kappa`` the noise's kurtosis measured
    *within* releases (each standardised by its own RMS, so a mixture of scales across releases does
    not inflate it, and Laplace noise of one scale is not read as a varying one); ``sum_k (v_k -
    v)^2 / (v^2 (kappa - 1) / m_k) ~ chi^2(K - 1)`` (v the pooled mean square). Upper tail: a std
    that follows the realised Poisson batch, or a schedule, spreads the ``v_k`` far beyond it."""
    flat = [torch.cat([step[n].reshape(-1).to(torch.float64) for n in names]) for run in noise for step in run]
    flat = [x for x in flat if x.numel() >= 2]
    if len(flat) < 2:
        return None
    ms = torch.tensor([float(x.numel()) for x in flat], dtype=torch.float64)
    vs = torch.stack([x.pow(2).mean() for x in flat])
    if not bool((vs > 0).all()):
        return None
    kappa = float(sum(float((x.pow(2) / v).pow(2).sum()) for x, v in zip(flat, vs)) / float(ms.sum()))
    v = float((vs * ms).sum() / ms.sum())
    stat = float(((vs - v).pow(2) / (v * v * max(kappa - 1.0, 1e-12) / ms)).sum())
    dof = len(flat) - 1
    ratios = (vs / v).sqrt()
    return stat, dof, chi2_sf(stat, dof), float(ratios.min()), float(ratios.max())


def late_scale_change(scales, alpha: float, from_first: bool = False):
    """A scale that changes part-way through the runs, as ``(first step k, failing releases from k on,
    releases from k on, std ratios before k)``, or ``None``: releases failing their per-step test (at
    ``alpha`` over all releases, Bonferroni) start at step k > 0, and >= 3/4 of the releases from k
    on fail on one side. A scale wrong from step 0 is the scale tests' to name (``from_first``: the
    long run names it here, as from step 0)."""
    level = alpha / len(scales)
    failed = [x for x in scales if not x[3] >= level]
    if not failed:
        return None
    k = min(x[1] for x in failed)
    if k == 0 and not from_first:
        return None
    later = [x for x in scales if x[1] >= k]
    low = [x for x in failed if x[2] < 1]
    high = [x for x in failed if x[2] >= 1]
    side = low if len(low) >= len(high) else high
    if len(side) < max(2, 0.75 * len(later)):  # one release alone is a tail, not a change
        return None
    return k, side, later, [x[2] for x in scales if x[1] < k]


def scale_stats(stacked, names, ws: int, s: float, alpha: float, n_draws: int, power: float):
    """``(tensors, failures, shard_power, pooled)``: each tensor's scale and mean statistics (the
    evidence's ``tensors``), the failed tests as ``(test, tensor, rank, value, p)`` in order, each
    shard's power as tested ``(detectable std error, tensor, rank, coordinates)``, and the scale
    test pooled over the 1-D tensors (``None`` without any)."""
    failures: List[Tuple[str, str, Optional[int], float, float]]  # (test, tensor(s), shard rank or None, stat, p)
    tensors, failures, shard_power, sum_failures = {}, [], [], []
    for n in names:
        x = stacked[n]
        shard_stats, sum_ps = [], []
        for r, shard in enumerate(shards(x, ws)):
            t, k = float((shard / s).pow(2).sum()), shard.numel()
            shard_stats.append((r, math.sqrt(t / k), chi2_two_sided_p(t, k), k))
            low, high = detectable_std_ratios(k, alpha, power)
            shard_power.append((max(1 - low, high - 1), n, r, k // n_draws))
            width = k // n_draws
            if width >= 2:
                # each draw's shard sum is N(0, width s^2): sum_draws sum^2 / (width s^2) ~ chi^2(draws)
                # exactly; noise centred per shard (its mean subtracted) sums to 0: t ~ 0, lower tail
                sums = shard.reshape(n_draws, -1).sum(dim=1)
                t_sum = float(sums.pow(2).sum()) / (width * s * s)
                p_sum = chi2_cdf(t_sum, n_draws) if math.isfinite(t_sum) else 0.0
                sum_ps.append(p_sum)
                if not p_sum >= alpha:
                    sum_failures.append(("sum", n, r, t_sum, p_sum, width, n_draws))
        t_all, k_all = float((x / s).pow(2).sum()), x.numel()
        z_mean = float(x.sum()) / (s * math.sqrt(k_all))
        weakest = max(p for p in shard_power if p[1] == n)
        tensors[n] = {"coordinates": k_all // n_draws, "std_ratio": math.sqrt(t_all / k_all),
                      "shard_std_ratios": [round(ratio, 4) for _, ratio, _, _ in shard_stats],
                      "p_scale_min": min(p for _, _, p, _ in shard_stats), "z_mean": z_mean,
                      "p_shard_sum_min": min(sum_ps, default=None),
                      "shard_coordinates": weakest[3], "detects_std_error": weakest[0]}
        for r, ratio, p, _k in shard_stats:
            if not p >= alpha:
                failures.append(("scale", n, r, ratio, p))
        p_mean = normal_two_sided_p(z_mean)
        if not p_mean >= alpha:
            failures.append(("mean", n, None, z_mean, p_mean))
    # every 1-D tensor (bias, norm weight) pooled: one formula for all vectors' noise, a few % off,
    # is out of reach of each small vector's own test
    vectors = [n for n in names if stacked[n].dim() == 2]
    if vectors:
        t_vec = sum(float((stacked[n] / s).pow(2).sum()) for n in vectors)
        k_vec = sum(stacked[n].numel() for n in vectors)
        p_vec = chi2_two_sided_p(t_vec, k_vec)
        pooled = {"tensors": vectors, "values": k_vec, "std_ratio": math.sqrt(t_vec / k_vec), "p_scale": p_vec}
        if not p_vec >= alpha:
            failures.append(("vectors", ", ".join(repr(n) for n in vectors), None, math.sqrt(t_vec / k_vec), p_vec))
    else:
        pooled = None
    # the shard-sum statistic is divided by the required s^2, so a scale error moves it too: scale
    # failures are named first; a shard-sum failure alone (right scale) is noise that sums to ~0
    return tensors, failures + sum_failures, shard_power, pooled


def shape_stats(stacked, names, ws: int, alpha: float, power: float) -> Tuple[float, float, float, float, int]:
    """``(excess kurtosis, z, p, detectable excess kurtosis, values)`` of every coordinate's noise,
    each shard scaled by its own RMS, so only the distribution's shape is left to judge."""
    standard = torch.cat([(sh / sh.pow(2).mean().sqrt()).reshape(-1) for n in names for sh in shards(stacked[n], ws)])
    excess, z_kurt = kurtosis_z(standard)
    return (excess, z_kurt, normal_two_sided_p(z_kurt), detectable_excess_kurtosis(standard.numel(), alpha, power),
            standard.numel())



__all__ = ["PairDependence", "tensor_pair_dependence", "LowRank", "low_rank", "low_rank_bound", "independence",
           "shards", "shard_sizes", "step_scales", "scale_dispersion", "late_scale_change", "scale_stats",
           "shape_stats"]

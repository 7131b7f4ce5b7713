"""Noise structure statistics for ``noise_calibration``: dependence *between* the tensors of one
release and *within* a noise matrix, which per-coordinate tests (std, mean, shape) and the exact
repeat check cannot see.

* ``independence``: correlation across FSDP shards, consecutive steps and consecutive runs (moved
  here from ``noise_calibration``).
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

Both are exact bounds or chi^2 tails (no fitted constants); their false-alarm rate is the
``alpha`` the caller passes (``noise_calibration`` shares its family alpha over its tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from .stats import chi2_sf, correlation_p


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
    p, a, b, mean_r, worst, worst_r, k = best
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
                          [noise[i - 1][k][n] for i in range(1, len(noise)) for k in range(len(noise[i])) for n in names])
    return out


def low_rank_message(flat, where: str, alpha: float) -> str:
    return (f"PRIVACY VIOLATION: the noise on {flat.name!r} is low-rank {where}: in draw {flat.draw} its top singular "
            f"value is {flat.ratio:.3g} x its RMS ({flat.share:.0%} of the noise's energy in one direction); i.i.d. "
            f"Gaussian noise of that shape gives ~{flat.full_rank:.3g} and exceeds {flat.bound:.3g} with probability "
            f"< {alpha:.2g}. The coordinates' noise is linearly dependent (e.g. an outer product of two vectors): "
            "projected on its few directions, the released matrix carries almost no noise elsewhere.")


def tensor_pair_message(pair, at, where: str, alpha: float) -> str:
    """``at``: the ``(run, step)`` of the pair's most correlated draw."""
    run, step = at
    kind = ("one is the other negated" if pair.worst_r < -0.999 else
            "one is the other" if pair.worst_r > 0.999 else "a linear dependence")
    return (f"PRIVACY VIOLATION: the noise of {pair.a!r} and of {pair.b!r} (same shape) is dependent {where}: "
            f"correlation {pair.mean_r:+.3f} on average over {pair.draws} draws, {pair.worst_r:+.3f} at step {step} of "
            f"run {run} ({kind}; p={pair.p:.2g} < {alpha:.2g} over the {pair.pairs} pair(s) of equal-shape tensors). "
            "Each tensor's noise must be independent of every other's: a noise reused (negated or mixed) on another "
            "tensor cancels in a sum or difference of the two released tensors.")


__all__ = ["PairDependence", "tensor_pair_dependence", "LowRank", "low_rank", "low_rank_bound", "independence",
           "low_rank_message", "tensor_pair_message"]

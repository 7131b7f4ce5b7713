"""The tail test of ``noise_calibration``: Gaussian noise clamped (or otherwise bounded) at a few
sigma moves the std by < 0.5% and the excess kurtosis by < 0.1 -- below what the scale and shape
tests detect -- yet it voids the Gaussian mechanism's guarantee (a release beyond the bound of one
neighbour's gradient is impossible, so a large enough difference is told apart for sure). Two
exact tests on every noise value ``z = noise / s`` (``s`` the expected std), pooled:

* **mass beyond k sigma** (lower tail), for ``k`` in ``KS``: the count of ``|z| > k`` is
  ``Binomial(n, P(|Z| > k))`` for Gaussian noise; its lower tail is bounded by Chernoff's
  ``exp(-n KL(c/n || p))`` (an upper bound on the p-value: conservative). Noise clamped at 3 sigma
  has nothing beyond 3.5 where ~46 of 100 000 Gaussian values lie.
* **repeated boundary values** (the extremes): ``T = -log P(|Z| > |z|)`` is exactly Exp(1) for
  Gaussian noise, so (Renyi's representation) the gap ``T_(1) - T_(m)`` between the largest and the
  m-th largest of any number of values is distributed as the maximum of ``m - 1`` i.i.d. Exp(1):
  ``P(gap < x) = (1 - e^-x)^(m-1)``, whatever ``n``. Clamped noise puts its largest values all on
  the boundary (gap ~ 0). Each value is widened by the rounding of ``gradient(sigma) -
  gradient(0)`` in the run's dtype (``quantum``) before the gap is taken, which only makes the
  p-value larger (conservative); under bf16 mixed precision the test is not made (values repeat by
  rounding). ``m`` runs over ``2..M_MAX``, Bonferroni over them.

Each test's p-value is corrected over its own variants (``KS``, the ``m``), so a verdict's two
tail tests have false-alarm rate <= the ``alpha`` the caller passes each (``noise_calibration``'s
``alpha_per_test``, ~1e-7..1e-6 in the gate). Measured detection: docs/noise.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

from ...lazy import torch

#: the sigma multiples whose outer mass is tested (a clamp at or below 3.5 sigma empties the last ones)
KS = (3.0, 3.5, 4.0)
#: the largest values compared to the largest (m = 2..M_MAX)
M_MAX = 8


@dataclass(frozen=True)
class Tails:
    """The tail statistics of one verdict's noise (``tails``)."""

    values: int                 # noise values pooled
    beyond: Dict[float, int]    # k -> count of |z| > k
    expected: Dict[float, float]  # k -> expected count for Gaussian noise
    p_mass: float               # mass beyond k sigma, lower tail, Bonferroni over KS
    worst_k: float              # the k of the smallest mass p-value
    p_boundary: float           # repeated boundary values, Bonferroni over m (1.0 where not made)
    top: float                  # the largest |z|
    m: int                      # the m of the smallest boundary p-value
    mth: float                  # the m-th largest |z|

    def failed(self, alpha: float) -> Optional[str]:
        """``"boundary"`` or ``"mass"`` (the more specific first) where a test fails at ``alpha``."""
        if not self.p_boundary >= alpha:
            return "boundary"
        if not self.p_mass >= alpha:
            return "mass"
        return None


def two_sided_sf(z: float) -> float:
    """``P(|Z| > z)`` for standard normal ``Z``."""
    return math.erfc(z / math.sqrt(2.0))


def binomial_lower_bound(count: int, n: int, p: float) -> float:
    """An upper bound on ``P(Binomial(n, p) <= count)`` (Chernoff: ``exp(-n KL(count/n || p))``;
    1 where ``count >= n p``)."""
    if n == 0 or count >= n * p:
        return 1.0
    c = count / n
    kl = (c * math.log(c / p) if c > 0 else 0.0) + (1 - c) * math.log((1 - c) / (1 - p))
    return math.exp(-n * kl)


def rounding_quantum(spec, s: float, clean_max: float) -> Optional[float]:
    """A bound, in units of ``s``, on the rounding of one measured noise value (the noisy release
    rounded once in the run's dtype, the noise-0 release exact), scaled by ``z_max`` by the caller;
    ``None`` under mixed precision (bf16 rounding: values repeat; the boundary test is not made)."""
    if getattr(spec, "precision", "fp32") != "fp32":
        return None
    return 4.0 * torch.finfo(spec.torch_dtype).eps * (1.0 + clean_max / s)


def clean_max(outputs, names: Sequence[str]) -> float:
    """The largest ``|gradient|`` of the noise-0 run (``outputs[0]``), over ``names``."""
    return max((float(st.gradient[n].abs().max()) for st in outputs[0][0].steps for n in names
                if st.gradient[n].numel()), default=0.0)


def tails(stacked, names: Sequence[str], s: float, quantum: Optional[float]) -> Tails:
    """The tail statistics of every noise value of ``stacked[name]`` (``[draws, *shape]``) over the
    expected std ``s``; ``quantum`` (``rounding_quantum``) per unit of ``|z|``, ``None``: no boundary test."""
    z = torch.cat([stacked[n].reshape(-1) for n in names]).abs() / s
    n = z.numel()
    top_k = torch.topk(z, min(M_MAX, n)).values.tolist() if n else []
    widen = (quantum or 0.0) * (1.0 + (top_k[0] if top_k else 0.0))
    beyond, expected, p_mass, worst_k = {}, {}, 1.0, KS[0]
    for k in KS:
        beyond[k] = int((z > k - widen).sum())
        expected[k] = n * two_sided_sf(k)
        p = min(1.0, len(KS) * binomial_lower_bound(beyond[k], n, two_sided_sf(k)))
        if p < p_mass:
            p_mass, worst_k = p, k
    p_boundary, m_best = 1.0, 2
    if quantum is not None and len(top_k) >= 2:
        hi = -math.log(max(two_sided_sf(top_k[0] + widen), 1e-300))
        for m in range(2, len(top_k) + 1):
            gap = hi + math.log(max(two_sided_sf(max(top_k[m - 1] - widen, 0.0)), 1e-300))
            p = min(1.0, (M_MAX - 1) * (-math.expm1(-max(gap, 0.0))) ** (m - 1))
            if p < p_boundary:
                p_boundary, m_best = p, m
    return Tails(n, beyond, expected, p_mass, worst_k, p_boundary, top_k[0] if top_k else 0.0, m_best,
                 top_k[m_best - 1] if len(top_k) >= m_best else 0.0)




#: a noise that takes at most this many distinct values (and at most a quarter of its values' count) is
#: on a grid; Gaussian noise quantised at ``quantum`` (far below its std) has nearly as many as values
GRID_MAX_DISTINCT = 1024


#: how far from a grid point (a fraction of the step) a value of noise on that grid may lie: its rounding
#: only. Continuous noise puts the largest of >= 64 values within 5% of a point with probability 0.1^64
ON_GRID = 0.05
#: the fewest distinct values called a grid: a few noisy values among exact zeros (noise missing on most
#: coordinates) sit on the "grid" their own gaps define; 8 continuous values all within ``ON_GRID`` of
#: the grid of their smallest gap have probability ~0.1^6
GRID_MIN_DISTINCT = 8


def coarse_grid(values, quantum: float) -> Optional[Tuple[int, int, float, float]]:
    """``(distinct values, values, grid step, fraction exactly on 0)`` where ``values`` (noise, in any
    unit; ``quantum`` in the same unit, far above its rounding) take few distinct values on a uniform
    grid -- noise rounded to a grid, a discrete mechanism the Gaussian accounting does not cover;
    ``None`` otherwise (or for fewer than 64 values)."""
    v = values.reshape(-1).to(torch.float64)
    n = v.numel()
    if n < 64:
        return None
    keys = torch.unique(torch.round(v / quantum).to(torch.int64))
    if keys.numel() > min(GRID_MAX_DISTINCT, n // 4) or keys.numel() < GRID_MIN_DISTINCT:
        return None
    gap = int(torch.diff(keys).min())
    # a uniform grid fills its range (half of its steps or more hold a value); a floating-point format's
    # values (bf16, float16: the named grids' checks) are dense near 0 and sparse beyond, so they do not
    if keys.numel() * 2 < (int(keys.max()) - int(keys.min())) // gap:
        return None
    step = gap * quantum
    # on the grid, not near it: noise of a small spread (too little noise: a scale bug) also rounds to few
    # multiples of ``quantum``, but its values sit anywhere between them; a grid's sit on its points
    if float((v / step - torch.round(v / step)).abs().max()) > ON_GRID:
        return None
    return int(keys.numel()), n, step, float((torch.round(v / quantum) == 0).double().mean())


__all__ = ["KS", "M_MAX", "GRID_MAX_DISTINCT", "Tails", "two_sided_sf", "binomial_lower_bound", "rounding_quantum",
           "clean_max", "tails", "ON_GRID", "GRID_MIN_DISTINCT", "coarse_grid"]

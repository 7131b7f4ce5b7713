"""Two-sided tests for Gaussian noise, and their power, without scipy.

Every function returns plain floats; a non-finite input gives a p-value of 0 (a NaN statistic
must reject, never pass: ``p < alpha`` is False for NaN).
"""

from __future__ import annotations

import math
from typing import Tuple

import torch


def _f64(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def chi2_cdf(t: float, k: int) -> float:
    """P(chi^2_k <= t): the regularised lower incomplete gamma P(k/2, t/2)."""
    return float(torch.special.gammainc(_f64(k / 2), _f64(t / 2)))


def chi2_sf(t: float, k: int) -> float:
    return float(torch.special.gammaincc(_f64(k / 2), _f64(t / 2)))


def norm_sf(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2))


def chi2_two_sided_p(t: float, k: int) -> float:
    """Two-sided p-value of ``t`` under chi^2_k (0 for a non-finite ``t``)."""
    if not math.isfinite(t):
        return 0.0
    return min(1.0, 2 * min(chi2_cdf(t, k), chi2_sf(t, k)))


def normal_two_sided_p(z: float) -> float:
    return 2 * norm_sf(abs(z)) if math.isfinite(z) else 0.0


def chi2_quantile(p: float, k: int) -> float:
    """``t`` with P(chi^2_k <= t) = p (bisection; chi^2 quantiles are what the power needs)."""
    lo, hi = 0.0, max(1.0, k + 20 * math.sqrt(2 * k) + 50)
    while chi2_cdf(hi, k) < p:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if chi2_cdf(mid, k) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return (lo + hi) / 2


def detectable_std_ratios(n: int, alpha: float, power: float = 0.99) -> Tuple[float, float]:
    """``(low, high)``: the std ratios (measured / expected) nearest 1 that the two-sided scale
    test on ``n`` draws at level ``alpha`` rejects with probability >= ``power``. A std error of
    ``1 - low`` (too little noise) or ``high - 1`` (too much) or more is detected that often.

    Under std ratio r the statistic sum(x^2)/s^2 is r^2 chi^2_n, so the rejection probability is
    P(chi^2_n < q_lo / r^2) + P(chi^2_n > q_hi / r^2), monotone in r on each side of 1.
    """
    q_lo, q_hi = chi2_quantile(alpha / 2, n), chi2_quantile(1 - alpha / 2, n)

    def rejects(r: float) -> float:
        return chi2_cdf(q_lo / r ** 2, n) + chi2_sf(q_hi / r ** 2, n)

    def solve(a: float, b: float) -> float:  # rejects(a) >= power > rejects(b)
        for _ in range(60):
            mid = (a + b) / 2
            if rejects(mid) >= power:
                a = mid
            else:
                b = mid
        return a

    return solve(1e-6, 1.0), solve(1e6, 1.0)


def correlation_p(x: torch.Tensor, y: torch.Tensor) -> Tuple[float, float]:
    """``(r, p)``: Pearson correlation of two equal-length samples and the two-sided Fisher z
    p-value of r under independence (``(0, 1)`` for fewer than 4 pairs)."""
    m = x.numel()
    if m < 4:
        return 0.0, 1.0
    r = float(torch.corrcoef(torch.stack([x.reshape(-1), y.reshape(-1)]))[0, 1])
    if not math.isfinite(r):
        return r, 0.0
    r_c = max(min(r, 1 - 1e-15), -1 + 1e-15)
    return r, normal_two_sided_p(math.atanh(r_c) * math.sqrt(m - 3))

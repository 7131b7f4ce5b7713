"""Two-sided tests for Gaussian noise, and their power, without scipy.

Every function returns plain floats; a non-finite input gives a p-value of 0 (a NaN statistic
must reject, never pass: ``p < alpha`` is False for NaN).
"""

from __future__ import annotations

import math
from typing import Tuple

from ...lazy import torch


def _f64(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def chi2_cdf(t: float, k: float) -> float:
    """P(chi^2_k <= t): the regularised lower incomplete gamma P(k/2, t/2)."""
    return float(torch.special.gammainc(_f64(k / 2), _f64(t / 2)))


def chi2_sf(t: float, k: float) -> float:
    return float(torch.special.gammaincc(_f64(k / 2), _f64(t / 2)))


def norm_sf(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2))


def chi2_two_sided_p(t: float, k: float) -> float:
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


def skewed_normal_two_sided_p(z: torch.Tensor, skew: torch.Tensor) -> torch.Tensor:
    """Two-sided p-values of standardised sums ``z`` whose skewness is ``skew`` (small: ~1/sqrt(n)),
    elementwise, with the first term of Cramer's large-deviation series: P(Z > a) ~ Phi-bar(a)
    exp(skew a^3 / 6) on the side the skew lengthens, exp(-skew a^3 / 6) on the other. At a ~ 5.7
    and skew 0.04 the plain normal tail is 3.5x too light on the long side: the correction keeps a
    Bonferroni split over many lags honest. The correction is frozen beyond a = min(8, 1/skew),
    where it is no longer valid (and so that p keeps falling as |z| grows). Computed in logs
    (no underflow at |z| ~ 100); a non-finite ``z`` gives 0."""
    z = torch.as_tensor(z, dtype=torch.float64)
    skew = torch.as_tensor(skew, dtype=torch.float64).expand_as(z)
    a = z.abs()
    cap = torch.minimum(torch.full_like(skew, 8.0), 1 / skew.abs().clamp_min(1e-12))
    log_p = math.log(2.0) + torch.special.log_ndtr(-a) + torch.sign(z) * skew * torch.minimum(a, cap) ** 3 / 6
    p = log_p.exp().clamp(max=1.0)
    return torch.where(torch.isfinite(z) & torch.isfinite(skew), p, torch.zeros_like(p))


def lag_autocovariance_z(y: torch.Tensor, lmax: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(z, skew)``, each ``[lmax]``: for every lag L = 1..lmax, the pooled lag-L autocovariance
    of the k columns of ``y`` (``[T, k]``, each column one series: e.g. one sample's 0/1 inclusion
    indicators over T steps) standardised under "every series i.i.d. over time", and the skewness
    of that sum (for ``skewed_normal_two_sided_p``).

    Each column is centred at its own mean m_i, so series with different rates are not read as
    correlated. Under the null S_L = sum_i sum_{t <= T-L} y_it y_i,t+L has mean -sum_i (T-L) v_i / T
    (the centring), variance sum_i (T-L) v_i^2 and third cumulant sum_i (T-L) mu3_i^2 (products of
    independent centred terms; neighbouring products are uncorrelated), with v_i and mu3_i the
    column's second and third central moments. All lags at once by FFT: O(k T log T)."""
    t, k = y.shape
    y = y.to(torch.float64)
    y = y - y.mean(0)
    v = (y ** 2).mean(0)
    mu3 = (y ** 3).mean(0)
    spec = torch.fft.rfft(y, n=2 * t, dim=0)
    acov = torch.fft.irfft(spec * spec.conj(), n=2 * t, dim=0)[1:lmax + 1].sum(1)  # [lmax]
    span = t - torch.arange(1, lmax + 1, dtype=torch.float64)  # T - L pairs per series
    var = span * float((v ** 2).sum())
    z = (acov + span * float(v.sum()) / t) / var.sqrt()
    skew = span * float((mu3 ** 2).sum()) / var ** 1.5
    return z, skew


def kurtosis_z(x: torch.Tensor) -> Tuple[float, float]:
    """``(excess, z)``: the sample excess kurtosis ``m4 / m2^2 - 3`` of ``x`` and its Anscombe-Glynn
    (1983) normal score under normality (the transform scipy's ``kurtosistest`` uses; accurate
    far into the tails for n >= 20). Heavy tails (Laplace: excess 3) give z > 0, light tails
    (uniform: excess -1.2) z < 0. ``(nan, nan)`` for fewer than 20 values or a constant sample."""
    x = x.reshape(-1).to(torch.float64)
    n = x.numel()
    if n < 20:
        return math.nan, math.nan
    d = x - x.mean()
    m2, m4 = float(d.pow(2).mean()), float(d.pow(4).mean())
    if not (m2 > 0 and math.isfinite(m4)):
        return math.nan, math.nan
    b2 = m4 / m2 ** 2
    mean = 3.0 * (n - 1) / (n + 1)
    var = 24.0 * n * (n - 2) * (n - 3) / ((n + 1) ** 2 * (n + 3) * (n + 5))
    x_std = (b2 - mean) / math.sqrt(var)
    beta1 = (6.0 * (n * n - 5 * n + 2) / ((n + 7) * (n + 9))
             * math.sqrt(6.0 * (n + 3) * (n + 5) / (n * (n - 2) * (n - 3))))
    a = 6.0 + 8.0 / beta1 * (2.0 / beta1 + math.sqrt(1 + 4.0 / beta1 ** 2))
    denom = 1 + x_std * math.sqrt(2 / (a - 4))
    if denom == 0:
        return b2 - 3, math.inf
    term2 = math.copysign(abs((1 - 2 / a) / denom) ** (1 / 3), denom)
    return b2 - 3, ((1 - 2 / (9 * a)) - term2) / math.sqrt(2 / (9 * a))


def pairwise_dependence(vectors: torch.Tensor) -> Tuple[float, int, float, Tuple[int, int, float]]:
    """A lag-free independence test of ``k`` draws of one ``m``-dimensional noise vector
    (``vectors``: ``[k, m]``, mean 0 under the null): ``(t, pairs, p, (i, j, r_ij))`` where
    ``t = m * sum_{i<j} r_ij^2`` over every pair of draws (``r_ij`` the uncentred correlation of
    draws i and j), ~ chi^2 with ``k(k-1)/2`` degrees of freedom when the draws are independent
    (``m r^2`` has mean 1 and variance ~2 for any i.i.d. coordinates; its Beta tail is lighter than
    chi^2's, so the test is conservative), and the most correlated pair. ``p`` combines (Bonferroni,
    x2) the upper-tail p-value of ``t`` -- diffuse dependence among many pairs -- with that of the
    largest ``m r_ij^2`` against chi^2_1 over all pairs -- one dependent pair, e.g. a noise vector
    reused with a little fresh noise at one lag. Any dependence between any two draws, at any lag
    or across runs, raises one of them."""
    v = vectors.reshape(vectors.shape[0], -1).to(torch.float64)
    k, m = v.shape
    if k < 2 or m < 2:
        return 0.0, 0, 1.0, (0, 0, 0.0)
    unit = v / v.norm(dim=1, keepdim=True)
    r = unit @ unit.T
    iu = torch.triu_indices(k, k, offset=1)
    rs = r[iu[0], iu[1]]
    t = float(m * rs.pow(2).sum())
    pairs = rs.numel()
    worst = int(rs.abs().argmax())
    top = float(m * rs[worst] ** 2)
    if not (math.isfinite(t) and math.isfinite(top)):
        return t, pairs, 0.0, (int(iu[0, worst]), int(iu[1, worst]), float(rs[worst]))
    p = min(1.0, 2 * min(chi2_sf(t, pairs), pairs * chi2_sf(top, 1)))
    return t, pairs, p, (int(iu[0, worst]), int(iu[1, worst]), float(rs[worst]))


def detectable_excess_kurtosis(n: int, alpha: float, power: float = 0.99) -> float:
    """The smallest |excess kurtosis| the two-sided kurtosis test on ``n`` values at level
    ``alpha`` detects with probability ~``power`` (normal approximation with the null variance
    24/n; heavy-tailed alternatives have a larger variance, so treat it as indicative -- the
    measured rates are in docs/noise.md)."""
    return (_norm_quantile(1 - alpha / 2) + _norm_quantile(power)) * math.sqrt(24.0 / n)


def _norm_quantile(p: float) -> float:
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if 1 - norm_sf(mid) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


__all__ = ["chi2_cdf", "chi2_sf", "norm_sf", "chi2_two_sided_p", "normal_two_sided_p", "chi2_quantile",
           "detectable_std_ratios", "correlation_p", "skewed_normal_two_sided_p", "lag_autocovariance_z", "kurtosis_z",
           "pairwise_dependence", "detectable_excess_kurtosis"]

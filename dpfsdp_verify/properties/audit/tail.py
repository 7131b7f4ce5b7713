"""The one-run audit's tail bound: the exact distribution of an auditor's mistakes under the mu-GDP channel.

Xiang et al., "Tight privacy audit in one run" (arXiv 2509.08704). Same setting as ``audit_fdp`` (the
f-DP recursion of Mahloujifar, Melis and Chaudhuri) and ``audit_bound`` (Steinke, Nasr and Jagielski's
counting bound): n canaries with uniform independent secrets, an auditor that commits to its r most
confident guesses and makes u mistakes among them. The hypothesis is again mu-GDP, but instead of a
recursion valid for every curve the bound computes the probability of so few mistakes under the
Gaussian channel itself, ``N(0, 1)`` for an out canary and ``N(mu, 1)`` for a member: every mu-GDP
mechanism is a post-processing of that channel (Blackwell; Dong, Roth and Su), so no mu-GDP training
lets an auditor do better than the channel's own best guesses, which rank canaries by the
likelihood ratio's size.

The distribution, for a canary seen through the channel with a uniform secret: write z for its
observation minus mu/2, so the log-likelihood ratio is ``mu z`` and the best guess's confidence
grows with ``s = |z|``. s has density ``f(s) = phi(s + mu/2) + phi(s - mu/2)`` and, given s, the best
guess is wrong with probability ``1 / (1 + e^(mu s))``; so the error mass above s is
``G(s) = Phi(-(s + mu/2))`` and the mass above s is ``1 - w(s) = Phi(-(s + mu/2)) + Phi(-(s - mu/2))``.
The auditor releases the r canaries of largest s; the largest one it does not release sits at the
quantile W of the (n - r)-th of n order statistics, ``W ~ Beta(n - r, r + 1)``, and, given it, the
r released ones are independent draws above it, each wrong with the mean error there,
``gbar(s) = G(s) / (1 - w(s))``. Hence (the paper's equation (1), integrated over s instead of w)

    P[mistakes <= u] = integral Beta_pdf(w(s); n - r, r + 1) f(s) BinCDF(u; r, gbar(s)) ds,

and ``BinCDF(u; n, Phi(-mu/2))`` when r = n (no cut). The probability rises with mu (a larger mu
is a weaker claim: fewer mistakes are likely), so a hypothesis is rejected at significance tau
when it is below tau, and ``mu_lb``, the largest rejected mu, is found by bisection; ``eps_lb``
is mu_lb-GDP's epsilon at the run's delta (``audit_fdp.gdp_epsilon``).

Why a second f-DP bound: the recursion holds for every trade-off curve and pays for it; the
channel's own distribution is what a mu-GDP mechanism can at most achieve, and proves more from
the same guesses (90 of 100 right among 1000 canaries at 95%: the recursion proves mu >= 0.6025,
epsilon 2.456 at delta 1e-5; the tail bound mu >= 0.7537, epsilon 3.1645, the value of the paper's
comparison table; eight of its rows are reproduced in the tests). Its DP meaning and its limit are
those of the recursion (``audit_fdp``'s docstring): a rejection proves the release is not mu-GDP.

Numerics: float64 torch, the integrand assembled in logs (the Beta density is sharp: n in the
thousands) on ``GRID`` points of s spanning ``SPAN`` standard deviations of W's Beta around its
mean, the binomial CDF as a log-sum-exp of its terms; the tests check the integral of the Beta
part alone against 1 and the CDF against scipy.
"""

from __future__ import annotations

import math
from statistics import NormalDist

from ...lazy import torch

#: the largest mu the bisection searches, and its tolerance (as ``audit_fdp``)
MU_MAX = 20.0
MU_TOL = 1e-5
#: points of the quadrature over s, and the half-width of its range in standard deviations of W
GRID = 257
SPAN = 12.0

_NORMAL = NormalDist()


def _upper(x: float) -> float:
    """``Phi(-x)``, accurate in the far tail (erfc)."""
    return math.erfc(x / math.sqrt(2.0)) / 2.0


def _mass_above(s: float, mu: float) -> float:
    return _upper(s + mu / 2) + _upper(s - mu / 2)


def _s_at(w: float, mu: float) -> float:
    """The s whose quantile ``w(s) = 1 - _mass_above(s)`` is ``w`` (bisection; w(s) rises with s)."""
    lo, hi = 0.0, 1.0
    while 1.0 - _mass_above(hi, mu) < w:
        lo, hi = hi, 2 * hi
        if hi > 80.0:
            return hi
    for _ in range(200):
        mid = (lo + hi) / 2
        if 1.0 - _mass_above(mid, mu) < w:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-13 * max(1.0, hi):
            break
    return (lo + hi) / 2


def _log_binom_cdf(u: int, r: int, p: "torch.Tensor") -> "torch.Tensor":
    """``log P[Binomial(r, p) <= u]`` for each p (a tensor), as a log-sum-exp of its terms."""
    if u >= r:
        return torch.zeros_like(p)
    k = torch.arange(u + 1, dtype=torch.float64)
    log_c = math.lgamma(r + 1) - torch.lgamma(k + 1) - torch.lgamma(r - k + 1)
    lp = torch.log(p).unsqueeze(-1)
    lq = torch.log1p(-p).unsqueeze(-1)
    terms = log_c + k * lp + (r - k) * lq
    return torch.logsumexp(terms, dim=-1)


def _log_phi(x: "torch.Tensor") -> "torch.Tensor":
    return -0.5 * x * x - 0.5 * math.log(2 * math.pi)


def _log_upper(x: "torch.Tensor") -> "torch.Tensor":
    """``log Phi(-x)`` for a tensor, stable in both tails."""
    return torch.special.log_ndtr(-x)


def _cut(r: int, n: int, mu: float):
    """``(s, log_density, log_gbar)`` on the quadrature's grid: s, the log of the cut's density in s
    (``Beta_pdf(w(s); n - r, r + 1) f(s)``) and the log of the mean error above s (module docstring)."""
    a, b = n - r, r + 1
    mean, sd = a / (a + b), math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1)))
    w_lo, w_hi = max(mean - SPAN * sd, 1e-300), min(mean + SPAN * sd, 1.0 - 1e-16)
    s = torch.linspace(_s_at(w_lo, mu), _s_at(w_hi, mu), GRID, dtype=torch.float64)
    half = mu / 2
    log_above = torch.logaddexp(_log_upper(s + half), _log_upper(s - half))  # log (1 - w)
    log_w = torch.log(-torch.expm1(log_above).clamp(max=0.0)).nan_to_num(neginf=-1e300)
    log_beta = (a - 1) * log_w + (b - 1) * log_above - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    log_f = torch.logaddexp(_log_phi(s + half), _log_phi(s - half))
    return s, log_beta + log_f, _log_upper(s + half) - log_above


def probability(r: int, u: int, n: int, mu: float) -> float:
    """``P[mistakes <= u]`` for an auditor's ``r`` most confident guesses about ``n`` canaries seen
    through the mu-GDP channel (module docstring)."""
    _check(r, u, n)
    if not mu >= 0.0:
        raise ValueError(f"mu must be >= 0, got {mu!r}")
    if u >= r:
        return 1.0
    if r == n:
        p = torch.tensor([_upper(mu / 2)], dtype=torch.float64)
        return float(_log_binom_cdf(u, r, p).exp()[0])
    s, log_density, log_gbar = _cut(r, n, mu)
    log_integrand = log_density + _log_binom_cdf(u, r, torch.exp(log_gbar).clamp(1e-300, 0.5))
    top = float(log_integrand.max())
    if not math.isfinite(top):
        return 0.0
    value = torch.trapezoid(torch.exp(log_integrand - top), s)
    return min(1.0, float(value) * math.exp(top))


def beta_mass(r: int, n: int, mu: float) -> float:
    """The quadrature of ``probability``'s Beta part alone (u = r): 1 up to the quadrature's error
    (the tests' check of the grid)."""
    _check(r, r, n)
    s, log_density, _ = _cut(r, n, mu)
    return float(torch.trapezoid(torch.exp(log_density), s))


def rejects(r: int, v: int, n: int, mu: float, level: float) -> bool:
    """Whether ``v`` or more right of ``r`` guesses about ``n`` canaries rejects mu-GDP at ``level``."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    return probability(r, r - v, n, mu) < level


def mu_lower_bound(r: int, v: int, n: int, level: float) -> float:
    """The largest mu whose mu-GDP hypothesis ``rejects`` (to ``MU_TOL``, the lower end of the final
    bracket, so that it is never overstated); 0 when not even mu = 0 is rejected."""
    if not rejects(r, v, n, 0.0, level):
        return 0.0
    lo, hi = 0.0, MU_MAX
    if rejects(r, v, n, hi, level):
        return hi
    while hi - lo > MU_TOL:
        mid = (lo + hi) / 2
        if rejects(r, v, n, mid, level):
            lo = mid
        else:
            hi = mid
    return lo


def _check(r: int, u: int, n: int) -> None:
    if not (isinstance(r, int) and isinstance(u, int) and 0 <= u <= r <= n and n > 0):
        raise ValueError(f"need integers 0 <= u <= r <= n, n > 0, got r={r!r} u={u!r} n={n!r}")


__all__ = ["MU_MAX", "GRID", "probability", "beta_mass", "rejects", "mu_lower_bound"]

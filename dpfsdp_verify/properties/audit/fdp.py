"""The one-run privacy audit's f-DP bound: from guesses about secret canaries to a lower bound on mu, then epsilon.

Mahloujifar, Melis and Chaudhuri, "Auditing f-differential privacy in one run" (ICML 2025, arXiv
2410.22235), the recursion their reference code calls ``audit_rh_with_cap`` (also in jax_privacy's
``CanaryScoreAuditor.epsilon_one_run_fdp`` and PrivacyGuard's ``FDPAnalysisNode``). Same setting as
``audit_bound`` (Steinke, Nasr and Jagielski's counting bound): m canaries with uniform independent
secrets, r guesses (abstain on the rest), v of them right. The hypothesis is a trade-off curve f
instead of an (epsilon, delta) pair; here the Gaussian one, mu-GDP: no test between a canary in and
out has a smaller type II error than ``G_mu(a) = Phi(Phi^-1(1 - a) - mu)`` at type I error a.

For a hypothesis f and a significance level tau, with ``g(x) = f(1 - x)`` (the paper's inverse
blow-up; for mu-GDP ``g(x) = Phi(Phi^-1(x) - mu)``), start from ``a_v = tau v / m``,
``b_v = tau (r - v) / m`` and for i = v - 1 down to 0

    b_i = max(b_{i+1}, g(a_{i+1})),        a_i = a_{i+1} + i / (r - i) (b_i - b_{i+1}).

The observation (v or more right of r) has probability below tau under any f-DP training when
``a_0 + b_0 > r / m``: the hypothesis is rejected. Rejection is monotone in mu (a larger mu is a
weaker claim, g smaller, a_0 + b_0 smaller), so ``mu_lb``, the largest rejected mu, is found by
bisection, and ``eps_lb`` is the epsilon of mu_lb-GDP at the run's delta (Dong, Roth and Su,
corollary 2.13: ``delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``). Both reference
implementations use the recursion exactly so (jax_privacy caps a_i at 1, which never binds where
the answer is decided; both test one-sided guesses, the recursion takes any r of m).

DP meaning and its limit: a rejection proves the release is *not mu-GDP* at the stated
confidence. For a mechanism whose privacy curve is Gaussian-shaped -- DP-SGD with Gaussian noise,
composed over many steps, is close to GDP by the central limit theorem -- that is a leak above
the (epsilon, delta) the GDP curve implies; the counting bound (``audit_bound``) needs no shape
assumption and is kept beside it. ``privacy_audit`` reports both and uses the larger; its
measured false alarms on correct runs are in docs/audit.md.

Pure Python (``math`` and ``statistics.NormalDist``): the gate depends on torch alone.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Callable

#: the largest mu the bisection searches (mu-GDP's epsilon at delta 1e-5 is ~60 there)
MU_MAX = 20.0
#: the bisection's tolerance on mu
MU_TOL = 1e-5

_NORMAL = NormalDist()


def gdp_inverse_blow_up(mu: float) -> Callable[[float], float]:
    """``g(x) = Phi(Phi^-1(x) - mu)`` for x in [0, 1] (0 and 1 at the ends): mu-GDP's trade-off
    curve read as ``g(x) = G_mu(1 - x)``."""
    if not mu >= 0.0:
        raise ValueError(f"mu must be >= 0, got {mu!r}")

    def g(x: float) -> float:
        if x <= 0.0:
            return 0.0
        if x >= 1.0:
            return 1.0
        return _NORMAL.cdf(_NORMAL.inv_cdf(x) - mu)
    return g


def rejects(g: Callable[[float], float], r: int, v: int, m: int, level: float) -> bool:
    """Whether ``v`` or more right of ``r`` guesses about ``m`` canaries rejects the hypothesis whose
    inverse blow-up is ``g`` at significance ``level`` (module docstring: ``a_0 + b_0 > r / m``)."""
    _check(r, v, m)
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    a, b = level * v / m, level * (r - v) / m
    for i in range(v - 1, -1, -1):
        b_new = max(b, g(a))
        if b_new == b:  # b unchanged: neither a nor b can change again
            break
        a, b = a + i / (r - i) * (b_new - b), b_new
    return a + b > r / m


def mu_lower_bound(r: int, v: int, m: int, level: float) -> float:
    """The largest mu whose mu-GDP hypothesis ``rejects`` (to ``MU_TOL``, the lower end of the final
    bracket so that it is never overstated); 0 when not even mu = 0 is rejected."""
    if not rejects(gdp_inverse_blow_up(0.0), r, v, m, level):
        return 0.0
    lo, hi = 0.0, MU_MAX
    if rejects(gdp_inverse_blow_up(hi), r, v, m, level):
        return hi
    while hi - lo > MU_TOL:
        mid = (lo + hi) / 2
        if rejects(gdp_inverse_blow_up(mid), r, v, m, level):
            lo = mid
        else:
            hi = mid
    return lo


def gdp_delta(mu: float, eps: float) -> float:
    """mu-GDP's delta at ``eps``: ``Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)`` (0 at mu = 0),
    the second term in log space (``e^eps`` alone overflows where the product does not)."""
    if mu <= 0.0:
        return 0.0
    first = _NORMAL.cdf(-eps / mu + mu / 2)
    x = eps / mu + mu / 2  # Phi(-x) = erfc(x / sqrt 2) / 2
    tail = math.erfc(x / math.sqrt(2)) / 2
    second = math.exp(eps + math.log(tail)) if tail > 0.0 else 0.0
    return max(0.0, first - second)


def gdp_epsilon(mu: float, delta: float, tol: float = 1e-7) -> float:
    """The smallest eps >= 0 with ``gdp_delta(mu, eps) <= delta``: mu-GDP's epsilon at ``delta``
    (bisection; delta falls as eps rises)."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if gdp_delta(mu, 0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while gdp_delta(mu, hi) > delta:
        lo, hi = hi, 2 * hi
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if gdp_delta(mu, mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def epsilon_lower_bound(r: int, v: int, m: int, delta: float, level: float) -> float:
    """``gdp_epsilon(mu_lower_bound(r, v, m, level), delta)``: the f-DP bound in epsilon at ``delta``."""
    mu = mu_lower_bound(r, v, m, level)
    return gdp_epsilon(mu, delta) if mu > 0.0 else 0.0


def _check(r: int, v: int, m: int) -> None:
    if not (isinstance(r, int) and isinstance(v, int) and 0 <= v <= r <= m and m > 0):
        raise ValueError(f"need integers 0 <= v <= r <= m, m > 0, got r={r!r} v={v!r} m={m!r}")


__all__ = ["MU_MAX", "gdp_inverse_blow_up", "rejects", "mu_lower_bound", "gdp_delta", "gdp_epsilon",
           "epsilon_lower_bound"]

"""The interval a valid epsilon of an accountant history lies in (docs/properties.md, "The accountant").

An accountant may report any epsilon that is a *valid* (epsilon, delta) guarantee of the history it
was told, computed by a standard method: the tightest accounting there is (PLD / PRV, numerically
exact up to their own error bounds), opacus' RDP with the improved conversion (Balle et al. 2020),
or RDP with the classic conversion (Mironov 2017: ``eps = rdp(alpha) + log(1/delta) / (alpha - 1)``,
10-20 % above the improved one). The gate therefore judges a reported epsilon against an interval:

* ``ceiling`` -- ``classic_epsilon``: the classic RDP conversion over opacus' default orders, the
  loosest standard valid method; an epsilon above it over-reports (the guarantee understated: a
  utility problem, not a privacy one);
* ``floor`` -- ``epsilon_floor``: a *sound lower bound* on the history's true epsilon at delta. The
  Poisson-subsampled Gaussian mechanism at (sigma, q) has a worst-case pair of neighbouring datasets
  (one sample whose clipped gradient is C along one coordinate, the others 0): its output at each
  step is N(0, sigma^2) without the sample and the mixture (1 - q) N(0, sigma^2) + q N(1, sigma^2)
  with it (in units of C). For any set S of outputs, a mechanism that is (eps, delta)-DP has
  ``P(S) <= e^eps Q(S) + delta``, so ``eps >= log((P(S) - delta) / Q(S))`` for every S. Two families
  of S whose probabilities have closed forms over a whole history are maximised over: the number
  of steps whose output exceeds a threshold c (binomial counts, the entries' convolved), and, for a
  history of one (sigma, q), the sum of the outputs exceeding t (a binomial mixture of normals).
  At one step the first is the Neyman-Pearson test (the likelihood ratio grows with the output), so
  the floor is that step's exact epsilon; over many steps it is below the exact one (measured
  against opacus' PRV: ``tests/properties/test_accountant_interval.py``). Any epsilon below the
  floor is not a valid guarantee of the history: it under-reports (a privacy violation in the
  accounting), whatever method computed it.

Python floats only (``math``), like ``accounting``: milliseconds per history.
"""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple

from .accounting import ORDERS, History, epsilon

#: relative margin the floor is lowered by, for the rounding of its sums (~1e-13 relative)
FLOOR_RTOL = 1e-9
#: thresholds of the count test: c = 0.5 + k sigma / 4 for k = 0..COUNT_THRESHOLDS - 1 (the largest
#: sigma of the history), up to 1 + 7.5 sigma past which N(0, sigma^2) has mass < 1e-13
COUNT_THRESHOLDS = 31
#: thresholds of the sum test, evenly from the mean under N(0) to 9 standard deviations past it
SUM_THRESHOLDS = 61


def classic_epsilon(history: History, delta: float, orders: Sequence[float] = ORDERS) -> float:
    """The (epsilon, ``delta``) of ``history`` by RDP with the classic conversion (Mironov 2017,
    proposition 3), minimised over ``orders``: the ceiling of the interval (module docstring).
    ``inf`` where an entry has no noise; 0 for an empty history."""
    return epsilon(history, delta, orders, classic=True)


def _log_sf(x: float) -> float:
    """``log P(N(0, 1) > x)``."""
    if x < 5:
        return math.log(0.5 * math.erfc(x / math.sqrt(2)))
    # Mills ratio series: relative error of the omitted term below 1e-8 at x >= 5
    x2 = x * x
    return -x2 / 2 - math.log(x) - 0.5 * math.log(2 * math.pi) + math.log1p(-1 / x2 + 3 / x2 ** 2 - 15 / x2 ** 3)


def _binomial(n: int, p: float) -> List[float]:
    """The probabilities of 0..n successes of n Bernoulli(p) draws."""
    if p <= 0:
        return [1.0] + [0.0] * n
    if p >= 1:
        return [0.0] * n + [1.0]
    lp, lq = math.log(p), math.log1p(-p)
    base = math.lgamma(n + 1)
    return [math.exp(base - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * lp + (n - k) * lq) for k in range(n + 1)]


def _convolve(a: List[float], b: List[float]) -> List[float]:
    out = [0.0] * (len(a) + len(b) - 1)
    for i, x in enumerate(a):
        if x:
            for j, y in enumerate(b):
                out[i + j] += x * y
    return out


def _tails(pmf: List[float]) -> List[float]:
    """``tails[m]`` = P(count >= m), summed from the top (the small terms first)."""
    out, acc = [0.0] * len(pmf), 0.0
    for m in range(len(pmf) - 1, -1, -1):
        acc += pmf[m]
        out[m] = acc
    return out


def _best(p_tails: Sequence[float], q_tails: Sequence[float], delta: float) -> float:
    """The largest ``log((P(S) - delta) / Q(S))`` over the sets given by their two probabilities."""
    best = 0.0
    for p, q in zip(p_tails, q_tails):
        if q > 1e-300 and p > delta:
            best = max(best, math.log((p - delta) / q))
    return best


def _count_floor(entries: Sequence[Tuple[float, float, int]], delta: float) -> float:
    """The count test's bound (module docstring): the steps whose output exceeds c."""
    best = 0.0
    top = max(s for s, _, _ in entries)
    for k in range(COUNT_THRESHOLDS):
        c = 0.5 + k * top / 4
        with_sample, without = [1.0], [1.0]
        for s, q, n in entries:
            r = math.exp(_log_sf(c / s))
            p = (1 - q) * r + q * math.exp(_log_sf((c - 1) / s))
            with_sample, without = _convolve(with_sample, _binomial(n, p)), _convolve(without, _binomial(n, r))
        best = max(best, _best(_tails(with_sample), _tails(without), delta))
    return best


def _sum_floor(sigma: float, q: float, steps: int, delta: float) -> float:
    """The sum test's bound for ``steps`` steps of one (sigma, q): the outputs' sum exceeding t."""
    weights = _binomial(steps, q)
    sd = sigma * math.sqrt(steps)
    p_tails, q_tails = [], []
    for i in range(SUM_THRESHOLDS):
        t = i * 9 * sd / (SUM_THRESHOLDS - 1)
        q_tails.append(math.exp(_log_sf(t / sd)))
        p_tails.append(sum(w * math.exp(_log_sf((t - k) / sd)) for k, w in enumerate(weights) if w > 1e-300))
    return _best(p_tails, q_tails, delta)


def epsilon_floor(history: History, delta: float) -> float:
    """A sound lower bound on the true (epsilon, ``delta``) of ``history`` (opacus' format): every
    valid accountant reports at least this (module docstring). ``inf`` where an entry has no noise;
    0 for an empty history."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    entries = [(float(s), float(q), int(n)) for s, q, n in history if int(n) > 0 and float(q) > 0]
    if not entries:
        return 0.0
    if any(s <= 0 for s, _, _ in entries):
        return math.inf
    best = _count_floor(entries, delta)
    if len({(s, q) for s, q, _ in entries}) == 1:
        s, q, _ = entries[0]
        best = max(best, _sum_floor(s, q, sum(n for _, _, n in entries), delta))
    return best * (1 - FLOOR_RTOL)


__all__ = ["classic_epsilon", "epsilon_floor", "FLOOR_RTOL"]

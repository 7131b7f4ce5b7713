"""The suite's own privacy accountant: Renyi DP of the Poisson-subsampled Gaussian mechanism.

What the gate compares a target's reported epsilon with (the noise property's accountant
check, docs/properties.md): an accountant that does not depend on the target, nor on opacus
being importable (a fork's CI may have neither opacus nor scipy). The computation is the one of
Mironov, Talwar and Zhang, "Renyi Differential Privacy of the Sampled Gaussian Mechanism"
(arXiv:1908.10530, section 3.3) -- the same one opacus' ``RDPAccountant`` and TF Privacy run --
with the RDP -> (epsilon, delta) conversion of Balle et al. 2020 (arXiv:1905.09982, theorem 21)
over opacus' default orders, so that on one history the two agree to rounding
(``tests/properties/test_accountant.py`` checks it against opacus' own). It sits with the targets as a
helper for adapters: a target without an accountant of its own can use it
(``fixtures.specimens:Correct`` does); ``properties/analysis/accountant.py`` computes the suite's epsilon
with it.

An accountant *history* is opacus' format: ``[(noise_multiplier, sample_rate, steps), ...]``,
one entry per run of steps with the same parameters; the RDP of a history is the sum over its
entries (composition). Python floats only (``math``): it runs on the gate process, well under a second per history.
"""

from __future__ import annotations

import functools
import math
from typing import List, Optional, Sequence, Tuple

#: opacus' ``RDPAccountant.DEFAULT_ALPHAS``: the orders the conversion to (epsilon, delta) minimises over
ORDERS: Tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))

History = Sequence[Tuple[float, float, int]]


def _log_add(a: float, b: float) -> float:
    lo, hi = min(a, b), max(a, b)
    if lo == -math.inf:
        return hi
    return math.log1p(math.exp(lo - hi)) + hi


def _log_sub(a: float, b: float) -> float:
    if a < b:
        raise ValueError("log-space subtraction with a negative result")
    if b == -math.inf:
        return a
    if a == b:
        return -math.inf
    try:
        return math.log(math.expm1(a - b)) + b
    except OverflowError:
        return a


def _log_erfc(x: float) -> float:
    """``log(erfc(x))``, accurate where ``erfc`` underflows (x > 25: its asymptotic series, whose
    first omitted term is below 1e-13 relative there)."""
    if x < 25:
        return math.log(math.erfc(x))
    x2 = x * x
    return -x2 - math.log(x) - 0.5 * math.log(math.pi) + math.log1p(-1 / (2 * x2) + 3 / (4 * x2 ** 2)
                                                                      - 15 / (8 * x2 ** 3))


def _log_binom(n: float, k: int) -> Tuple[float, float]:
    """``(log|binom(n, k)|, sign)`` for real ``n`` and integer ``k >= 0``."""
    sign = 1.0
    value = math.lgamma(n + 1) - math.lgamma(k + 1)
    rest = n - k + 1
    if rest <= 0 and float(rest).is_integer():
        return -math.inf, 0.0  # binom(n, k) = 0 for integer n < k
    value -= math.lgamma(rest)
    # Gamma is negative on (-1, 0), (-3, -2), ...: the sign of 1/Gamma(n - k + 1)
    if rest < 0 and math.floor(rest) % 2 == 1:
        sign = -1.0
    return value, sign


def _log_a_int(q: float, sigma: float, alpha: int) -> float:
    log_a = -math.inf
    for i in range(alpha + 1):
        coef = math.lgamma(alpha + 1) - math.lgamma(i + 1) - math.lgamma(alpha - i + 1)
        s = coef + i * math.log(q) + (alpha - i) * math.log(1 - q) + (i * i - i) / (2 * sigma ** 2)
        log_a = _log_add(log_a, s)
    return log_a


def _log_a_frac(q: float, sigma: float, alpha: float) -> float:
    log_a0, log_a1 = -math.inf, -math.inf
    z0 = sigma ** 2 * math.log(1 / q - 1) + 0.5
    i = 0
    while True:
        log_coef, sign = _log_binom(alpha, i)
        j = alpha - i
        log_t0 = log_coef + i * math.log(q) + j * math.log(1 - q)
        log_t1 = log_coef + j * math.log(q) + i * math.log(1 - q)
        log_e0 = math.log(0.5) + _log_erfc((i - z0) / (math.sqrt(2) * sigma))
        log_e1 = math.log(0.5) + _log_erfc((z0 - j) / (math.sqrt(2) * sigma))
        log_s0 = log_t0 + (i * i - i) / (2 * sigma ** 2) + log_e0
        log_s1 = log_t1 + (j * j - j) / (2 * sigma ** 2) + log_e1
        if sign > 0:
            log_a0, log_a1 = _log_add(log_a0, log_s0), _log_add(log_a1, log_s1)
        else:
            log_a0, log_a1 = _log_sub(log_a0, log_s0), _log_sub(log_a1, log_s1)
        i += 1
        if max(log_s0, log_s1) < -30:
            return _log_add(log_a0, log_a1)


@functools.lru_cache(maxsize=4096)
def rdp(q: float, sigma: float, order: float) -> float:
    """RDP at ``order`` of one step of the Gaussian mechanism (noise multiplier ``sigma``) on a
    Poisson subsample at rate ``q``; ``inf`` without noise."""
    if q == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    if q == 1.0:
        return order / (2 * sigma ** 2)
    log_a = _log_a_int(q, sigma, int(order)) if float(order).is_integer() else _log_a_frac(q, sigma, order)
    return log_a / (order - 1)


def epsilon(history: History, delta: float, orders: Sequence[float] = ORDERS, classic: bool = False) -> float:
    """The (epsilon, ``delta``)-DP guarantee of ``history`` (opacus' format, module docstring):
    RDP summed over the entries at each order, converted (Balle et al.; ``classic``: Mironov 2017,
    proposition 3, the looser conversion) and minimised over the orders. ``inf`` where an entry has
    no noise; 0 for an empty history."""
    if not history:
        return 0.0
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    best = math.inf
    for a in orders:
        total = sum(steps * rdp(q, sigma, a) for sigma, q, steps in history)
        if classic:
            eps = total + math.log(1 / delta) / (a - 1)
        else:
            eps = total - (math.log(delta) + math.log(a)) / (a - 1) + math.log((a - 1) / a)
        if eps < best:  # NaN never wins
            best = eps
    return best


#: the deltas a fork hard-codes (``delta_of``): opacus' examples' 1e-5 and every other power of ten
ROUND_DELTAS = tuple(10.0 ** -k for k in range(1, 13))


def delta_of(history: History, reported: float, asked: float, extra: Sequence[float] = (),
             rtol: float = 1e-6) -> Optional[float]:
    """The delta other than ``asked`` at which ``history``'s RDP epsilon is ``reported`` (relative
    ``rtol``), among the deltas a fork would hard-code or derive (``ROUND_DELTAS``, and ``extra``:
    e.g. 1/N of the run's dataset); ``None`` if none is. An epsilon that is the right history's at
    another delta is named for that (a hard-coded delta), not for a step count or a sigma that
    happen to give the same number."""
    if not (reported > 0 and math.isfinite(reported) and history):
        return None
    for d in (*ROUND_DELTAS, *extra):
        if 0 < d < 1 and abs(d - asked) > 1e-12 * asked and abs(epsilon(history, d) - reported) <= rtol * reported:
            return d
    return None


def steps_bracket(sigma: float, q: float, delta: float, reported: float, most: int) -> Optional[Tuple[int, int]]:
    """``(k, k + 1)``, 1 <= k < ``most``, whose RDP epsilons of k steps at (sigma, q) bracket
    ``reported``; ``None`` where it lies outside those of 1 and ``most`` steps. The epsilon grows
    with the steps, so a bisection finds them."""
    def eps(k: int) -> float:
        return epsilon([(sigma, q, k)], delta)

    lo, hi = 1, max(most, 2)
    if not eps(lo) <= reported <= eps(hi):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if eps(mid) <= reported:
            lo = mid
        else:
            hi = mid
    return lo, hi


def steps_of(history: History, reported: float, delta: float, rtol: float = 1e-6) -> Optional[int]:
    """The step count k other than ``history``'s at which the RDP epsilon of k steps of its one
    (sigma, q) is ``reported`` (relative ``rtol``), for k in 1 .. 4 x its steps + 64; ``None`` if none
    is, or the history mixes parameters. An epsilon that is exactly another number of steps of the
    right (sigma, q) is named for that count: the steps since a resume, one per physical pass, a cap."""
    pairs = {(float(s), float(q)) for s, q, n in history if n}
    if len(pairs) != 1 or not (reported > 0 and math.isfinite(reported)):
        return None
    (sigma, q), told = next(iter(pairs)), sum(int(n) for _, _, n in history)
    bracket = steps_bracket(sigma, q, delta, reported, 4 * told + 64)
    return next((k for k in bracket or () if k != told
                 and abs(epsilon([(sigma, q, k)], delta) - reported) <= rtol * reported), None)


def merge(history: List[Tuple[float, float, int]], sigma: float, q: float) -> None:
    """Append one step at ``(sigma, q)`` to ``history`` the way opacus' accountants do: the last
    entry's count grows when its parameters are the same, else a new entry starts."""
    if history and history[-1][0] == sigma and history[-1][1] == q:
        history[-1] = (sigma, q, history[-1][2] + 1)
    else:
        history.append((sigma, q, 1))


__all__ = ["ORDERS", "ROUND_DELTAS", "rdp", "epsilon", "delta_of", "steps_bracket", "steps_of", "merge", "History"]

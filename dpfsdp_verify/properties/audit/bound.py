"""The one-run privacy audit's statistics: from guesses about secret canaries to a lower bound on epsilon.

Steinke, Nasr and Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS 2023, arXiv
2305.08846), Algorithm 1 and its theorem 3.1 with the delta term. Setting: m canaries, each with a
secret S_i in {-1, +1} drawn uniformly and independently; those with S_i = +1 are in the training
data. An auditor reads the released output, scores each canary, guesses +1 for the ``k_plus``
highest scores and -1 for the ``k_minus`` lowest and abstains on the rest: r = k_plus + k_minus
guesses, v of them correct. If the training is (epsilon, delta)-DP with respect to each canary's
inclusion, then for every v

    P[correct >= v] <= p(epsilon) = min(1, beta + 2 m delta alpha),
    q_e   = e^epsilon / (1 + e^epsilon),
    beta  = P[Binomial(r, q_e) >= v],
    alpha = max over 1 <= j <= v of P[v - j <= Binomial(r, q_e) < v] / j.

p rises with epsilon. An epsilon with ``p(epsilon) < 1 - confidence`` is rejected: the training
cannot be that private and have produced so many correct guesses, except with probability below
``1 - confidence``. The lower bound is the largest rejected epsilon, found by bisection:
``eps_lb = sup {epsilon >= 0 : p(epsilon) < 1 - confidence}`` (0 when even epsilon = 0 is not
rejected). Copies of the bound that drop the ``2 m delta alpha`` term claim more than the theorem
gives; this module keeps it.

DP meaning: ``eps_lb`` is what the training *provably* leaked about its canaries, at the stated
confidence, whatever the implementation's bug is. A correct implementation's ``eps_lb`` exceeds
its true epsilon with probability at most ``1 - confidence``; an ``eps_lb`` above the epsilon
the accountant reports is a leak the accounting does not describe.

Choosing the guess counts (or the score) after looking at the scores would void the bound;
``audit`` takes fixed score functions' values and a fixed list of ``(k_plus, k_minus)`` choices
and splits the error probability among every pair (Bonferroni), so the best of them is still a
valid bound. Any score computed from the released output alone is valid (post-processing); a
score closer to the mechanism's likelihood ratio gives a tighter bound.

Pure Python (``math`` only): the gate's only dependency is torch (a fork's CI may have neither
numpy nor scipy). The binomial tails are sums of probabilities computed in log space
(``lgamma``), exact to rounding for any r a run makes; the tests check them against
``scipy.stats.binom`` and a brute-force grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple, cast

#: the theorem's usual confidence (the paper's); a property may ask for a stricter one
CONFIDENCE = 0.95
#: the largest epsilon the bisection searches (q_e is 1 - 2e-22 there: beyond any r a run makes)
EPS_MAX = 50.0


def _log_binom_pmf(k: int, r: int, log_p: float, log_1p: float) -> float:
    return math.lgamma(r + 1) - math.lgamma(k + 1) - math.lgamma(r - k + 1) + k * log_p + (r - k) * log_1p


def binomial_pmf(r: int, log_p: float, log_1p: float) -> List[float]:
    """``[P[Binomial(r, p) = k] for k in 0..r]`` given ``log p`` and ``log(1 - p)`` (so that p
    within rounding of 1 keeps its tail), each from its logarithm."""
    return [math.exp(_log_binom_pmf(k, r, log_p, log_1p)) for k in range(r + 1)]


def q_epsilon(eps: float) -> float:
    """``e^eps / (1 + e^eps)``: the best accuracy of one guess about an eps-DP bit."""
    return 1.0 / (1.0 + math.exp(-eps))


def _log_q_epsilon(eps: float) -> Tuple[float, float]:
    """``(log q_e, log(1 - q_e))`` without rounding q_e to 1 at large eps."""
    return -math.log1p(math.exp(-eps)), -eps - math.log1p(math.exp(-eps))


def p_value(eps: float, r: int, v: int, m: int, delta: float) -> float:
    """``p(eps) = min(1, beta + 2 m delta alpha)`` (module docstring): the largest probability that
    an (eps, delta)-DP training lets ``v`` or more of ``r`` guesses about ``m`` canaries be right."""
    _check(r, v, m, delta)
    if v == 0:
        return 1.0
    pmf = binomial_pmf(r, *_log_q_epsilon(eps))
    beta = math.fsum(pmf[v:])
    alpha, below = 0.0, 0.0
    for j in range(1, v + 1):  # below = P[v - j <= B < v]
        below += pmf[v - j]
        alpha = max(alpha, below / j)
    return min(1.0, beta + 2.0 * m * delta * alpha)


def epsilon_lower_bound(r: int, v: int, m: int, delta: float, confidence: float = CONFIDENCE,
                        tol: float = 1e-6) -> float:
    """``sup {eps >= 0 : p_value(eps) < 1 - confidence}`` by bisection to ``tol`` (the lower end
    of the final bracket, so the bound is never overstated); 0 when eps = 0 is not rejected."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    level = 1.0 - confidence
    if not p_value(0.0, r, v, m, delta) < level:
        return 0.0
    lo, hi = 0.0, EPS_MAX
    if p_value(hi, r, v, m, delta) < level:
        return hi
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if p_value(mid, r, v, m, delta) < level:
            lo = mid
        else:
            hi = mid
    return lo


def _check(r: int, v: int, m: int, delta: float) -> None:
    if not (isinstance(r, int) and isinstance(v, int) and 0 <= v <= r <= m):
        raise ValueError(f"need integers 0 <= v <= r <= m, got r={r!r} v={v!r} m={m!r}")
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"delta must be in [0, 1), got {delta!r}")


def count_correct(scores: Sequence[float], secrets: Sequence[int], k_plus: int, k_minus: int) -> Tuple[int, int]:
    """``(r, v)``: guess +1 for the ``k_plus`` highest scores, -1 for the ``k_minus`` lowest
    (ties broken by canary index, which says nothing about the secrets), count the right ones.
    A NaN score ranks lowest (it can only make guesses worse, never the bound larger)."""
    m = len(scores)
    if len(secrets) != m or any(s not in (-1, 1) for s in secrets):
        raise ValueError("secrets must be one -1/+1 per score")
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > m:
        raise ValueError(f"need k_plus, k_minus >= 0 and k_plus + k_minus <= m = {m}, got {k_plus}, {k_minus}")
    key = [(s if s == s else -math.inf) for s in scores]  # NaN -> -inf
    order = sorted(range(m), key=lambda i: (key[i], i))
    lowest, highest = order[:k_minus], order[m - k_plus:] if k_plus else []
    v = int(sum(secrets[i] == 1 for i in highest) + sum(secrets[i] == -1 for i in lowest))
    return k_plus + k_minus, v


@dataclass(frozen=True)
class AuditResult:
    """The best of an audit's guess choices: its lower bound and how it was reached."""

    eps_lb: float
    #: the name of the score whose guesses gave the bound
    score: str
    k_plus: int
    k_minus: int
    r: int
    v: int
    m: int
    delta: float
    confidence: float
    #: how many (score, guess choice) pairs shared the error probability (Bonferroni)
    choices: int
    #: ``(score, k_plus, k_minus, r, v, eps_lb at the shared level)`` of every pair
    table: Tuple[Tuple[str, int, int, int, int, float], ...] = ()


def audit(scores: Mapping[str, Sequence[float]], secrets: Sequence[int], choices: Sequence[Tuple[int, int]],
          delta: float, confidence: float = CONFIDENCE, m: Optional[int] = None) -> AuditResult:
    """The one-run audit of each score vector in ``scores`` (``{name: one score per canary}``)
    against ``secrets``, for each ``(k_plus, k_minus)`` in ``choices`` -- scores and choices fixed
    before any score was seen -- each pair at confidence ``1 - (1 - confidence) / pairs``: the
    best bound is then a bound at ``confidence``. ``m``: the canaries the training had (default:
    the length of the score vectors)."""
    if not choices or not scores:
        raise ValueError("need at least one score vector and one (k_plus, k_minus) choice")
    m = len(next(iter(scores.values()))) if m is None else m
    pairs = len(scores) * len(choices)
    shared = 1.0 - (1.0 - confidence) / pairs
    table, best = [], None
    for name, values in scores.items():
        for k_plus, k_minus in choices:
            r, v = count_correct(values, secrets, k_plus, k_minus)
            eps = epsilon_lower_bound(r, v, m, delta, shared)
            table.append((name, k_plus, k_minus, r, v, eps))
            if best is None or eps > best[5]:
                best = table[-1]
    name, k_plus, k_minus, r, v, eps = cast(Tuple[str, int, int, int, int, float], best)  # choices: not empty
    return AuditResult(eps, name, k_plus, k_minus, r, v, m, delta, confidence, pairs, tuple(table))


def guess_choices(m: int, fractions: Sequence[float], most: Optional[int] = None) -> List[Tuple[int, int]]:
    """``(k, k)`` for ``k = max(1, round(f * m / 2))`` per fraction ``f`` of the canaries guessed
    (half on each side), capped at ``most // 2`` when given (the bound's cost grows with the
    guesses, its value does not past a few hundred), duplicates dropped, in order."""
    out: List[Tuple[int, int]] = []
    cap = m // 2 if most is None else max(1, min(m // 2, most // 2))
    for f in fractions:
        k = max(1, min(cap, int(round(f * m / 2))))
        if (k, k) not in out:
            out.append((k, k))
    return out


def max_bound(r: int, m: int, delta: float, confidence: float = CONFIDENCE) -> float:
    """The bound of ``r`` guesses all right: the most an audit with ``r`` guesses can show."""
    return epsilon_lower_bound(r, r, m, delta, confidence)


__all__ = ["CONFIDENCE", "binomial_pmf", "q_epsilon", "p_value", "epsilon_lower_bound", "count_correct",
           "AuditResult", "audit", "guess_choices", "max_bound"]

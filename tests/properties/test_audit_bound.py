"""The one-run audit's bound (``dpfsdp_verify.properties.audit.bound``) against an independent
computation: scipy's binomial distribution, the formula of Steinke, Nasr and Jagielski (arXiv
2305.08846, Algorithm 1 with the 2 m delta alpha term) written out here, a brute-force grid for the
supremum, and a Monte Carlo check that the bound holds at its confidence on the worst-case
eps-DP guesser."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from dpfsdp_verify.properties.audit import bound as ab

binom = pytest.importorskip("scipy.stats").binom


def p_scipy(eps, r, v, m, delta):
    """The issue's formula, written independently with scipy's CDF / survival function."""
    q = math.exp(eps) / (1 + math.exp(eps))
    if v == 0:
        return 1.0
    beta = binom.sf(v - 1, r, q)
    j = np.arange(1, v + 1)
    alpha = float(np.max((binom.cdf(v - 1, r, q) - binom.cdf(v - j - 1, r, q)) / j))
    return min(1.0, beta + 2 * m * delta * alpha)


def sup_grid(r, v, m, delta, level=0.05, top=8.0):
    """Brute force: the largest epsilon on a grid of step 1e-3 whose scipy p-value is below
    ``level``: a scan at 1e-2 (p must rise with epsilon: the bisection's premise, checked), then at
    1e-3 across the crossing."""
    coarse = np.arange(0.0, top, 1e-2)
    ps = np.array([p_scipy(e, r, v, m, delta) for e in coarse])
    assert np.all(np.diff(ps) >= -1e-12)
    below = np.nonzero(ps < level)[0]
    if not len(below):
        return 0.0
    start = coarse[below[-1]]
    fine = [e for e in np.arange(start, start + 1e-2 + 1e-9, 1e-3) if p_scipy(e, r, v, m, delta) < level]
    return float(fine[-1])


CASES = [(100, 80, 1000, 1e-5), (200, 141, 1000, 1e-5), (400, 273, 1000, 1e-5), (50, 50, 500, 1e-5),
         (1000, 700, 5000, 1e-5), (80, 73, 200, 1e-5), (100, 80, 100_000, 1e-5), (100, 90, 1000, 0.0)]


@pytest.mark.parametrize("r, v, m, delta", CASES)
def test_p_value_is_the_papers_formula(r, v, m, delta):
    for eps in (0.0, 0.3, 1.0, 2.0, 4.0):
        assert ab.p_value(eps, r, v, m, delta) == pytest.approx(p_scipy(eps, r, v, m, delta), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("r, v, m, delta", CASES[:5])
def test_bisection_finds_the_supremum_of_the_rejected_epsilons(r, v, m, delta):
    got = ab.epsilon_lower_bound(r, v, m, delta, confidence=0.95)
    want = sup_grid(r, v, m, delta)
    assert want <= got < want + 1e-3 + 1e-6  # the grid's largest rejected point, and below the next one
    assert ab.p_value(got, r, v, m, delta) < 0.05 <= ab.p_value(got + 1e-5, r, v, m, delta)


def test_the_delta_term_is_kept_and_can_decide():
    """100 of 100 right with m = 100,000 canaries: 2 m delta = 2, so the delta term dominates; a
    copy without it (delta = 0) claims far more."""
    with_delta = ab.epsilon_lower_bound(100, 100, 100_000, 1e-5)
    without = ab.epsilon_lower_bound(100, 100, 100_000, 0.0)
    assert without == pytest.approx(sup_grid(100, 100, 100_000, 0.0), abs=2e-3)
    assert with_delta == pytest.approx(sup_grid(100, 100, 100_000, 1e-5), abs=2e-3)
    assert with_delta < without - 0.5


def test_many_guesses_all_right_give_a_large_bound_and_half_right_nothing():
    bounds = [ab.max_bound(r, 10_000, 1e-5) for r in (10, 100, 1000, 5000)]
    assert bounds == sorted(bounds) and bounds[0] < 2.0 and bounds[-1] > 6.0
    assert ab.epsilon_lower_bound(1000, 500, 10_000, 1e-5) == 0.0
    assert ab.epsilon_lower_bound(1000, 530, 10_000, 1e-5) < 0.05  # chance level: ~0
    assert ab.epsilon_lower_bound(100, 0, 1000, 1e-5) == 0.0


def test_count_correct_guesses_top_and_bottom_ties_by_index_nan_lowest():
    scores = [0.5, 3.0, float("nan"), 2.0, -1.0, 2.0]
    secrets = [1, 1, -1, -1, -1, 1]
    # top 2: index 1 (3.0) and the later of the tied 2.0s (index 5); bottom 2: NaN (2) then -1.0 (4)
    assert ab.count_correct(scores, secrets, 2, 2) == (4, 4)
    assert ab.count_correct(scores, secrets, 3, 0) == (3, 2)  # + index 3 (out)
    with pytest.raises(ValueError):
        ab.count_correct(scores, secrets, 4, 3)
    with pytest.raises(ValueError):
        ab.count_correct(scores, [1, 0, 1, 1, 1, 1], 1, 1)


def test_audit_shares_the_confidence_among_every_score_and_choice():
    rng = random.Random(3)
    secrets = [rng.choice((-1, 1)) for _ in range(1000)]
    good = [s * 2.0 + rng.gauss(0, 1) for s in secrets]
    noise = [rng.gauss(0, 1) for _ in secrets]
    choices = ab.guess_choices(1000, (0.02, 0.1, 0.4))
    assert choices == [(10, 10), (50, 50), (200, 200)]
    # capped at ``most`` guesses (fixed by m alone): duplicates dropped
    assert ab.guess_choices(10_000, (0.02, 0.05, 0.1, 0.2, 0.4), 1000) == [(100, 100), (250, 250), (500, 500)]
    res = ab.audit({"good": good, "noise": noise}, secrets, choices, 1e-5, 0.95)
    assert res.choices == 6 and res.score == "good" and len(res.table) == 6
    level = 1 - 0.05 / 6
    for _name, _kp, _km, r, v, eps in res.table:
        assert eps == ab.epsilon_lower_bound(r, v, 1000, 1e-5, level)
    assert res.eps_lb == max(row[5] for row in res.table)
    alone = ab.audit({"good": good}, secrets, choices, 1e-5, 0.95)
    assert alone.eps_lb >= res.eps_lb  # one score alone: a larger share of the confidence each


def test_the_bound_holds_at_its_confidence_on_the_worst_case_guesser():
    """Randomised response at epsilon 1 (each guess right with probability e/(1+e) exactly, the
    most any 1-DP mechanism allows): the bound exceeds 1 in at most ~5% of runs."""
    rng = random.Random(34)
    q = math.e / (1 + math.e)
    runs, over = 300, 0
    for _ in range(runs):
        v = sum(rng.random() < q for _ in range(200))
        over += ab.epsilon_lower_bound(200, v, 1000, 1e-5, 0.95) > 1.0
    # binomial(300, 0.05): mean 15, P[> 27] < 0.002
    assert over <= 27, over


def test_bad_inputs_are_refused():
    for args in ((10, 11, 100, 1e-5), (10, 5, 9, 1e-5), (10, 5, 100, 1.0)):
        with pytest.raises(ValueError):
            ab.p_value(1.0, *args)
    with pytest.raises(ValueError):
        ab.epsilon_lower_bound(10, 5, 100, 1e-5, confidence=1.0)

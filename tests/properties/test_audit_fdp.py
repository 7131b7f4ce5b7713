"""The one-run audit's f-DP bound (``dpfsdp_verify.properties.audit.fdp``, Mahloujifar,
Melis and Chaudhuri, arXiv 2410.22235) against an independent computation: the published recursion
written out here with scipy as the reference code writes it (full arrays, no early stop, a grid
over the Gaussian noise scale 1/mu), mu-GDP's epsilon against published values, and a Monte Carlo
check that the bound holds at its confidence on a mechanism that is exactly mu-GDP."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dpfsdp_verify.properties.audit import bound as ab
from dpfsdp_verify.properties.audit import fdp as af

norm = pytest.importorskip("scipy.stats").norm
from scipy.special import ndtr, ndtri  # noqa: E402  (scipy's Phi and Phi^-1 on scalars, fast)


def oracle_rejects(mu, r, v, m, tau):
    """The paper's ``audit_rh_with_cap`` as its reference implementation (PrivacyGuard's
    ``FDPAnalysisNode``, k = 2) computes it: arrays over i = v..0, no early stop."""
    a, b = np.zeros(v + 1), np.zeros(v + 1)
    a[v], b[v] = tau * v / m, tau * (r - v) / m
    for i in range(v - 1, -1, -1):
        b[i] = max(b[i + 1], float(ndtr(ndtri(min(a[i + 1], 1.0)) - mu)))
        a[i] = a[i + 1] + i / (r - i) * (b[i] - b[i + 1])
    return not a[0] + b[0] <= r / m


def oracle_mu(r, v, m, tau):
    """The reference's search: noise scales 1/mu on a grid of step 0.01 from 0.001 upward, the first
    one rejected (the largest rejected mu on the grid; rejection is monotone in the noise, so the
    grid is bisected rather than scanned)."""
    grid = 0.001 + 0.01 * np.arange(1000)
    if not oracle_rejects(1 / grid[-1], r, v, m, tau):
        return 0.0
    lo, hi = -1, len(grid) - 1  # grid[hi] rejected; grid[lo] not (or before the grid)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if oracle_rejects(1 / grid[mid], r, v, m, tau):
            hi = mid
        else:
            lo = mid
    return 1 / grid[hi]


# (r, v, m, tau): one-sided and two-sided guess counts at audit sizes, near chance and near all right
CASES = [(100, 80, 1000, 0.05), (200, 141, 1000, 0.05), (500, 393, 5000, 0.0125), (1000, 735, 10000, 0.04),
         (50, 50, 1000, 0.05), (100, 60, 1000, 0.05), (24, 23, 5000, 0.005)]


@pytest.mark.parametrize("r, v, m, tau", CASES)
def test_rejection_is_the_published_recursion(r, v, m, tau):
    for mu in (0.05, 0.2, 0.5, 1.0, 2.0, 4.0):
        assert af.rejects(af.gdp_inverse_blow_up(mu), r, v, m, tau) == oracle_rejects(mu, r, v, m, tau), mu


@pytest.mark.parametrize("r, v, m, tau", CASES)
def test_mu_bound_is_the_largest_rejected_mu(r, v, m, tau):
    got = af.mu_lower_bound(r, v, m, tau)
    grid = oracle_mu(r, v, m, tau)
    # the reference's grid is in noise = 1/mu: its answer is the first grid point at or below ours
    assert grid <= got + 1e-4
    assert got < 1 / (1 / grid - 0.01) + 1e-4 if grid > 0 else got < 0.1
    if got > 0:
        assert af.rejects(af.gdp_inverse_blow_up(got), r, v, m, tau)
        assert not af.rejects(af.gdp_inverse_blow_up(got + 2 * af.MU_TOL), r, v, m, tau)


def test_fixed_inputs_give_the_recorded_bounds():
    """Values of the published recursion recorded from ``oracle_rejects`` bisected in mu to 1e-12 and
    converted with scipy's brentq (2026-11-28), so a change to the module's arithmetic shows up as
    a number."""
    assert af.mu_lower_bound(100, 80, 1000, 0.05) == pytest.approx(0.364326, abs=2e-5)
    assert af.mu_lower_bound(1000, 735, 10000, 0.04) == pytest.approx(0.314348, abs=2e-5)
    assert af.mu_lower_bound(100, 90, 1000, 0.05) == pytest.approx(0.602504, abs=2e-5)
    assert af.epsilon_lower_bound(100, 80, 1000, 1e-5, 0.05) == pytest.approx(1.402215, abs=1e-4)
    assert af.epsilon_lower_bound(100, 90, 1000, 1e-5, 0.05) == pytest.approx(2.456405, abs=1e-4)
    assert af.mu_lower_bound(100, 50, 1000, 0.05) == 0.0  # chance level rejects nothing


@pytest.mark.parametrize("mu, eps", [(0.5, 1.9931), (1.0, 4.3772), (2.0, 9.9973)])
def test_gdp_epsilon_matches_published_values(mu, eps):
    """mu-GDP's epsilon at delta 1e-5 (Dong, Roth and Su, corollary 2.13), as tabulated by the
    one-run audit comparison of Xiang et al. (zihangxiang/tight-privacy-audit-in-one-run,
    compare/RESULTS.txt: 'true eps')."""
    assert af.gdp_epsilon(mu, 1e-5) == pytest.approx(eps, abs=1e-4)
    assert af.gdp_delta(mu, af.gdp_epsilon(mu, 1e-5)) == pytest.approx(1e-5, rel=1e-4)
    for e in (0.5, 2.0, 6.0):
        want = norm.cdf(-e / mu + mu / 2) - np.exp(e) * norm.cdf(-e / mu - mu / 2)
        assert af.gdp_delta(mu, e) == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_the_fdp_bound_is_tighter_than_the_counting_bound_on_the_same_guesses():
    """The point of the module: the same r, v prove more (Gaussian mu = 1, 1000 canaries, 100
    guesses, 10 wrong: the counting bound's 1.6265 as recorded in the comparison above)."""
    counting = ab.epsilon_lower_bound(100, 90, 1000, 1e-5, 0.95)
    assert counting == pytest.approx(1.6265, abs=2e-3)
    fdp = af.epsilon_lower_bound(100, 90, 1000, 1e-5, 0.05)
    assert fdp > 1.4 * counting


def test_the_bound_holds_at_its_confidence_on_an_exactly_gdp_mechanism():
    """Each canary's score is N(mu, 1) if it is in and N(0, 1) if out: the mechanism is exactly
    mu-GDP (and its scores are its likelihood ratio, the strongest attack). Guessing the top and
    bottom 5%, the bound exceeds mu in at most ~5% of 300 runs."""
    rng = random.Random(47)
    mu, m, runs, over = 1.0, 1000, 300, 0
    for _ in range(runs):
        secrets = [rng.choice((-1, 1)) for _ in range(m)]
        scores = [rng.gauss(mu if s > 0 else 0.0, 1.0) for s in secrets]
        r, v = ab.count_correct(scores, secrets, 25, 25)
        over += af.mu_lower_bound(r, v, m, 0.05) > mu
    # binomial(300, 0.05): mean 15, P[> 27] < 0.002
    assert over <= 27, over


def test_bad_inputs_are_refused():
    g = af.gdp_inverse_blow_up(1.0)
    for r, v, m in ((10, 11, 100), (10, 5, 9), (10, 5, 0)):
        with pytest.raises(ValueError):
            af.rejects(g, r, v, m, 0.05)
    with pytest.raises(ValueError):
        af.rejects(g, 10, 5, 100, 1.0)
    with pytest.raises(ValueError):
        af.gdp_inverse_blow_up(-1.0)
    with pytest.raises(ValueError):
        af.gdp_epsilon(1.0, 0.0)

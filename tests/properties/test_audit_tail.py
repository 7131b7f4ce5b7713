"""The one-run audit's tail bound (``dpfsdp_verify.properties.audit.tail``, Xiang et al., arXiv
2509.08704) against independent computations: the published comparison table of the paper's code
(epsilon at delta 1e-5, 95%, on the Gaussian channel), the mistake distribution by simulation of
the channel itself, its confidence on an exactly mu-GDP mechanism, and the recursion it improves on."""

from __future__ import annotations

import math

import pytest
import torch

from dpfsdp_verify.properties.audit import fdp as af
from dpfsdp_verify.properties.audit import tail as at

binom = pytest.importorskip("scipy.stats").binom


#: (mu of the channel the row was made on, n canaries, r guesses, u mistakes, the table's epsilon lower
#: bound at delta 1e-5 and 95% confidence): rows of "Compare this library's lower bound with Steinke et
#: al.'s" in the authors' repository (tight-privacy-audit-in-one-run, compare/RESULTS.txt, the "ours"
#: column), where u is the number of mistakes the channel makes on average
PUBLISHED = [
    (1.0, 1000, 100, 10, 3.1645),
    (0.5, 1000, 100, 26, 1.1926),
    (0.5, 1000, 250, 75, 1.4203),
    (1.0, 1000, 500, 103, 3.7557),
    (2.0, 1000, 1000, 159, 9.0038),
    (1.0, 10000, 1000, 97, 4.0141),
    (0.5, 10000, 5000, 1721, 1.8279),
    (1.0, 100000, 10000, 967, 4.2662),
]


@pytest.mark.parametrize("mu, n, r, u, published", PUBLISHED)
def test_the_bound_reproduces_the_published_table(mu, n, r, u, published):
    got = af.gdp_epsilon(at.mu_lower_bound(r, r - u, n, 0.05), 1e-5)
    assert got == pytest.approx(published, abs=2e-4)
    assert got <= af.gdp_epsilon(mu, 1e-5)  # below the channel's own epsilon, as every row of the table


@pytest.mark.parametrize("n, r, mu", [(1000, 100, 1.0), (2000, 400, 0.5), (400, 40, 2.0), (50, 50, 1.0)])
def test_the_probability_is_the_channels_own_by_simulation(n, r, mu):
    """P[mistakes <= u] against 4000 draws of the channel: n canaries with uniform secrets, N(0, 1) out,
    N(mu, 1) in, the r of largest |z| guessed by the sign of z (z = x - mu/2), mistakes counted."""
    g = torch.Generator().manual_seed(n + r)
    runs = 4000
    secrets = torch.rand(runs, n, generator=g) < 0.5
    z = torch.randn(runs, n, generator=g, dtype=torch.float64) + torch.where(secrets, mu / 2, -mu / 2)
    top = z.abs().topk(r, dim=1).indices
    wrong = ((z.gather(1, top) > 0) != secrets.gather(1, top)).sum(1)
    for u in sorted({int(wrong.double().quantile(p)) for p in (0.05, 0.3, 0.7)}):
        sim = float((wrong <= u).double().mean())
        got = at.probability(r, u, n, mu)
        assert abs(got - sim) < 4 * math.sqrt(sim * (1 - sim) / runs) + 2e-3, (u, got, sim)


def test_the_beta_part_integrates_to_one():
    for r, n, mu in ((100, 1000, 1.0), (1000, 2000, 0.5), (20, 2000, 0.5), (400, 1000, 3.0)):
        assert at.beta_mass(r, n, mu) == pytest.approx(1.0, abs=1e-6)


def test_at_mu_zero_every_guess_is_a_coin_and_all_guesses_is_a_binomial():
    assert at.probability(100, 40, 1000, 0.0) == pytest.approx(float(binom.cdf(40, 100, 0.5)), rel=1e-6)
    assert at.probability(300, 120, 300, 1.0) == pytest.approx(
        float(binom.cdf(120, 300, 1 - 0.5 * (1 + math.erf(0.5 / math.sqrt(2))))), rel=1e-9)


def test_more_mu_more_probability_and_the_bound_is_the_largest_rejected_mu():
    ps = [at.probability(200, 30, 2000, mu) for mu in (0.0, 0.5, 1.0, 1.5)]
    assert ps == sorted(ps) and ps[0] < 1e-20 < ps[-1]
    mu = at.mu_lower_bound(200, 170, 2000, 0.01)
    assert at.rejects(200, 170, 2000, mu, 0.01) and not at.rejects(200, 170, 2000, mu + 2 * at.MU_TOL, 0.01)
    assert at.mu_lower_bound(200, 100, 2000, 0.05) == 0.0  # half right: not even mu = 0 is rejected


def test_the_tail_bound_proves_more_than_the_recursion_from_the_same_guesses():
    for r, v, n in ((100, 90, 1000), (400, 300, 2000), (200, 160, 1000)):
        assert at.mu_lower_bound(r, v, n, 0.05) > af.mu_lower_bound(r, v, n, 0.05) > 0


def test_the_bound_holds_at_its_confidence_on_an_exactly_gdp_mechanism():
    """4000 audits of the 1-GDP channel (200 canaries, the top 40 by |z| guessed), the bound at 95%:
    it exceeds mu = 1 -- the audit rejects 1-GDP, i.e. reaches the fewest right guesses ``v_star``
    that do -- in at most 5% of them, up to three standard errors."""
    v_star = next(v for v in range(41) if at.rejects(40, v, 200, 1.0, 0.05))
    assert at.mu_lower_bound(40, v_star, 200, 0.05) >= 1.0 - at.MU_TOL > at.mu_lower_bound(40, v_star - 1, 200, 0.05)
    g = torch.Generator().manual_seed(11)
    runs = 4000
    secrets = torch.rand(runs, 200, generator=g) < 0.5
    z = torch.randn(runs, 200, generator=g, dtype=torch.float64) + torch.where(secrets, 0.5, -0.5)
    top = z.abs().topk(40, dim=1).indices
    right = ((z.gather(1, top) > 0) == secrets.gather(1, top)).sum(1)
    rate = float((right >= v_star).double().mean())
    assert rate <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / runs)
    assert rate > 0.01  # the bound is near its level on the channel it is exact for, not vacuous


@pytest.mark.parametrize("args", [(5, 6, 10, 1.0), (11, 1, 10, 1.0), (5, 1, 10, -1.0), (1.5, 1, 10, 1.0)])
def test_bad_inputs_are_refused(args):
    with pytest.raises(ValueError):
        at.probability(*args)

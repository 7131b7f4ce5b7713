"""``sampling_accounting``'s tests of independence across steps (membership at every lag, batch
sizes at every lag, a short-lag portmanteau) on samplers whose steps depend on earlier steps
(``fixtures/sampling_lag_specimens.py``), on ``Correct``, and the statistics themselves on
synthetic inclusion matrices (no ranks)."""

from __future__ import annotations

import pytest
import torch

from dpfsdp_verify.properties.sampling.check import across_steps
from dpfsdp_verify.properties.analysis.stats import lag_autocovariance_z, skewed_normal_two_sided_p
import dpfsdp_verify.properties as props  # noqa: E402
from tests.verdict_helpers import assert_all_pass, by

L = "fixtures.sampling_lag_specimens:"
#: the default gate's cases of the property: world sizes 1 and 2, every seeding policy, both datasets
DEFAULT_CASES = 3 + 6 + 1
#: the cases the lag specimens' power was measured on (docs/sampling.md): q = 1/8 and 1/9, not the
#: one fractional q = 0.3 (a rate check; tests/properties/test_batch_shapes.py)
MEASURED_CASES = 3 + 6
MEMBERSHIP = {"membership_lags", "membership_portmanteau"}
BATCH_SIZE = {"batch_size_dispersion", "batch_size_lags", "ranks_0_1_correlation"}


def sa(pool, target, **kw):
    kw.setdefault("timeout", 60)
    return props.run("sampling_accounting", target, pool=pool, world_sizes=(1, 2), **kw)


def measured(vs):
    return [v for v in vs if v.config["dataset"] != "fractional_rate"]


def failed_tests(v):
    level = v.evidence["per_test_level"]
    return {name for name, p in v.evidence["p_values"].items() if not p >= level}


def test_mask_reused_two_steps_back_fails_every_default_case(pool):
    vs = measured(sa(pool, L + "MaskReusedTwoStepsBack"))
    assert len(vs) == MEASURED_CASES
    for v in vs:
        assert (v.status, v.diagnosis) == ("fail", "correlated_sampling"), (v.config, v.message)
        assert v.evidence["across_steps"]["lag"] == 2, v.message
        assert "a sample in step t is in step t+2 with probability" in v.message
        assert "Amplification by subsampling" in v.message
        # reuse with probability 0.3: P(in t+2 | in t) = 0.3 + 0.7 q, about 0.38 at q = 1/8
        q = v.evidence["q"]
        assert abs(v.evidence["across_steps"]["conditional_rate"] - (0.3 + 0.7 * q)) < 0.05, v.message
        assert MEMBERSHIP <= failed_tests(v)


def test_sticky_membership_fails_on_membership_alone(pool):
    vs = measured(sa(pool, L + "StickyMembership"))
    assert len(vs) == MEASURED_CASES
    for v in vs:
        assert (v.status, v.diagnosis) == ("fail", "correlated_sampling"), (v.config, v.message)
        assert v.evidence["across_steps"]["lag"] == 1 and "a sample in step t is in step t+1" in v.message
        assert 0.25 < v.evidence["across_steps"]["conditional_rate"] < 0.4, v.message
        # batch sizes stay Binomial(n, q), independent across steps: only the membership tests see it
        # (per_sample_rate may fail too, rarely: persistence also spreads the per-sample counts)
        failed = failed_tests(v)
        assert MEMBERSHIP <= failed and not failed & BATCH_SIZE, (v.config, v.evidence["p_values"])


def test_batch_size_echoed_three_steps_later_fails_on_the_batch_size_lags(pool):
    vs = measured(sa(pool, L + "BatchSizeFromThreeStepsBack"))
    assert len(vs) == MEASURED_CASES
    for v in vs:
        assert (v.status, v.diagnosis) == ("fail", "correlated_sampling"), (v.config, v.message)
        assert "batch_size_lags" in failed_tests(v) and v.evidence["across_steps"]["batch_lag"] == 3, v.message
        assert "the batch sizes of steps 3 apart are correlated" in v.message


def test_correct_passes_with_the_lag_tests_run(pool):
    vs = sa(pool, "fixtures.specimens:Correct")
    assert len(vs) == DEFAULT_CASES
    assert_all_pass(vs)
    for v in vs:
        assert MEMBERSHIP | {"batch_size_lags"} <= set(v.evidence["p_values"])
        assert v.evidence["across_steps"]["lags"] == v.evidence["steps"] // 2
    assert v.evidence["tests"] == 7 and by(vs, world_size=2)


# -- the statistics on synthetic inclusion matrices ---------------------------------------------
def bernoulli(t, n, q, seed):
    return (torch.rand(t, n, generator=torch.Generator().manual_seed(seed)) < q).double()


def test_lag_statistic_is_standard_normal_on_independent_steps():
    z, skew = lag_autocovariance_z(bernoulli(2000, 8, 1 / 8, 0), 1000)
    assert z.shape == skew.shape == (1000,)
    assert abs(float(z.mean())) < 0.1 and 0.85 < float(z.var()) < 1.15
    # the skew of a sum of products of centred Bernoulli(1/8): ((1-2q)^2 / (q(1-q))) / sqrt(N (T-L))
    assert abs(float(skew[0]) - 5.14 / (8 * 1999) ** 0.5) < 0.01


def test_reuse_at_a_long_lag_is_found_at_that_lag():
    x = bernoulli(2000, 8, 1 / 8, 1)
    g = torch.Generator().manual_seed(2)
    for k in range(700, 2000):  # each step reuses the mask of 700 steps back with probability 0.3
        if float(torch.rand(1, generator=g)) < 0.3:
            x[k] = x[k - 700]
    s = across_steps(x, x.sum(1))
    assert s["lag"] == 700 and s["membership_lags"] < 1e-12, s
    assert s["membership_portmanteau"] > 1e-3  # lag 700 is outside the portmanteau's 32 lags
    clean = across_steps(bernoulli(2000, 8, 1 / 8, 1), bernoulli(2000, 8, 1 / 8, 1).sum(1))
    assert clean["membership_lags"] > 1e-3


def test_skew_correction_lengthens_the_long_tail_and_stays_monotone():
    z = torch.tensor([-6.0, 6.0, 20.0, 60.0, 200.0, float("nan")])
    p = skewed_normal_two_sided_p(z, torch.tensor(0.04))
    plain = skewed_normal_two_sided_p(z, torch.tensor(0.0))
    assert p[1] > plain[1] > p[0] > 0  # right-skewed: the upper tail is longer
    assert p[1] < 1e-7 and bool((p[2:5].diff() <= 0).all()) and p[4] == 0 and p[5] == 0
    assert float(plain[1]) == pytest.approx(2 * 9.865876450377e-10, rel=1e-6)

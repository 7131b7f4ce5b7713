"""Noise structure across tensors, steps and within a matrix (``fixtures/noise_structure_specimens.py``):
each tensor's noise exactly Gaussian with the right std, yet negated on another tensor of the same
shape, mixed into it, negated at the next step, or of rank 1 or 2. ``noise_calibration`` names each
as dependent noise (``properties/noise/stats.py``; the sign-blind repeat check); ``Correct`` passes.
Plus the statistics' false-alarm bounds on i.i.d. Gaussian noise."""

import math

import pytest
import torch

import dpfsdp_verify.properties as props  # noqa: E402
from dpfsdp_verify.properties.noise import stats as noise_stats
from tests.verdict_helpers import assert_all_pass, without_extra_noise_cases

N = "fixtures.noise_structure_specimens:"


def run(pool, target, **kw):
    kw.setdefault("world_sizes", (1,))
    return props.run(without_extra_noise_cases(), target, pool=pool, timeout=120, seed=kw.pop("seed", 5),
                     reductions=("sum",), samplings=("fixed",), **kw)


def fails(vs, *words):
    assert vs and [(v.status, v.diagnosis) for v in vs] == [("fail", "dependent_noise")] * len(vs), \
        [(v.status, v.diagnosis, v.message) for v in vs]
    for v in vs:
        for w in words:
            assert w in v.message, v.message


def test_correct_passes_with_the_structure_statistics(pool):
    vs = run(pool, "fixtures.specimens:Correct", world_sizes=(1, 2))
    assert_all_pass(vs)
    for v in vs:  # the mlp has three 64-vectors (3 pairs) and two weight matrices: both tests ran
        assert 0.0 < v.evidence["tensor_pair_p"] <= 1.0 and len(v.evidence["tensor_pair"]) == 2


@pytest.mark.parametrize("target, words", [
    ("NegatedNoiseAcrossTensors", ("get the same noise values, one negated,", "a sign flip cancels")),
    ("MixedNoiseAcrossTensors", ("(same shape) is dependent", "a linear dependence")),
    ("NegatedNoiseNextStep", ("is negated at steps 0 and 1 (lag 1",)),
    ("RankOneNoise", ("'fc1.weight' is low-rank", "top singular value")),
    ("RankTwoGaussianNoise", ("is low-rank", "top singular value")),
])
def test_structured_noise_is_dependent_noise(pool, target, words):
    fails(run(pool, N + target, world_sizes=(2,)), "PRIVACY VIOLATION", *words)


def test_low_rank_bound_holds_on_gaussian_noise_and_not_on_rank_one():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(400, 64, 32, generator=g, dtype=torch.float64)
    assert noise_stats.low_rank({"w": x}, ["w"], 1e-3) is None
    bound = noise_stats.low_rank_bound(64, 32, 1e-3)
    assert math.sqrt(64) + math.sqrt(32) < bound < math.sqrt(64 * 32)  # between full rank and rank 1
    u, v = torch.randn(5, 64, 1, generator=g), torch.randn(5, 1, 32, generator=g)
    found = noise_stats.low_rank({"w": (u @ v).double()}, ["w"], 1e-3)
    assert found is not None and found.share == pytest.approx(1.0)


def test_tensor_pair_dependence_p_is_uniform_ish_under_independence():
    g = torch.Generator().manual_seed(4)
    ps = [noise_stats.tensor_pair_dependence({"a": torch.randn(24, 64, generator=g),
                                              "b": torch.randn(24, 64, generator=g)}, ["a", "b"]).p
          for _ in range(200)]
    assert sum(p < 0.05 for p in ps) <= 20  # a valid (conservative) test: ~<= 5% below 0.05
    neg = torch.randn(24, 64, generator=g)
    found = noise_stats.tensor_pair_dependence({"a": neg, "b": -neg}, ["a", "b"])
    assert found.p < 1e-100 and found.worst_r == pytest.approx(-1.0)

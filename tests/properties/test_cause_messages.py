"""Messages that name the real cause (``fixtures/cause_message_specimens.py``): a run wrong from step 0
is said to be wrong from the first step (never "right at first and wrong later"), and ``norm_fidelity``
names every parameter whose per-sample norm share is off -- two parameters at two factors included --
or, where no fixed factor fits (a sequence layer's per-token norm), says why it names none.
``Correct`` passes these cases (``test_specimens.py``, ``test_horizon.py``); upstream opacus:
``test_upstream.py``."""

import pytest
import torch

import dpfsdp_verify.properties as props
from dpfsdp_verify.properties import PROPERTIES
from dpfsdp_verify.properties.clipping import param_shares
from tests.properties.test_horizon import judged, long_only, one_failure
from tests.verdict_helpers import message_problems

M = "fixtures.cause_message_specimens:"


def test_pair_fit_names_both_parameters_with_their_factors():
    g = torch.Generator().manual_seed(0)
    parts = {n: torch.rand(6, generator=g, dtype=torch.float64) for n in ("a", "b", "c")}
    true_sq = sum(parts.values())
    got = true_sq + (2.0 ** 2 - 1) * parts["a"] - parts["c"]  # a doubled, c left out
    allowed = 2 * 1e-9 * true_sq + 1e-24
    fits = param_shares.pair_fits(parts, got - true_sq, allowed, 1e-9)
    assert fits and fits[0].names == ["a", "c"], [f.describe() for f in fits]
    said = fits[0].describe()
    assert "'a' with a factor 2" in said and "leave out parameter 'c'" in said, said
    assert param_shares.pair_fits(parts, got - true_sq, allowed, 1e-9)[0].k == 0
    assert param_shares.pair_fits({n: p[:3] for n, p in parts.items()}, (got - true_sq)[:3], allowed[:3], 1e-9) == []
    assert "needs" not in param_shares.unnamed_reason(6) and ">= 4 samples" in param_shares.unnamed_reason(2)


def test_two_parameters_off_at_two_factors_are_both_named(pool):
    vs = props.run(PROPERTIES["norm_fidelity"], M + "TwoParametersCountedOff", pool=pool, world_sizes=(1,),
                   models=("mlp",), reductions=("mean",), timeout=120)
    bad = [v for v in vs if v.status != "pass"]
    # the norms it reports (undercount: fc2.bias left out) and, where it clips with the same ones, the clip
    assert bad and all(v.status == "fail" and v.diagnosis in ("undercount", "mismatch") for v in bad), \
        [v.message for v in vs]
    for v in bad:
        assert "'fc1.weight' with a factor 2" in v.message and "leave out parameter 'fc2.bias'" in v.message, \
            v.message
        assert not message_problems(v), message_problems(v)


def test_a_per_token_embedding_norm_says_why_no_parameter_is_named(pool):
    vs = props.run(PROPERTIES["norm_fidelity"], M + "EmbeddingNormPerToken", pool=pool, world_sizes=(1,),
                   models=("transformer",), reductions=("mean",), timeout=120)
    bad = [v for v in vs if v.status != "pass"]
    assert bad and all((v.status, v.diagnosis) == ("fail", "undercount") for v in bad), [v.message for v in vs]
    for v in bad:
        # sum_t ||b_t||^2 is exactly the position embedding's share (each position once): "tok.weight left out,
        # pos.weight doubled" fits every sample; the embedding is named either way
        assert "'tok.weight'" in v.message and not message_problems(v), v.message


@pytest.mark.slow
def test_norms_wrong_from_step_0_are_not_called_right_at_first(pool):
    v = one_failure(judged(pool, "clipped_step", M + "NormsReadAtEqualOffsets", long_only, horizon=16), "fail",
                    "mismatch", "from step 0 (counted from 0; epoch 1) on", "wrong from the first step on")
    assert "right at first" not in v.message and not message_problems(v), v.message

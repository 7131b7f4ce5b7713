"""The release judge at parameters where the compute dtype's rounding is beyond the first-order bound
(``precision_bounds.state_unjudgeable``), without ranks.

Gate seed 41100's exploration drew a bf16-fsdp transformer with noise at lr 0.47 and a sum (the noise
moves every parameter by ~7.6 a step): after one step the attention's logits were ~3e5, which bf16
rounds in steps of 2048. Two of them tied at step 3; the softmax's backward through the tie is the
rounding of the backprops entering it, and a clip applied as a scaled second backward (opacus' ghost
clipping, and ``Correct``) rounds those differently from the norm's pass: one sample's clipped
contribution came out 63 x C, upstream and ``Correct`` alike, and ``noise_calibration`` read the
unbounded signal as "too much noise". Such steps are left out of the decomposition, saying why; the
steps before them are judged as before."""

import math

import torch

from dpfsdp_verify.properties.analysis.compare import reference_model
from dpfsdp_verify.properties.analysis.precision_bounds import (SOFTMAX_ROUNDING_MAX, UNIT_ROUNDOFF, _softmax_inputs,
                                                                  precision_spec, state_conditions, state_unjudgeable)
from dpfsdp_verify.properties.releases.analysis import decompose, run_tests
from dpfsdp_verify.properties.releases.wording import left_out
from dpfsdp_verify.targets import RunSpec

from .test_releases import ALPHA_TEST, fake_run

U = UNIT_ROUNDOFF["bfloat16"]
#: a drifting bf16 run: a sum at lr 0.5 with sigma C = 20 moves each parameter by ~10 a step
DRIFT = RunSpec(model="transformer", dtype="float32", precision="bf16-fsdp", reduction="sum", lr=0.5, steps=4,
                global_batch_size=8, noise_multiplier=2.0, max_grad_norm=10.0)


def _scaled(spec, factor, names=("attn.q.weight", "attn.k.weight")):
    return {n: p.detach() * (factor if n in names else 1.0) for n, p in reference_model(spec).named_parameters()}


def test_the_default_models_are_far_inside_the_first_order_bound():
    for model in ("mlp", "transformer", "conv"):
        spec = precision_spec(RunSpec(model=model, dtype="float32", precision="bf16-fsdp", global_batch_size=8))
        (_, _), (logit, _) = state_conditions(spec, list(range(8)))
        assert U * logit < SOFTMAX_ROUNDING_MAX / 20, (model, logit)
        assert state_unjudgeable(spec, list(range(8))) == "", model


def test_attention_logits_bf16_rounds_by_more_than_one_are_named_with_the_layer():
    spec = DRIFT
    (_, _), (logit, where) = state_conditions(spec, list(range(8)), _scaled(spec, 30.0))
    assert where == "attn" and U * logit > SOFTMAX_ROUNDING_MAX
    why = state_unjudgeable(spec, list(range(8)), _scaled(spec, 30.0))
    assert "a softmax in 'attn' takes logits up to" in why and "bf16 rounds" in why, why
    # float32 resolves the same logits (u 2^-24): judged; and the initial parameters are judged under bf16
    assert state_unjudgeable(spec.with_(precision="fp32"), list(range(8)), _scaled(spec, 30.0)) == ""
    assert state_unjudgeable(spec, list(range(8))) == ""
    # float32 too, once its logits pass 1 / 2^-24
    assert "float32 rounds" in state_unjudgeable(spec.with_(precision="fp32"), list(range(8)), _scaled(spec, 1e4))


def test_scaled_dot_product_attention_logits_are_read_from_its_query_and_key():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64) for _ in range(3))
    f = torch.nn.functional.scaled_dot_product_attention
    want = q @ k.transpose(-1, -2) / math.sqrt(8)
    assert torch.allclose(_softmax_inputs((q, k, v), {}, f), want)
    assert torch.allclose(_softmax_inputs((q, k, v), {"scale": 0.5}, f), q @ k.transpose(-1, -2) * 0.5)
    grouped = _softmax_inputs((q, k[:, :2], v[:, :2]), {}, f)  # 4 query heads over 2 key heads
    assert torch.allclose(grouped[:, 1], q[:, 1] @ k[:, 0].transpose(-1, -2) / math.sqrt(8))
    assert torch.allclose(_softmax_inputs((), {"query": q, "key": k, "value": v}, f), want)
    assert _softmax_inputs((q, k[:, :3], v[:, :3]), {}, f) is None  # heads that do not group: not read, no crash
    assert _softmax_inputs((q,), {}, torch.exp) is None


def _with_artefact(spec, ranks, size):
    """``ranks`` with an off-span signal of ``size`` x sigma*C added to attn.q.weight's first column from
    step 1 on: what a bf16 tie made of one sample's clipped backward at gate seed 41100 (a fixed vector,
    not noise)."""
    for t in range(1, spec.steps):
        grad = ranks[0].steps[t].gradient  # shared by the ranks' outputs
        bump = torch.zeros_like(grad["attn.q.weight"])
        bump[:, 1] = size * spec.noise_multiplier * spec.max_grad_norm / spec.divisor
        grad["attn.q.weight"] = grad["attn.q.weight"] + bump
    return ranks


def test_steps_beyond_bf16_first_order_are_left_out_and_the_rest_judged():
    ranks = _with_artefact(DRIFT, fake_run(DRIFT), 10.0)
    run = decompose(DRIFT, 2, ranks)
    assert [t for t, _ in run.skipped] == [1, 2, 3] and {c.step for c in run.cells} == {0}
    assert all(why.startswith("bf16's rounding at the parameters it started from") for _, why in run.skipped)
    assert run_tests(run, ALPHA_TEST) is None
    assert "3 step(s) not decomposable (bf16 beyond its first-order bound" in left_out([w for _, w in run.skipped])
    # the same release judged in float32 (logits ~1e5 are resolved there): the artefact is found
    fp32 = DRIFT.with_(precision="fp32")
    f = run_tests(decompose(fp32, 2, ranks), ALPHA_TEST)
    assert f is not None and f.kind == "scale" and f.ratio > 1, f


def test_too_little_noise_under_bf16_still_fails_on_the_steps_judged():
    """A drifting bf16 run whose noise is half what it must be: step 0 alone (the initial parameters)
    shows it; a run that stays well conditioned (lr 0.01) is judged at every step and shows it too."""
    half = fake_run(DRIFT, factor=lambda t, r: 0.5)
    f = run_tests(decompose(DRIFT, 2, half), ALPHA_TEST)
    assert f is not None and f.kind == "scale" and f.ratio < 0.6, f
    calm = DRIFT.with_(lr=0.01)
    run = decompose(calm, 2, fake_run(calm, factor=lambda t, r: 0.5))
    assert not run.skipped and {c.step for c in run.cells} == {0, 1, 2, 3}
    f = run_tests(run, ALPHA_TEST)
    assert f is not None and f.kind == "scale" and f.ratio < 0.6, f
    assert run_tests(decompose(calm, 2, fake_run(calm)), ALPHA_TEST) is None

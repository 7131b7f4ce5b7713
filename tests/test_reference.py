"""The reference's clipping, DP-SGD step and input checks.

* Clip coefficients are opacus' ``min(1, C / (norm + 1e-6))``: equal to opacus'
  ``get_clipping_coef`` and to a hand computation, including the edge cases (zero norm, norm
  exactly at the bound).
* ``dp_sgd_gradient`` equals a hand-written DP-SGD step for a linear model (closed-form
  per-sample gradients), its noise is reproducible from an explicit generator, and it divides by
  the expected batch size under "mean" and by 1 under "sum". ``dp_sgd_trajectory`` is those steps
  applied in turn.
* Bad input raises a ``ReferenceInputError`` subclass whose message names the problem, from every
  entry point.

Agreement with opacus' per-sample gradients, norms and noised step is in ``test_reference_layers``.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.grad_sample import GradSampleModuleFastGradientClipping

from dpfsdp_verify import reference as R
from dpfsdp_verify.models import Batch, build_model, make_batch

# opacus registers full backward hooks on modules whose inputs (data) need no grad.
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

# --------------------------------------------------------------------------- clip coefficients

def opacus_clipping_coef(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """opacus' own ``get_clipping_coef``, run on given norms instead of a backward pass."""
    module = SimpleNamespace(max_grad_norm=max_grad_norm, get_norm_sample=lambda: norms)
    return GradSampleModuleFastGradientClipping.get_clipping_coef(module)


@settings(max_examples=25, deadline=None, database=None, derandomize=True)
@given(norms=st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=1, max_size=5),
       max_grad_norm=st.floats(1e-3, 1e3))
def test_clip_coefficients_equal_opacus_get_clipping_coef(norms, max_grad_norm):
    norms = torch.tensor(norms + [max_grad_norm], dtype=torch.float64)  # always one at the bound
    assert torch.equal(R.clip_coefficients(norms, max_grad_norm), opacus_clipping_coef(norms, max_grad_norm))


def test_clip_coefficients_by_hand():
    c = 2.0
    norms = torch.tensor([0.0, 1.0, 2.0, 4.0, 2e6], dtype=torch.float64)
    expected = torch.tensor([1.0, 1.0, c / (2.0 + 1e-6), c / (4.0 + 1e-6), c / (2e6 + 1e-6)], dtype=torch.float64)
    coef = R.clip_coefficients(norms, c)
    assert torch.equal(coef, expected)
    # the epsilon: a zero gradient stays finite, and a sample exactly at the bound is scaled (< 1)
    assert coef[0].item() == 1.0 and coef[2].item() < 1.0
    # after clipping, no sample's gradient norm exceeds the bound
    assert ((coef * norms) <= c).all()


def test_ghost_backward_coefficients_equal_reference():
    """End to end on a real model: opacus' coefficients after ``loss.backward()`` under ghost
    clipping equal the reference's, computed from the reference's own norms."""
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    model, batch = build_model("conv", 2, torch.float64), make_batch("conv", 4, 3, torch.float64)
    c = 4.35  # between the 2nd and 3rd of the default conv's norms here (4.23, 4.30, 4.41, 4.79)
    ref = R.dp_sgd_gradient(model, batch, max_grad_norm=c)
    assert (ref.coefficients < 1).any() and (ref.coefficients == 1).any(), "test needs clipped and unclipped samples"
    gsm = GradSampleModuleFastGradientClipping(copy.deepcopy(model), loss_reduction="mean", max_grad_norm=c)
    opt = DPOptimizerFastGradientClipping(torch.optim.SGD(gsm.parameters(), lr=0.0), noise_multiplier=0.0,
                                          max_grad_norm=c, expected_batch_size=4)
    DPLossFastGradientClipping(gsm, opt, nn.CrossEntropyLoss())(gsm(batch.inputs), batch.targets).backward()
    torch.testing.assert_close(gsm.get_clipping_coef(), ref.coefficients, rtol=1e-10, atol=0)


# --------------------------------------------------------------------------- the DP-SGD step

def linear_model_and_batch(batch_size: int = 4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2)).to(torch.float64)
    g = torch.Generator().manual_seed(1)
    x = 2 * torch.randn(batch_size, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 2, (batch_size,), generator=g)
    return model, Batch(x, y, "cross_entropy")


def hand_dp_step(model, batch, c, sigma, divisor, seed):
    """DP-SGD for ``softmax(W x + b)`` with cross-entropy, written out: the per-sample gradient is
    ``(p - onehot(y)) x^T`` for W and ``p - onehot(y)`` for b."""
    w, b = model[0].weight.detach(), model[0].bias.detach()
    dz = F.softmax(batch.inputs @ w.T + b, dim=1) - F.one_hot(batch.targets, 2).to(torch.float64)
    gw = dz[:, :, None] * batch.inputs[:, None, :]
    norms = (gw.pow(2).sum(dim=(1, 2)) + dz.pow(2).sum(dim=1)).sqrt()
    coef = torch.clamp(c / (norms + 1e-6), max=1.0)
    gen = torch.Generator().manual_seed(seed)
    noise_w = torch.normal(0.0, sigma * c, size=(2, 3), generator=gen, dtype=torch.float64)
    noise_b = torch.normal(0.0, sigma * c, size=(2,), generator=gen, dtype=torch.float64)
    return {
        "norms": norms,
        "coefficients": coef,
        "0.weight": ((coef[:, None, None] * gw).sum(0) + noise_w) / divisor,
        "0.bias": ((coef[:, None] * dz).sum(0) + noise_b) / divisor,
    }


@pytest.mark.parametrize("reduction,expected_batch_size,divisor", [
    ("mean", None, 4.0),    # defaults to len(batch)
    ("mean", 10, 10.0),     # Poisson sampling: the expected, not the actual, batch size
    ("sum", None, 1.0),
    ("sum", 10, 1.0),       # ignored under "sum"
])
def test_dp_sgd_gradient_equals_hand_computation(reduction, expected_batch_size, divisor):
    model, batch = linear_model_and_batch()
    c, sigma = 1.5, 0.6
    step = R.dp_sgd_gradient(model, batch, max_grad_norm=c, noise_multiplier=sigma, reduction=reduction,
                             expected_batch_size=expected_batch_size, generator=torch.Generator().manual_seed(9))
    hand = hand_dp_step(model, batch, c, sigma, divisor, seed=9)
    assert (hand["coefficients"] < 1).any() and (hand["coefficients"] == 1).any()
    for key in ("norms", "coefficients"):
        torch.testing.assert_close(getattr(step, key), hand[key], rtol=1e-12, atol=0)
    for name in ("0.weight", "0.bias"):
        torch.testing.assert_close(step.gradient[name], hand[name], rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(step.gradient[name] * divisor, step.clipped_sum[name] + step.noise[name],
                                   rtol=1e-14, atol=1e-15)


def test_noise_from_an_explicit_generator_is_reproducible():
    model, batch = build_model("mlp", 0, torch.float64), make_batch("mlp", 5, 1, torch.float64)

    def step(seed):
        return R.dp_sgd_gradient(model, batch, max_grad_norm=1.0, noise_multiplier=1.1,
                                 generator=torch.Generator().manual_seed(seed))

    first, again, other = step(123), step(123), step(124)
    for name in first.gradient:
        assert torch.equal(first.gradient[name], again.gradient[name]), f"{name}: same seed, different noise"
        assert not torch.equal(first.noise[name], other.noise[name]), f"{name}: noise ignores the seed"
        assert torch.equal(first.clipped_sum[name], other.clipped_sum[name])
    # the noise is sigma * C * z with z drawn in parameter order from the generator
    gen = torch.Generator().manual_seed(123)
    for name, p in model.named_parameters():
        torch.testing.assert_close(first.noise[name], 1.1 * torch.normal(0.0, 1.0, size=p.shape, generator=gen,
                                                                         dtype=torch.float64), rtol=1e-12, atol=0)


def test_zero_noise_multiplier_adds_exactly_nothing():
    model, batch = build_model("mlp", 0, torch.float64), make_batch("mlp", 5, 1, torch.float64)
    step = R.dp_sgd_gradient(model, batch, max_grad_norm=1.0, noise_multiplier=0.0, reduction="mean",
                             expected_batch_size=8)
    for name, g in step.gradient.items():
        assert not step.noise[name].any()
        assert torch.equal(g, step.clipped_sum[name] / 8.0)


def test_mean_and_sum_differ_exactly_by_the_divisor():
    """Cross-entropy per-sample gradients do not depend on the reduction, so with the same noise
    the "sum" gradient is the "mean" gradient times the expected batch size."""
    model, batch = build_model("conv", 0, torch.float64), make_batch("conv", 3, 1, torch.float64)
    kwargs = dict(max_grad_norm=0.5, noise_multiplier=0.9, expected_batch_size=6)
    mean = R.dp_sgd_gradient(model, batch, reduction="mean", generator=torch.Generator().manual_seed(4), **kwargs)
    total = R.dp_sgd_gradient(model, batch, reduction="sum", generator=torch.Generator().manual_seed(4), **kwargs)
    torch.testing.assert_close(mean.norms, total.norms, rtol=0, atol=0)
    for name in mean.gradient:
        torch.testing.assert_close(mean.gradient[name] * 6, total.gradient[name], rtol=1e-14, atol=1e-15)
    assert total.loss == pytest.approx(3 * mean.loss, rel=1e-14)


def test_trajectory_applies_dp_steps_in_turn_and_leaves_the_model_alone():
    model = build_model("mlp", 0)
    before = copy.deepcopy(model.state_dict())
    batches = [make_batch("mlp", 3, seed) for seed in (1, 2)]
    traj = R.dp_sgd_trajectory(model, batches, lr=0.5, max_grad_norm=0.7, noise_multiplier=0.3,
                               generator=torch.Generator().manual_seed(5))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    m = copy.deepcopy(model).to(torch.float64)
    gen = torch.Generator().manual_seed(5)
    losses = []
    for batch in batches:
        step = R.dp_sgd_gradient(m, batch, max_grad_norm=0.7, noise_multiplier=0.3, generator=gen)
        losses.append(step.loss)
        with torch.no_grad():
            for name, p in m.named_parameters():
                p -= 0.5 * step.gradient[name]
    assert traj.losses == pytest.approx(losses, rel=1e-14)
    for name, p in m.named_parameters():
        torch.testing.assert_close(traj.parameters[name], p, rtol=1e-14, atol=1e-15)
    assert not torch.equal(traj.parameters["fc1.weight"], before["fc1.weight"].to(torch.float64))


# --------------------------------------------------------------------------- bad input

ENTRY_POINTS = {
    "per_sample_grads_vmap": lambda m, b: R.per_sample_grads(m, b, method="vmap"),
    "per_sample_grads_loop": lambda m, b: R.per_sample_grads(m, b, method="loop"),
    "dp_sgd_gradient": lambda m, b: R.dp_sgd_gradient(m, b, max_grad_norm=1.0),
    "dp_sgd_trajectory": lambda m, b: R.dp_sgd_trajectory(m, [b], lr=0.1, max_grad_norm=1.0),
}
entry_points = pytest.mark.parametrize("entry", list(ENTRY_POINTS))


def mlp_batch(n: int = 3) -> Batch:
    return make_batch("mlp", n, 1)


class WithBareParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.fc(x) * self.scale


@entry_points
@pytest.mark.parametrize("model,layer,type_name", [
    (nn.Sequential(nn.Linear(6, 4), nn.Sequential(nn.ReLU(), nn.BatchNorm1d(4)), nn.Linear(4, 3)),
     "'1.1'", "BatchNorm1d"),
    # no parameters, but it still mixes the samples of a batch
    (nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4, affine=False), nn.Linear(4, 3)), "'1'", "BatchNorm1d"),
    (WithBareParameter(), "'<root>'", "WithBareParameter"),
], ids=["batchnorm", "batchnorm_no_affine", "bare_parameter"])
def test_unsupported_layer_is_named(entry, model, layer, type_name):
    with pytest.raises(R.UnsupportedLayerError) as err:
        ENTRY_POINTS[entry](model, mlp_batch())
    msg = str(err.value)
    assert layer in msg and type_name in msg and "not supported" in msg, msg


def test_parameter_tying_is_in_scope():
    """A tied parameter is one parameter whose gradient sums its uses (tests/features/test_finetune.py
    checks the sum): it is reported once, under its first name, not refused."""
    model = build_model("transformer", 0)
    model.head.weight = model.tok.weight
    batch = make_batch("transformer", 2, 1)
    grads = R.per_sample_grads(model, batch)
    assert "tok.weight" in grads and "head.weight" not in grads
    step = R.dp_sgd_gradient(model, batch, max_grad_norm=1.0)
    assert set(step.gradient) == set(grads) and bool(torch.isfinite(step.norms).all())


@entry_points
def test_empty_batch_is_named(entry):
    with pytest.raises(R.BatchError, match=r"empty \(batch size 0\)"):
        ENTRY_POINTS[entry](build_model("mlp", 0), mlp_batch(0))


@entry_points
@pytest.mark.parametrize("n_inputs,n_targets", [(4, 3), (0, 2)])
def test_mismatched_batch_sizes_are_named(entry, n_inputs, n_targets):
    full = mlp_batch(4)
    batch = Batch(full.inputs[:n_inputs], full.targets[:n_targets], full.loss)
    with pytest.raises(R.BatchError) as err:
        ENTRY_POINTS[entry](build_model("mlp", 0), batch)
    msg = str(err.value)
    assert f"batch size {n_inputs}" in msg and f"targets have {n_targets}" in msg and "must match" in msg, msg


@pytest.mark.parametrize("call,pattern", [
    (lambda m, b: R.per_sample_grads(m, b, reduction="avg"), r"reduction must be one of .*'avg'"),
    (lambda m, b: R.per_sample_grads(m, Batch(b.inputs, b.targets, "mse")), r"loss must be one of .*'mse'"),
    (lambda m, b: R.dp_sgd_gradient(m, b, max_grad_norm=0.0), r"max_grad_norm must be > 0, got 0.0"),
    (lambda m, b: R.dp_sgd_gradient(m, b, max_grad_norm=-1.0), r"max_grad_norm must be > 0, got -1.0"),
    (lambda m, b: R.dp_sgd_gradient(m, b, max_grad_norm=1.0, noise_multiplier=-0.5),
     r"noise_multiplier must be >= 0, got -0.5"),
    (lambda m, b: R.dp_sgd_gradient(m, b, max_grad_norm=1.0, expected_batch_size=0),
     r"expected_batch_size must be > 0, got 0"),
], ids=["reduction", "loss", "max_grad_norm_zero", "max_grad_norm_negative", "noise_multiplier",
        "expected_batch_size"])
def test_bad_settings_are_named(call, pattern):
    with pytest.raises(R.ReferenceInputError, match=pattern):
        call(build_model("mlp", 0), mlp_batch())


def test_input_errors_are_value_errors_and_distinct():
    """Callers can catch every config mistake as ValueError, or one kind precisely."""
    for cls in (R.UnsupportedLayerError, R.BatchError):
        assert issubclass(cls, R.ReferenceInputError) and issubclass(cls, ValueError)
    with pytest.raises(ValueError, match=r"method must be 'loop' or 'vmap', got 'jit'"):
        R.per_sample_grads(build_model("mlp", 0), mlp_batch(), method="jit")

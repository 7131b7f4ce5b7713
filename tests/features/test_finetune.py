"""Fine-tuned models: frozen parameters / LoRA adapters and tied weights (``docs/finetune.md``).

* the models: ``lora`` freezes its base (a whole layer, and a weight beside a trainable bias) and
  trains small adapters; ``tied`` shares one tensor between the token embedding and the LM head;
  both are pure functions of the seed;
* the reference: per-sample gradients only for trainable parameters; a tied parameter's is the
  sum of its uses (``per_use_grads`` on the untied copy), by both methods;
* the runner: a frozen parameter that gets a gradient, noise or an update is ``frozen_updated``;
  a target that raises ``Refused`` gets ``fail`` / ``refused``;
* the specimens (``fixtures/finetune_specimens.py``) fail the property named for their bug with
  its diagnosis; ``Correct`` passes; upstream opacus passes on ``lora`` and refuses ``tied``
  (reported as a refusal, expected by the shipped expectations file).
"""

from __future__ import annotations

import pytest
import torch

from dpfsdp_verify import models
from dpfsdp_verify.gate import expectations
from dpfsdp_verify import reference as R
from dpfsdp_verify.properties import PROPERTIES
from dpfsdp_verify.properties.engine.prechecks import frozen_problem
from dpfsdp_verify.properties.engine.contract import Case
from dpfsdp_verify.properties.engine.runner import judge_case
from dpfsdp_verify.targets import RankOutput, RunSpec, StepOutput
from dpfsdp_verify.verdict import DIAGNOSES
import dpfsdp_verify.properties as props  # noqa: E402
from tests.verdict_helpers import assert_all_pass

CORRECT = "fixtures.specimens:Correct"
F = "fixtures.finetune_specimens:"
FIXED = dict(samplings=("fixed",), dtypes=("float64",))
ADAPTERS = {"fc1_a.weight", "fc1_b.weight", "fc2_a.weight", "fc2_b.weight"}


# -- models and reference ----------------------------------------------------------------------
def test_lora_freezes_its_base_and_trains_adapters_and_one_bias():
    m = models.build_model("lora", 0)
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable == ADAPTERS | {"fc2.bias"}
    assert not m.norm.weight.requires_grad and not m.fc2.weight.requires_grad
    again = models.build_model("lora", 0)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), again.parameters()))
    assert not torch.equal(m.fc1_a.weight, models.build_model("lora", 1).fc1_a.weight)
    # B is not zero-initialised: A's per-sample gradients are not trivially zero
    assert float(m.fc1_b.weight.detach().abs().min()) > 0


def test_tied_model_shares_one_tensor_and_its_twin_does_not():
    tied, twin = models.build_model("tied", 0), models.build_model("tied", 0, tie="none")
    assert tied.head.weight is tied.tok.weight and twin.head.weight is not twin.tok.weight
    assert torch.equal(twin.head.weight, twin.tok.weight) and torch.equal(tied.tok.weight, twin.tok.weight)
    assert R.tied_names(tied) == {"tok.weight": ["tok.weight", "head.weight"]} and R.tied_names(twin) == {}
    with pytest.raises(ValueError, match="tie='both'"):
        models.build_model("tied", 0, tie="both")


@pytest.mark.parametrize("name", ["lora", "tied"])
@pytest.mark.parametrize("reduction", R.REDUCTIONS)
def test_reference_fast_path_equals_loop(name, reduction):
    m = models.build_model(name, 0, dtype=torch.float64)
    b = models.make_batch(name, 4, 1, dtype=torch.float64)
    fast, loop = R.per_sample_grads(m, b, reduction), R.per_sample_grads(m, b, reduction, method="loop")
    assert sorted(fast) == sorted(loop)
    for n in fast:
        assert torch.allclose(fast[n], loop[n], rtol=1e-12, atol=1e-14), n


def test_reference_per_sample_grads_are_over_trainable_parameters_only():
    m = models.build_model("lora", 0, dtype=torch.float64)
    b = models.make_batch("lora", 4, 1, dtype=torch.float64)
    grads = R.per_sample_grads(m, b)
    assert set(grads) == ADAPTERS | {"fc2.bias"}
    every = R.per_sample_grads(R.with_all_trainable(m), b)
    # the trainable ones are the same whether or not the others are frozen
    for n, g in grads.items():
        assert torch.allclose(g, every[n], rtol=1e-12, atol=1e-14), n
    assert bool((R.per_sample_norms(every) > R.per_sample_norms(grads)).all())


@pytest.mark.parametrize("method", ["vmap", "loop"])
def test_tied_gradient_is_the_sum_of_its_uses(method):
    m = models.build_model("tied", 0, dtype=torch.float64)
    b = models.make_batch("tied", 4, 1, dtype=torch.float64)
    tied = R.per_sample_grads(m, b, method=method)
    uses = R.per_use_grads(m, b, method=method)
    assert "head.weight" not in tied and {"tok.weight", "head.weight"} <= set(uses)
    assert torch.allclose(tied["tok.weight"], uses["tok.weight"] + uses["head.weight"], rtol=1e-12, atol=1e-14)
    # the untied twin model (a separate head with the same values) has the same per-use gradients
    twin = R.per_sample_grads(models.build_model("tied", 0, dtype=torch.float64, tie="none"), b, method=method)
    for n in uses:
        assert torch.allclose(uses[n], twin[n], rtol=1e-12, atol=1e-14), n
    # each use alone is a real part of the gradient: neither use is (near) zero
    assert float(uses["head.weight"].abs().max()) > 1e-3 and float(uses["tok.weight"].abs().max()) > 1e-3


def test_reference_step_moves_only_trainable_parameters_and_a_tied_one_once():
    m = models.build_model("lora", 0, dtype=torch.float64)
    b = models.make_batch("lora", 4, 1, dtype=torch.float64)
    traj = R.dp_sgd_trajectory(m, [b], lr=0.5, max_grad_norm=1.0)
    for n, p in m.named_parameters():
        assert torch.equal(traj.parameters[n], p.detach()) == (not p.requires_grad), n
    t = models.build_model("tied", 0, dtype=torch.float64)
    tb = models.make_batch("tied", 4, 1, dtype=torch.float64)
    step = R.dp_sgd_gradient(t, tb, max_grad_norm=1.0)
    traj = R.dp_sgd_trajectory(t, [tb], lr=0.5, max_grad_norm=1.0)
    assert torch.allclose(traj.parameters["tok.weight"], t.tok.weight.detach() - 0.5 * step.gradient["tok.weight"])


# -- the runner's checks, on fabricated outputs (no ranks) --------------------------------------
def _outputs(spec, change=None):
    m = models.build_model(spec.model, spec.model_seed, dtype=spec.torch_dtype)
    params = {n: p.detach().to(torch.float64).clone() for n, p in m.named_parameters()}
    grads = {n: torch.zeros_like(p) for n, p in params.items()}
    if change:
        change(grads, params)
    return [RankOutput(0, 1, [StepOutput(list(range(spec.global_batch_size)), None, 0.0, grads, params)])]


def test_frozen_problem_is_exact_and_names_the_parameter():
    spec = RunSpec(model="lora")
    assert frozen_problem(spec, _outputs(spec)) is None
    msg, ev = frozen_problem(spec, _outputs(spec, lambda g, p: g["norm.bias"].add_(1e-12)))
    assert "'norm.bias'" in msg and "gradient or noise" in msg and ev["frozen_parameter"] == "norm.bias"
    msg, ev = frozen_problem(spec, _outputs(spec, lambda g, p: p["fc1.weight"].add_(1e-15)))
    assert "'fc1.weight'" in msg and "changed" in msg
    # trainable parameters may move; a model without frozen parameters has nothing to check
    assert frozen_problem(spec, _outputs(spec, lambda g, p: p["fc1_a.weight"].add_(1.0))) is None
    assert frozen_problem(RunSpec(), _outputs(RunSpec(), lambda g, p: p["fc1.weight"].add_(1.0))) is None


def test_runner_reports_frozen_updates_and_refusals_as_verdicts():
    prop = PROPERTIES["clipped_step"]
    spec = RunSpec(model="lora")
    case = Case("clipped_step", CORRECT, spec, 1)
    v = judge_case(prop, case, [[_outputs(spec, lambda g, p: g["fc2.weight"].add_(0.1))]])
    assert (v.status, v.diagnosis) == ("fail", "frozen_updated"), v.message
    refused = [RankOutput(0, 1, refused="no tied parameters here")]
    v = judge_case(prop, case, [[refused]])
    assert (v.status, v.diagnosis) == ("fail", "refused") and "no tied parameters here" in v.message
    assert {"refused", "frozen_updated"} <= set(DIAGNOSES)


# -- the specimens and upstream on ranks --------------------------------------------------------
def test_correct_passes_on_lora_and_tied(pool):
    for prop in ("norm_fidelity", "clipped_step", "sensitivity_bound"):
        assert_all_pass(props.run(prop, CORRECT, pool=pool, world_sizes=(1, 2), models=("lora", "tied"),
                                         reductions=("mean",), **FIXED))


@pytest.mark.slow
def test_correct_noise_is_calibrated_on_adapters_and_absent_on_frozen(pool):
    assert_all_pass(props.run("noise_calibration", CORRECT, pool=pool, world_sizes=(2,), models=("lora",),
                                                    reductions=("mean",), seed=11))


def test_clips_over_frozen_fails_norm_fidelity_naming_the_frozen_weight(pool):
    vs = props.run("norm_fidelity", F + "ClipsOverFrozen", pool=pool, world_sizes=(1, 2), models=("lora",),
                                     reductions=("mean",), **FIXED)
    assert vs and all((v.status, v.diagnosis) == ("fail", "mismatch") for v in vs), [v.message for v in vs]
    assert all("frozen parameters of layers that also hold a trainable one (fc2.weight)" in v.message for v in vs)
    vs = props.run("clipped_step", F + "ClipsOverFrozen", pool=pool, world_sizes=(2,), models=("lora",),
                                    reductions=("mean",), **FIXED)
    assert [(v.status, v.diagnosis) for v in vs] == [("fail", "mismatch")]


@pytest.mark.slow
def test_noises_frozen_fails_noise_calibration_as_frozen_updated(pool):
    vs = props.run("noise_calibration", F + "NoisesFrozen", pool=pool, world_sizes=(1, 2), models=("lora",),
                                         reductions=("mean",), draws=32, seed=3)
    vs = [v for v in vs if v.config["model"] == "lora"]  # not the one-row case, which runs on the mlp
    assert vs and all((v.status, v.diagnosis) == ("fail", "frozen_updated") for v in vs), [v.message for v in vs]
    assert all("frozen parameter 'fc1.weight'" in v.message for v in vs)


@pytest.mark.slow
def test_skips_adapter_noise_fails_noise_calibration(pool):
    vs = props.run("noise_calibration", F + "SkipsAdapterNoise", pool=pool, world_sizes=(1, 2), models=("lora",),
                                         reductions=("mean",), draws=32, seed=3)
    vs = [v for v in vs if v.config["model"] == "lora"]  # not the one-row case, which runs on the mlp
    assert vs and all((v.status, v.diagnosis) == ("fail", "mismatch") for v in vs), [v.message for v in vs]
    assert all("PRIVACY VIOLATION: no noise at all" in v.message and "'fc1_a.weight'" in v.message for v in vs)


def test_tied_last_use_only_undercounts(pool):
    vs = props.run("norm_fidelity", F + "TiedLastUseOnly", pool=pool, world_sizes=(1, 2), models=("tied",),
                                     reductions=("mean",), **FIXED)
    assert vs and all((v.status, v.diagnosis) == ("fail", "undercount") for v in vs), [v.message for v in vs]
    assert all("from its use as 'tok.weight' only" in v.message for v in vs)
    vs = props.run("sensitivity_bound", F + "TiedLastUseOnly", pool=pool, world_sizes=(1, 2), models=("tied",),
                                         **FIXED)
    assert vs and all((v.status, v.diagnosis) == ("fail", "undercount") for v in vs), [v.message for v in vs]
    assert all("PRIVACY VIOLATION" in v.message and "exceed C" in v.message for v in vs)


def test_upstream_passes_lora_and_refuses_tied_as_expected(pool):
    assert_all_pass(props.run("norm_fidelity", "opacus", pool=pool, world_sizes=(1, 2), models=("lora",),
                                                reductions=("mean",), **FIXED))
    vs = props.run("norm_fidelity", "opacus", pool=pool, world_sizes=(1, 2), models=("tied",),
                                     reductions=("mean",), **FIXED)
    assert vs and all((v.status, v.diagnosis) == ("fail", "refused") for v in vs), [v.message for v in vs]
    assert all("opacus 1.6.0 refuses tied parameters" in v.message and "shared" in v.message for v in vs)
    outcome = expectations.apply(expectations.load("opacus-1.6.0"), vs)
    assert all(outcome.is_expected(v) for v in vs) and outcome.holds, outcome.to_json()

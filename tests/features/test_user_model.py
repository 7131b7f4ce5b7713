"""Your own model (``docs/models.md``): ``--models package.module:ATTR`` with the build/batch/loss
contract.

* the documented example is exactly ``examples/my_model.py`` (the tests run that file, through
  ``fixtures.user_models``, which loads it by path);
* the contract's plumbing: seeded builds, dict inputs sliced along dim 0, the reference's
  per-sample loop against ``torch.func`` on the same model, short names of ``CONTRACT_MODELS``;
* a model that breaks the contract stops the gate with one line (exit 2) before any rank starts;
  one that cannot run in float64 gets ``skip`` saying why;
* the example through the gate on ``Correct`` and upstream opacus at world sizes 1 and 2 passes;
  specimens that get one of its parameters wrong (``fixtures/model_specimens.py``) fail
  ``norm_fidelity`` naming that parameter and the factor.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import dpfsdp_verify.properties as props
from dpfsdp_verify import models, reference
from dpfsdp_verify.gate import cli
from dpfsdp_verify.models import catalog, contract
from dpfsdp_verify.properties.clipping.param_shares import clip_share_diagnosis, fit_shares
from dpfsdp_verify.properties.analysis.compare import reference_grads
from dpfsdp_verify.targets import RunSpec
from tests.verdict_helpers import assert_all_pass, run_gate

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINE = "fixtures.user_models:MyModel"
CORRECT = "fixtures.specimens:Correct"
ONE = dict(data_layouts=("split",), reductions=("mean",), dtypes=("float64",), samplings=("fixed",), timeout=180)


# -- the documentation and its example --------------------------------------------------------------
def test_the_docs_show_exactly_the_example_file():
    with open(os.path.join(REPO, "docs", "models.md")) as f:
        page = f.read()
    block = re.search(r"<!-- example:examples/my_model.py -->\n```python\n(.*?)```\n<!-- /example -->", page, re.S)
    with open(os.path.join(REPO, "examples", "my_model.py")) as f:
        assert block is not None and block.group(1) == f.read()
    from fixtures import user_models

    assert user_models.example.__file__ == os.path.join(REPO, "examples", "my_model.py")
    assert "dpfsdp_verify" not in block.group(1)  # written without the suite


# -- the contract's plumbing ----------------------------------------------------------------------
def test_a_contract_model_builds_seeded_and_batches_dict_inputs_sliced_along_dim0():
    a, b = models.build_model(MINE, 3), models.build_model(MINE, 3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embed.weight, models.build_model(MINE, 4).embed.weight)
    assert models.build_model(MINE, 0, dtype=torch.float64).head.weight.dtype == torch.float64
    batch = models.make_batch(MINE, 5, 1, dtype=torch.float64)
    assert len(batch) == 5 and isinstance(batch.inputs, contract.SampleInputs)
    assert set(batch.inputs.keys()) == {"ids", "mask"} and batch.inputs["ids"].dtype == torch.long
    part = batch.select([4, 1])
    assert torch.equal(part.inputs["ids"], batch.inputs["ids"][[4, 1]]) and torch.equal(part.targets,
                                                                                        batch.targets[[4, 1]])
    assert len(batch.select([])) == 0
    whole = contract.cat_samples([batch.inputs[:2], batch.inputs[2:]])
    assert torch.equal(whole["mask"], batch.inputs["mask"])
    assert torch.equal(contract.stack_samples([batch.inputs[i] for i in range(5)])["ids"], batch.inputs["ids"])
    out = a(batch.inputs.to(torch.float32))  # a dict of inputs reaches forward as keywords
    assert out.shape == (5, 5) and batch.loss == models.make_batch(MINE, 2, 0).loss


def test_the_reference_loops_over_samples_with_no_knowledge_of_the_layers():
    name = "fixtures.user_models:TensorInputModel"
    model = models.build_model(name, 0, dtype=torch.float64)
    batch = models.make_batch(name, 6, 2, dtype=torch.float64)
    got = reference.per_sample_grads(model, batch, "sum")
    from torch.func import functional_call, grad, vmap

    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss_one(p, x, y):
        return (functional_call(model, p, (x.unsqueeze(0),)).squeeze(-1) - y.unsqueeze(0)).pow(2)[0]

    want = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, batch.inputs, batch.targets)
    assert set(got) == set(want) and all(torch.allclose(got[n], want[n], rtol=1e-12, atol=1e-14) for n in got)
    # dict inputs: every sample alone equals the same sample inside the batch's loop
    mine, b = models.build_model(MINE, 0, dtype=torch.float64), models.make_batch(MINE, 4, 1, dtype=torch.float64)
    loop = reference.per_sample_grads(mine, b, "mean")
    alone = reference.per_sample_grads(mine, b.select([2]), "mean")
    assert all(torch.allclose(loop[n][2], alone[n][0], rtol=1e-12, atol=1e-15) for n in loop)


def test_names_forms_groups_and_short_names(monkeypatch):
    assert catalog.is_import_path("my_model:MyModel") and catalog.is_import_path("a.b:C.D")
    assert not catalog.is_import_path("mlp") and not catalog.is_import_path("a:b:c")
    assert catalog.expand_models(["mlp", MINE, "mlp"]) == ("mlp", MINE)
    with pytest.raises(ValueError, match="unknown model gpt5: .*package.module:ATTR"):
        catalog.expand_models(["gpt5"])
    monkeypatch.setitem(catalog.CONTRACT_MODELS, "mine", MINE)
    monkeypatch.setitem(catalog.MODEL_GROUPS, "mine_all", ("mine", "mlp"))
    assert catalog.expand_models(["mine_all"]) == ("mine", "mlp")
    m = models.build_model("mine", 5)
    assert torch.equal(m.embed.weight, models.build_model(MINE, 5).embed.weight)
    with pytest.raises(ValueError, match="takes no dimensions"):
        models.build_model("mine", 0, hidden=3)


# -- what cannot run -----------------------------------------------------------------------------------
@pytest.mark.parametrize("attr, says", [
    ("NoLoss", "without method(s) loss"),
    ("raising_factory", "raising_factory() raised RuntimeError: no weights here"),
    ("BuildsNoModule", "build(0) gave a str, not a torch.nn.Module"),
    ("ShortBatch", "gave dim 0 inputs=3, not 2"),
    ("BatchLoss", "loss(output, targets) gave (), not per-sample losses of shape (2,)"),
    ("ForwardRaises", "the forward of a batch of 2 raised RuntimeError"),
    ("Nothing", "has no attribute 'Nothing'"),
])
def test_a_broken_contract_exits_2_with_one_line_before_any_rank(capsys, attr, says):
    assert cli.main(["run", "--models", f"mlp,fixtures.user_models:{attr}", "--world-sizes", "1"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert says in err and err.startswith("dpfsdp-verify: error:") and "docs/models.md" in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_model_without_float64_skips_saying_why(pool):
    """Its float32 run is fine and its float64 run crashes in the model: both skip, saying why."""
    verdicts = props.run("norm_fidelity", CORRECT, pool=pool, world_sizes=(1,),
                         models=("fixtures.user_models:Float32OnlyModel",), **{**ONE, "dtypes": ("float64", "float32")})
    assert len(verdicts) == 2 and all(v.status == "skip" for v in verdicts), [(v.status, v.message) for v in verdicts]
    assert all("cannot run in float64" in v.message and "forward of a batch of 2 raised RuntimeError" in v.message
               for v in verdicts), verdicts[0].message


# -- the gate on it ---------------------------------------------------------------------------------
@pytest.mark.parametrize("target", [CORRECT, "opacus"])
def test_the_example_passes_the_gate_on_correct_and_upstream(pool, monkeypatch, capsys, target):
    r = run_gate(pool, monkeypatch, capsys, "run", "--target", target, "--models", MINE, "--world-sizes", "1,2",
                 "--properties", "norm_fidelity,clipped_step,sensitivity_bound", "--loss-reductions", "mean",
                 "--dtypes", "float64", "--sampling", "fixed", "--precisions", "fp32", "--wide-world-size", "0",
                 "--node-world-size", "0", "--horizon", "0")
    assert r.returncode == 0, r.stdout[-3000:]
    summary = re.search(r"PASSED \(exit 0\): (\d+) passed$", r.stdout, re.M)
    assert summary and int(summary.group(1)) >= 4 and "skip" not in r.stdout, r.stdout[-3000:]


@pytest.mark.parametrize("name, words, diagnosis", [
    ("EmbeddingCountedTwice", "count parameter 'embed.weight' with a factor 1.414", "mismatch"),
    ("HeadBiasLeftOut", "leave out parameter 'head.bias'", "undercount"),
])
def test_a_parameter_gotten_wrong_is_named_with_its_factor(pool, name, words, diagnosis):
    [v] = props.run("norm_fidelity", "fixtures.model_specimens:" + name, pool=pool, world_sizes=(2,),
                    models=(MINE,), **ONE)
    assert (v.status, v.diagnosis) == ("fail", diagnosis), v.message
    assert words in v.message and "It clips with the same wrong norms" in v.message, v.message


def test_the_clip_path_names_the_parameter_from_coefficients_alone():
    """The norms a target clips with, read back from its clip coefficients only (it reports none):
    the share fit names the parameter from those."""
    spec = RunSpec(model=MINE, global_batch_size=8, max_grad_norm=1.0)
    grads = reference_grads(spec)
    true_sq = sum(g.flatten(1).pow(2).sum(1) for g in grads.values())
    c = float(true_sq.sqrt().median())
    spec = spec.with_(max_grad_norm=c)
    wrong = (true_sq - grads["head.bias"].flatten(1).pow(2).sum(1)).sqrt()
    found = fit_shares(spec, list(range(8)), wrong.pow(2), 1e-9)
    assert [f.names for f in found] == [["head.bias"]] and found[0].k < 1e-6
    coef = reference.clip_coefficients(wrong, c) * 0.5  # an overall scale does not hide it
    said = clip_share_diagnosis(spec, list(range(8)), coef, reference.clip_coefficients(true_sq.sqrt(), c), 1e-6,
                                "at world_size=2")
    assert said is not None and said[0] == "undercount" and "'head.bias'" in said[1]
    assert fit_shares(spec, list(range(8)), true_sq, 1e-9) == []  # the truth needs no explanation


@pytest.mark.slow
def test_every_model_property_runs_on_the_example(pool):
    """trajectory, noise_calibration, mode_equivalence and checkpoint_resume on the example at world
    sizes 1 and 2 on Correct: every verdict a pass (the checks tied to the built-in models' structure
    stay on them)."""
    for pid in ("trajectory", "noise_calibration", "mode_equivalence", "checkpoint_resume"):
        assert_all_pass(props.run(pid, CORRECT, pool=pool, world_sizes=(1, 2), models=(MINE,),
                                  reductions=("mean",), dtypes=("float64",), timeout=300))

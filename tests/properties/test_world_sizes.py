"""4 and 8 ranks: default models every check can run at, upstream's short-layer crash named as its
own diagnosis (``placement_mismatch``, docs/findings.md finding 3), and a fixed adapter and
``Correct`` passing the case that shows it.

The model and diagnosis checks start no rank; the end-to-end ones run the short-layer case at 2
ranks on the warm pool (the ``pool`` fixture proves its ranks are gone), and the 4-rank gate run
is ``slow``.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from dpfsdp_verify import models
from dpfsdp_verify import properties as props
from dpfsdp_verify.harness.group import GroupResult
from dpfsdp_verify.harness.protocol import JobError, JobResult
from dpfsdp_verify.properties import PROPERTIES, Options
from dpfsdp_verify.properties.clipping.clipped_step import SHORT_LAYER_DIMS
from dpfsdp_verify.properties.engine.runner import _Failed, failure_verdict
from tests.verdict_helpers import run_gate

#: torch 2.13's refusal, as rank 0 of the 4-rank mlp run reported it before the models were reshaped
PLACEMENT_ERROR = ("aten.add_.Tensor: in-place operations that require placement changes are not supported. The "
                   "input has placement (Shard(dim=0),), but no valid strategy preserves this placement. Please use "
                   "the out-of-place version of this operation instead.\n\nSharding propagation failed for "
                   "aten.add_.Tensor(Spec(f64[3, 8](S(0))), Spec(f64[3, 8](R))) on DeviceMesh((4,), 'cpu', "
                   "stride=(1,)))")
SHORT_CASE = dict(world_sizes=(2,), models=("transformer",), reductions=("mean",), dtypes=("float64",),
                  samplings=("fixed",), timeout=120)


# -- the default models --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", models.BASE_MODELS)
def test_default_models_have_rows_for_8_ranks_and_uneven_shards(name):
    """Every parameter's dim 0 (FSDP2 shards on it) is >= 8, so no default model holds a parameter
    shorter than the world size up to 8 ranks; none is divisible by 3, 4 or 8, so at 2, 3, 4 and
    8 ranks the last shard is short or some shards are empty."""
    rows = [p.shape[0] for p in models.build_model(name, 0).parameters()]
    assert min(rows) >= 8, rows
    assert not [n for n in rows if n % 3 == 0 or n % 4 == 0 or n % 8 == 0], rows
    for world_size in (2, 3, 4, 8):
        assert any(n % world_size for n in rows), (world_size, rows)
    # FSDP2's ceil(n / ws) shards: at 8 ranks some rank of each model holds an empty shard
    assert any(-(-n // 8) * 7 >= n for n in rows), rows


def test_clipped_step_plans_one_short_layer_case_per_world_size_above_1():
    prop = PROPERTIES["clipped_step"]
    narrow = dict(reductions=["mean"], dtypes=["float64"], samplings=["fixed"])
    cases = prop.plan(prop.with_defaults(Options.build("t", world_sizes=[1, 2, 4], models=["mlp", "transformer"],
                                                       **narrow)))
    short = [c for c in cases if c.config().get("model_kwargs") == dict(SHORT_LAYER_DIMS)]
    assert [c.world_size for c in short] == [2, 4]
    for c in short:
        assert c.isolate and c.spec.model == "transformer" and c.spec.model_kwargs == SHORT_LAYER_DIMS
        assert (c.spec.reduction, c.spec.dtype, c.spec.sampling) == ("mean", "float64", "fixed")
        # the one parameter shorter than the ranks: mlp_in (1 row) at every world size > 1
        built = models.build_model("transformer", 0, **dict(c.spec.model_kwargs))
        assert sorted(n for n, p in built.named_parameters() if p.shape[0] < c.world_size) == [
            "mlp_in.bias", "mlp_in.weight"]
    # a selection without the transformer has none
    mlp = prop.plan(prop.with_defaults(Options.build("t", world_sizes=[2], models=["mlp"], **narrow)))
    assert not [c for c in mlp if "model_kwargs" in c.config()]


# -- the diagnosis, from a rank's error -----------------------------------------------------------------
def _crash(message: str, world_size: int = 4) -> GroupResult:
    errors = {r: JobResult(rank=r, error=JobError("RuntimeError", message, "Traceback ...")) for r in range(world_size)}
    return GroupResult(status="error", world_size=world_size, backend="gloo", results=errors, diagnosis="rank_crash",
                       message=f"rank 0 raised RuntimeError: {message} (ranks {list(range(world_size))} all raised)")


def _case():
    prop = PROPERTIES["clipped_step"]
    return prop.plan(prop.with_defaults(Options.build("t", world_sizes=[4], models=["mlp"], reductions=["mean"],
                                                      dtypes=["float64"], samplings=["fixed"])))[0]


def test_dtensors_in_place_refusal_is_placement_mismatch():
    v = failure_verdict(_case(), _Failed(_crash(PLACEMENT_ERROR), 0, 1.0))
    assert (v.status, v.diagnosis) == ("error", "placement_mismatch")
    assert "rank 0 was refused an in-place update across DTensor placements" in v.message
    assert "Spec(f64[3, 8](S(0))), Spec(f64[3, 8](R))" in v.message and "redistribute" in v.message
    assert "\n" not in v.message  # the rank's two-paragraph error in one line
    assert v.evidence["placement_error_rank"] == 0 and v.evidence["failed_ranks"] == [0, 1, 2, 3]


def test_any_other_crash_stays_rank_crash():
    v = failure_verdict(_case(), _Failed(_crash("cannot reshape tensor of 0 elements into shape [0, -1]"), 0, 1.0))
    assert (v.status, v.diagnosis) == ("error", "rank_crash") and "placement_error_rank" not in v.evidence


# -- end to end: upstream, the fixed adapter, Correct ---------------------------------------------------
def _short(target: str, pool):
    """clipped_step's short-layer case alone (the transformer's own case beside it is checked
    everywhere else), at 2 ranks on ``target``."""
    prop = PROPERTIES["clipped_step"]
    only_short = dataclasses.replace(prop, cases=lambda point: [
        c for c in prop.cases(point) if c.config().get("model_kwargs") == dict(SHORT_LAYER_DIMS)])
    verdicts = props.run(only_short, target, pool=pool, **SHORT_CASE)
    assert len(verdicts) == 1, [v.label for v in verdicts]
    return verdicts[0]


def test_upstream_short_layer_is_placement_mismatch_and_the_fix_passes(pool):
    up = _short("opacus", pool)
    assert (up.status, up.diagnosis) == ("error", "placement_mismatch"), up.message
    assert "Spec(f64[1, 10](S(0))), Spec(f64[1, 10](R))" in up.message
    for target in ("fixtures.placement_specimens:RedistributedGrad", "fixtures.specimens:Correct"):
        v = _short(target, pool)
        assert (v.status, v.diagnosis) == ("pass", None), (target, v.message)
        assert "DP step equals the reference at world_size=2" in v.message


@pytest.mark.slow
def test_a_new_bug_at_4_ranks_is_news_under_the_shipped_expectations(tmp_path, pool, monkeypatch, capsys):
    """The shipped entries hold at every world size, so they must not hide a new bug there:
    ``ClipsWrongFromFourRanks`` is right at 2 ranks and fails clipped_step at 4."""
    j = tmp_path / "r.json"
    r = run_gate(pool, monkeypatch, capsys, "run", "--target", "fixtures.placement_specimens:ClipsWrongFromFourRanks",
                 "--properties", "clipped_step", "--world-sizes", "2,4", "--models", "mlp", "--loss-reductions",
                 "mean", "--dtypes", "float64", "--sampling", "fixed", "--horizon", "0", "--wide-world-size", "0",
                 "--node-world-size", "0",
                 "--timeout", "180",
                 "--expect", "opacus-1.6.0",
                 "--json", str(j), "-q")
    assert r.returncode == 1, r.stderr
    report = json.loads(j.read_text())
    got = {v["config"]["world_size"]: (v["status"], v["diagnosis"], bool(v.get("expected"))) for v in report["results"]}
    assert got == {2: ("pass", None, False), 4: ("fail", "mismatch", False)}
    assert report["expectations"]["unexpected_failures"] == 1


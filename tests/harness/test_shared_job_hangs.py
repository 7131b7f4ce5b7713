"""A hang in a job that several configurations shared is put on the one configuration the ranks
were in (their progress trails), never on the others: those that finished keep their verdicts,
those not yet begun are run again (``properties.engine.runner._split_at_hang``). Specimens:
``fixtures/shared_job_specimens.py``."""

import pytest

import dpfsdp_verify.properties as props
from dpfsdp_verify.harness import wait_gone
from dpfsdp_verify.targets import progress

S = "fixtures.shared_job_specimens:"


def _statuses(vs, key):
    return sorted({(v.config[key], v.status, v.diagnosis) for v in vs})


def test_a_hang_only_in_float32_is_put_on_the_float32_configurations_alone(pool):
    before = set(pool.group(2).pids())
    vs = props.run("clipped_step", S + "HangsOnlyInFloat32", pool=pool, world_sizes=(2,), models=("mlp",),
                   reductions=("mean", "sum"), dtypes=("float64", "float32"), samplings=("fixed",),
                   precisions=("fp32",), timeout=20)
    # four configurations in one job, alternating float64 / float32: each float32 one is a proven
    # deadlock of its own, each float64 one passes
    assert len(vs) == 4
    assert _statuses(vs, "dtype") == [("float32", "hang", "deadlock"), ("float64", "pass", None)]
    hung = [v for v in vs if v.status == "hang"]
    assert all("the ranks' progress trails show the job hung in this one" in v.message for v in hung)
    assert all("shared_job_specimens.py" in v.message for v in hung)  # the proof names the stray barrier
    after = set(pool.group(2).pids())
    assert wait_gone(before - after) == [], "the hung group's ranks must be ended or reused"


@pytest.mark.slow
def test_two_configurations_hanging_one_after_the_other_are_both_named(pool):
    # mean float64, mean float32, sum float64, sum float32 ... per layout: the two sum configurations
    # hang back to back; the job had finished runs, so the retries go on to the end
    vs = props.run("norm_fidelity", S + "HangsOnlyForSum", pool=pool, world_sizes=(2,), models=("mlp",),
                   data_layouts=("replicated",), reductions=("mean", "sum"), dtypes=("float64", "float32"),
                   samplings=("fixed",), timeout=20)
    mlp = [v for v in vs if v.config["model"] == "mlp"]
    assert len(mlp) == 4
    assert _statuses(mlp, "reduction") == [("mean", "pass", None), ("sum", "hang", "deadlock")]
    assert all(v.status == "pass" for v in vs if v.config["model"] != "mlp")  # the layer zoo: mean only


def test_the_hung_run_is_the_first_some_rank_had_not_ended():
    t = progress.Trail
    # rank 0 ended runs 0 and 1 and is in run 2; rank 1 is still in run 1
    assert progress.hung_run_index([t(runs=3, ended=False), t(runs=2, ended=False)]) == 1
    # a rank that ended its last run is between runs: it waits at the next one
    assert progress.hung_run_index([t(runs=2, ended=True), t(runs=3, ended=False)]) == 2
    assert progress.hung_run_index([t(runs=0), t(runs=1)]) == 0  # a rank that began none
    assert progress.hung_run_index([t(runs=1), None]) is None  # a rank left no trail: cannot tell

"""Poisson sampling end to end: the sampling dimension of ``RunSpec``, the runner's
Poisson data check, progress trails, ``sampling_accounting`` and ``deadlock_free``'s Poisson
scenarios on the Poisson specimens (``fixtures/poisson_specimens.py``: one correct, one bug each),
``clipped_step`` / ``trajectory`` under Poisson sampling, and the fuzzer finding a step
divergence from a random start."""

from __future__ import annotations

import dataclasses
import json
import pickle
import random

import pytest
from hypothesis import find

from dpfsdp_verify import fuzz
from dpfsdp_verify import strategies as dps
from dpfsdp_verify.config.hypothesis_profiles import active_profile, profile_settings
from dpfsdp_verify.properties.engine.prechecks import poisson_problem
from dpfsdp_verify.targets import RankOutput, RunSpec, StepOutput, progress
from dpfsdp_verify.verdict import DIAGNOSES
import dpfsdp_verify.properties as props  # noqa: E402
from tests.verdict_helpers import assert_all_pass, by

P = "fixtures.poisson_specimens:"
#: a correct Poisson run takes well under a second; the property's own watchdog is 10 s
HANG_TIMEOUT = 30.0


def poisson(**kw) -> RunSpec:
    return RunSpec(**{"sampling": "poisson", "sample_rate": 0.25, "dataset_size": 8, "steps": 0, **kw})


# -- the spec: validation, identity, JSON ---------------------------------------------------
@pytest.mark.parametrize("kw, words", [
    (dict(sample_rate=0.0), "sample_rate q must be in (0, 1]"),
    (dict(sample_rate=1.5), "sample_rate q must be in (0, 1]"),
    (dict(sample_rate=float("nan")), "sample_rate q must be in (0, 1]"),
    (dict(seeding="global"), "unknown seeding policy 'global'"),
    (dict(sampling="shuffled"), "unknown sampling 'shuffled'"),
    (dict(dataset_size=0), "dataset_size must be a positive int"),
    (dict(sample_rate=0.1, dataset_size=5), "expected batch int(q * dataset_size)"),
    (dict(epochs=0), "epochs must be a positive int"),
])
def test_bad_poisson_specs_are_refused_with_a_clear_message(kw, words):
    with pytest.raises(ValueError, match=None) as e:
        poisson(**kw)
    assert words in str(e.value)


def test_dataset_smaller_than_world_size_is_refused():
    with pytest.raises(ValueError, match="dataset_size 2 is smaller than the world size 3"):
        poisson(dataset_size=2, sample_rate=1.0).check_world_size(3)
    poisson(dataset_size=3, sample_rate=1.0).check_world_size(3)


def test_poisson_spec_is_frozen_hashable_picklable_and_round_trips_json():
    s = poisson(seeding="per_rank", epochs=3, sampling_seed=2)
    assert pickle.loads(pickle.dumps(s)) == s and hash(s) == hash(pickle.loads(pickle.dumps(s)))
    assert fuzz.spec_from_json(fuzz.spec_to_json(s)) == s
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.sample_rate = 0.5
    assert (s.expected_batch_size, s.steps_per_epoch, s.nominal_steps) == (2, 4, 12)
    assert poisson(steps=5, epochs=3).nominal_steps == 5
    # opacus truncates: int(q * N)
    assert poisson(dataset_size=5, sample_rate=1 / 3).expected_batch_size == 1
    assert RunSpec().expected_batch_size == RunSpec().global_batch_size and not RunSpec().poisson


def test_new_diagnoses_are_registered():
    assert {"step_divergence", "correlated_sampling", "wrong_sample_rate"} <= set(DIAGNOSES)


# -- the runner's Poisson data check ----------------------------------------------------------
def outs(*per_rank):
    return [RankOutput(r, len(per_rank), [StepOutput(list(b), None, 0.0) for b in batches])
            for r, batches in enumerate(per_rank)]


def test_poisson_data_check():
    spec = poisson(dataset_size=4, sample_rate=0.5, epochs=2)  # 4 nominal steps
    assert poisson_problem(spec, 2, outs([[0], [], [2]], [[1], [3], []])) is None
    d, msg, ev = poisson_problem(spec, 2, outs([[0], [2], [0]], [[1], [3]]))
    assert d == "step_divergence" and "rank 0: 3, rank 1: 2" in msg
    assert ev["step_counts"] == [3, 2] and ev["local_batch_sizes"] == [[1, 1, 1], [1, 1]]
    d, msg, _ = poisson_problem(spec, 2, outs([[0, 1]], [[1]]))
    assert d == "mismatch" and "sample 1 was processed by rank 0 and again by rank 1" in msg
    d, msg, _ = poisson_problem(spec, 2, outs([[4]], [[1]]))
    assert d == "mismatch" and "drew index 4, not a dataset index" in msg
    d, msg, _ = poisson_problem(spec, 1, outs([[0]] * 5))
    assert d == "mismatch" and "at most 4" in msg
    d, msg, _ = poisson_problem(spec, 2, outs([], []))  # a target that ignores RunSpec.sampling
    assert d == "mismatch" and "does the target implement RunSpec.sampling" in msg


def test_progress_trails(tmp_path):
    progress.open_sink(str(tmp_path), 0)
    progress.run_begun("train")
    for k, n in enumerate((2, 0, 1)):
        progress.step_begun(k, n)
        progress.step_finished(k)
    progress.run_ended()
    progress.close_sink()
    progress.open_sink(str(tmp_path), 1)
    progress.run_begun("train")
    for k, n in enumerate((1, 1, 1, 2)):
        progress.step_begun(k, n)
        if k < 3:
            progress.step_finished(k)
    progress.close_sink()
    progress.step_begun(9, 9)  # outside a job: a no-op
    trails = progress.read(str(tmp_path), 3)
    assert trails[2] is None and progress.diverged(trails[:2])
    text = progress.describe(trails[:2])
    assert "rank 0 ended its run after 3 step(s) (local batches [2, 0, 1])" in text
    assert "rank 1 began step 4 (local batch 2) after 3 finished step(s) and never finished it" in text


# -- strategies ---------------------------------------------------------------------------------
def test_poisson_strategies_shrink_to_the_smallest_run():
    spec = find(dps.run_specs(2, models=("mlp",), sampling_values=("poisson",)), lambda s: True)
    assert (spec.sampling, spec.dataset_size, spec.epochs, spec.seeding) == ("poisson", 2, 1, "same")
    assert spec.sample_rate == 1.0 and spec.data_layout == "split"
    spec = find(dps.run_specs(2, models=("mlp",), sampling_values=("poisson",)),
                lambda s: s.dataset_size % 2 == 1 and s.sample_rate < 1)
    assert (spec.dataset_size, spec.sample_rate) == (3, 0.5)
    assert dps.opacus_sample_rate(41, 2, 1) == 1 / 21 and dps.opacus_sample_rate(16, 2, 2) == 0.25
    fixed = find(dps.run_specs(2, models=("mlp",)), lambda s: True)
    assert fixed.sampling == "fixed"


# -- sampling_accounting on the specimens -------------------------------------------------------
def sa(pool, target, **kw):
    kw.setdefault("timeout", 60)
    return props.run("sampling_accounting", P + target, pool=pool, **kw)


def test_correct_poisson_sampler_passes_every_policy_at_1_2_3_ranks(pool):
    vs = sa(pool, "PoissonCorrect", world_sizes=(1, 2, 3))
    assert len(vs) == 4 + 6 + 6  # world size 1: three seedings, and the fractional q = 0.3 once
    assert {v.config["seeding"] for v in vs} == {"same", "per_rank", "unseeded"}
    assert_all_pass(vs)
    assert all(v.evidence["steps"] >= 2000 for v in vs)


def test_sampler_correlated_across_ranks(pool):
    vs = sa(pool, "CorrelatedAcrossRanks", world_sizes=(2,), seedings=("same", "per_rank"))
    v, = by(vs, seeding="same", dataset="divisible")
    assert (v.status, v.diagnosis) == ("fail", "correlated_sampling"), v.message
    assert "ranks 0 and 1: their local batch sizes are correlated (r = 1.000" in v.message
    # indivisible: rank 0 draws 9 values a step, rank 1 draws 8 from the same stream, so the shared
    # values land in *other* steps; the suite's tests look at same-step correlation and do not claim it
    # seeded per rank, the same bug draws independent masks: nothing to see, and nothing is claimed
    assert_all_pass(by(vs, seeding="per_rank"))


def test_sample_rate_from_the_local_loader(pool):
    vs = sa(pool, "LocalSampleRate", world_sizes=(1, 2, 3), seedings=("per_rank",))
    assert_all_pass(by(vs, world_size=1))  # one rank: its shard is the dataset
    for ws in (2, 3):
        v, = by(vs, world_size=ws, dataset="divisible")
        assert (v.status, v.diagnosis) == ("fail", "wrong_sample_rate"), v.message
        assert "about the world size: q looks computed from a rank's local loader" in v.message
        assert abs(v.evidence["q_hat"] / v.evidence["q"] - ws) < 0.15 * ws


def test_skipping_empty_local_batches_is_a_step_divergence(pool):
    vs = sa(pool, "SkipEmptyLocalBatch", world_sizes=(1, 2))
    one = by(vs, world_size=1)
    assert [(v.status, v.diagnosis) for v in one] == [("fail", "wrong_sample_rate")] * 4  # fractional q too
    assert "steps whose batch came out empty are skipped" in one[0].message
    two = by(vs, world_size=2)
    seeded = [v for v in two if v.config["seeding"] != "unseeded"]
    assert [(v.status, v.diagnosis) for v in seeded] == [("fail", "step_divergence")] * 4
    assert len(set(seeded[0].evidence["step_counts"])) == 2
    # unseeded: the two ranks' counts (~1300 of 2000 each) coincide by chance ~1% of the time; the
    # skipped steps are then still caught, deterministically
    for v in by(two, seeding="unseeded"):
        assert (v.status, v.diagnosis) in {("fail", "step_divergence"), ("fail", "wrong_sample_rate")}, v.message
        assert v.diagnosis == "step_divergence" or "nominal steps were taken" in v.message


def test_target_without_a_data_pipeline_is_a_failure_not_a_skip(pool):
    vs = props.run("sampling_accounting", "fixtures.gate_specimens:WithoutDataPipeline", pool=pool,
                                           world_sizes=(2,), seedings=("same",))
    assert [v.status for v in vs] == ["fail", "fail"]
    assert "not checkable on this target" in vs[0].message and "implement Target.sample_batches" in vs[0].message


def test_fuzzer_finds_and_shrinks_a_step_divergence_from_a_random_start(pool):
    settings = profile_settings(active_profile() or "ci")
    seed = random.getrandbits(32)
    v, = fuzz.fuzz_property("sampling_accounting", P + "SkipEmptyLocalBatch", settings.max_examples, pool=pool,
                            world_sizes=(2,), seed=seed, settings=settings)
    why = (f"hypothesis seed {seed}", fuzz.format_failure(v))
    assert (v.status, v.diagnosis) == ("fail", "step_divergence"), why
    spec = v.evidence["spec"]
    assert (spec["dataset_size"], spec["sample_rate"], spec["seeding"]) == (3, 0.5, "same"), why
    assert v.repro.startswith(f"dpfsdp-verify replay --target {P}SkipEmptyLocalBatch --property sampling_accounting")
    assert fuzz.spec_from_json(json.dumps(spec)).poisson
    v, = fuzz.fuzz_property("sampling_accounting", P + "PoissonCorrect", settings.max_examples, pool=pool,
                            world_sizes=(2,), seed=seed, settings=settings)
    assert v.status == "pass", fuzz.format_failure(v)


# -- deadlock_free's Poisson scenarios ----------------------------------------------------------
ALL_POISSON = ("poisson_same", "poisson_per_rank", "poisson_unseeded")


def test_lock_step_poisson_target_never_hangs(pool):
    vs = props.run("deadlock_free", P + "PoissonCorrect", pool=pool, world_sizes=(2, 3), local_batches=ALL_POISSON,
                                     timeout=HANG_TIMEOUT)
    assert [(v.config["world_size"], v.config["local_batches"]) for v in vs] == [
        (ws, s) for ws in (2, 3) for s in ALL_POISSON]
    assert_all_pass(vs)
    # empty local batches did happen, and every rank still took every step
    sizes = [b for v in vs for rank in v.evidence["local_batch_sizes"] for b in rank]
    assert 0 in sizes and all(len(set(v.evidence["step_counts"])) == 1 for v in vs)


def test_skipping_empty_local_batches_hangs_and_says_so_in_dp_terms(pool):
    v, = props.run("deadlock_free", P + "SkipEmptyLocalBatch", pool=pool, world_sizes=(2,),
                                     local_batches=("poisson_same",), timeout=HANG_TIMEOUT)
    assert (v.status, v.diagnosis) == ("hang", "step_divergence"), v.message
    assert "rank 0 ended its run after 7 step(s)" in v.message
    assert "rank 1 began step 8" in v.message and "never finished it" in v.message
    assert "gloo:all_gather" in v.message and v.evidence["step_counts"] == [7, 8]
    assert v.seconds < HANG_TIMEOUT  # proven long before the deadline
    v, = props.run("deadlock_free", P + "SkipEmptyLocalBatch", pool=pool, world_sizes=(3,),
                                     local_batches=("poisson_per_rank",), timeout=HANG_TIMEOUT)
    assert (v.status, v.diagnosis) == ("hang", "step_divergence"), v.message
    assert v.evidence["step_counts"] == [6, 6, 5]


# -- clipped_step and trajectory under Poisson sampling -----------------------------------------
def test_clipped_step_and_trajectory_under_poisson_on_the_correct_specimen(pool):
    for prop in ("clipped_step", "trajectory"):
        vs = props.run(prop, P + "PoissonCorrect", pool=pool, world_sizes=(1, 2), models=("mlp",),
                              reductions=("mean", "sum"), samplings=("poisson",), timeout=60)
        assert vs and all(v.config["sampling"] == "poisson" for v in vs)
        assert_all_pass(vs)

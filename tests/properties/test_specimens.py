"""Every property passes on the correct specimen and fails, with the right diagnosis, on the
specimen built to break it. The specimens live in ``fixtures/specimens.py`` (one marked bug each).
"""

import json

import pytest

from dpfsdp_verify.harness import wait_gone
from dpfsdp_verify.verdict import DIAGNOSES, STATUSES
import dpfsdp_verify.properties as props  # noqa: E402
from tests.verdict_helpers import assert_all_pass, by, without_extra_noise_cases

S = "fixtures.specimens:"
IMMEDIATE = {"OPACUS_USE_DEFERRED_NORM": "0"}
DEFERRED = {"OPACUS_USE_DEFERRED_NORM": "1"}
#: short: the hang tests wait this long per hang (the specimens' steps take well under a second)
HANG_TIMEOUT = 6.0


def run(pool, prop, target, **kw):
    """The property's verdicts on a specimen; float64 and fixed sampling only unless a test asks for
    more (float32 and Poisson sampling are checked where a test says so: each doubles a property's
    cost; the Poisson path of the DP step is tested in test_poisson.py and the breadth tests)."""
    kw.setdefault("timeout", 60)
    kw.setdefault("dtypes", ("float64",))
    kw.setdefault("samplings", ("fixed",))
    out = props.run(prop, S + target, pool=pool, **kw)
    pid = prop if isinstance(prop, str) else prop.id
    for v in out:
        assert v.status in STATUSES and (v.diagnosis is None or v.diagnosis in DIAGNOSES)
        json.dumps(v.to_json())
        assert v.repro.startswith(f"dpfsdp-verify run --target {S}{target} --properties {pid} --world-sizes ")
        assert {"world_size", "data_layout", "model", "mode", "grad_sample_mode"} <= set(v.config)
    return out


# -- the correct specimen passes everything, both norm modes ------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("env", [IMMEDIATE, DEFERRED], ids=["immediate", "deferred"])
def test_correct_specimen_norms_both_layouts(pool, env):
    vs = run(pool, "norm_fidelity", "Correct", world_sizes=(1, 2), modes={"m": env}, reductions=("mean",),
             dtypes=("float64", "float32"))
    # world sizes x models (mlp, transformer) x layouts x dtypes, + the layer zoo once per world size
    assert len(vs) == 2 * 2 * 2 * 2 + 2
    assert {v.config["dtype"] for v in vs} == {"float64", "float32"}
    assert_all_pass(vs)
    assert all("it clips with them" in v.message for v in vs)


@pytest.mark.slow
def test_correct_specimen_step_sensitivity_noise_trajectory(pool):
    for prop in ("clipped_step", "sensitivity_bound", "noise_calibration", "trajectory"):
        assert_all_pass(run(pool, prop, "Correct", world_sizes=(2,), models=("mlp",)))


@pytest.mark.slow  # moved out of the README command to keep it near 5 min (CI runs it)
def test_correct_specimen_transformer_step_sum_reduction(pool):
    assert_all_pass(run(pool, "clipped_step", "Correct", world_sizes=(2,), models=("transformer",),
                        reductions=("sum",)))


@pytest.mark.slow  # moved out of the README command to keep it near 5 min (CI runs it)
def test_correct_specimen_modes_equivalent_and_deadlock_free(pool):
    modes = {"immediate": IMMEDIATE, "deferred": DEFERRED}
    vs = run(pool, "mode_equivalence", "Correct", world_sizes=(2,), modes=modes, models=("mlp",))
    assert_all_pass(vs)
    assert vs[0].config["mode"] == "immediate vs deferred"
    assert "--mode-env immediate:OPACUS_USE_DEFERRED_NORM=0" in vs[0].repro
    assert "--mode-env deferred:OPACUS_USE_DEFERRED_NORM=1" in vs[0].repro
    vs = run(pool, "deadlock_free", "Correct", world_sizes=(2,))
    assert {v.config["local_batches"] for v in vs} == {"even", "single", "uneven", "empty", "poisson_same",
                                                       "poisson_per_rank", "uneven_accum", "poisson_per_rank_accum",
                                                       "history_twice"}
    assert_all_pass(vs)


# -- one bug each -------------------------------------------------------------------------------
def test_allreduce_norms_is_sqrt_n_inflation_on_replicated_and_mixing_on_split(pool):
    vs = run(pool, "norm_fidelity", "AllReduceNorms", world_sizes=(1, 2), models=("mlp",), reductions=("mean",))
    assert_all_pass(by(vs, world_size=1))  # invisible at one rank: the fork's own check could not see it
    rep, = by(vs, world_size=2, data_layout="replicated")
    assert (rep.status, rep.diagnosis) == ("fail", "sqrt_n_inflation")
    assert "inflated by sqrt(2)" in rep.message and "already complete" in rep.message
    spl, = by(vs, world_size=2, data_layout="split", model="mlp")
    assert (spl.status, spl.diagnosis) == ("fail", "sample_mixing")
    assert "root-sum-square" in spl.message


def test_allreduce_norms_over_clips_the_step(pool):
    vs = run(pool, "clipped_step", "AllReduceNorms", world_sizes=(2,), models=("mlp",), reductions=("mean",))
    assert [(v.status, v.diagnosis) for v in vs] == [("fail", "mismatch")]
    assert "norms this rank clipped with overcount the true norms" in vs[0].message


def test_shard_only_norms_undercount_and_violate_sensitivity(pool):
    vs = run(pool, "norm_fidelity", "ShardOnlyNorms", world_sizes=(2,), models=("mlp",), reductions=("mean",))
    assert [(v.status, v.diagnosis) for v in vs] == [("fail", "undercount")] * 2
    assert "local parameter shard" in by(vs, data_layout="replicated")[0].message
    vs = run(pool, "sensitivity_bound", "ShardOnlyNorms", world_sizes=(2,), models=("mlp",))
    assert [(v.status, v.diagnosis) for v in vs] == [("fail", "undercount")]
    assert "PRIVACY VIOLATION" in vs[0].message and vs[0].evidence["max_ratio_to_C"] > 1.1


def test_no_clip_min_fails_the_step_but_not_sensitivity(pool):
    vs = run(pool, "clipped_step", "NoClipMin", world_sizes=(2,), models=("mlp",), reductions=("mean",))
    assert [(v.status, v.diagnosis) for v in vs] == [("fail", "mismatch")]
    assert "not capped at 1" in vs[0].message
    # scaling small gradients *up* to C never exceeds C: sensitivity honestly holds
    assert_all_pass(run(pool, "sensitivity_bound", "NoClipMin", world_sizes=(2,), models=("mlp",)))


@pytest.mark.parametrize("target, diagnosis, words", [
    ("NoiseOnEveryRank", "mismatch", ["PRIVACY VIOLATION", "too little noise", "1/sqrt(N)"]),
    ("NoiseDividedTwice", "mismatch", ["PRIVACY VIOLATION", "too little noise", "1/N"]),
    ("NoiseNotDivided", "mismatch", ["UTILITY LOSS", "too much noise"]),
    ("SameNoiseOnEveryShard", "dependent_noise", ["PRIVACY VIOLATION", "shards of", "ranks seeded alike"]),
    # each of these passed when every coordinate of every tensor was pooled into one test
    ("UnnoisedLastTensor", "mismatch", ["PRIVACY VIOLATION", "no noise at all on 8 of 8 coordinates of "
                                        "'fc2.bias'"]),
    ("NoiseOnRankZeroOnly", "mismatch", ["PRIVACY VIOLATION", "no noise at all", "rank 1's shard"]),
    ("NoiseReusedAcrossSteps", "dependent_noise", ["PRIVACY VIOLATION", "identical at steps 0 and 1",
                                                   "re-seeded every step"]),
])
@pytest.mark.slow
def test_noise_bugs(pool, target, diagnosis, words):
    # the warm ranks' verdict only: the fresh-process case is judged in test_noise_distribution.py
    main = run(pool, without_extra_noise_cases(), target, world_sizes=(2,), models=("mlp",),
               reductions=("mean",))
    assert [(v.status, v.diagnosis) for v in main] == [("fail", diagnosis)]
    for w in words:
        assert w in main[0].message


@pytest.mark.slow
def test_noise_power_is_stated_and_meets_the_target(pool):
    vs = run(pool, "noise_calibration", "Correct", world_sizes=(1,), reductions=("sum",))
    assert_all_pass(vs)
    v = next(v for v in vs if v.config.get("processes") != "fresh")
    # a 5% std error either way on every shard of >= POWER_MIN_NUMEL coordinates: >= 99% probability
    assert v.evidence["detects_std_error_big_shards"] <= 0.05
    assert "with 99% probability" in v.message
    # one rank: the zero-noise check is per rank-owned shard, and rank 0 does add its noise
    assert_all_pass(run(pool, "noise_calibration", "NoiseOnRankZeroOnly", world_sizes=(1,), reductions=("mean",)))


def test_clipping_with_other_norms_than_reported_is_caught(pool):
    vs = run(pool, "norm_fidelity", "ClipsWithAllReducedNorms", world_sizes=(1, 2), models=("mlp",),
             reductions=("mean",), dtypes=("float64",))
    assert_all_pass(by(vs, world_size=1))
    rep, = by(vs, world_size=2, data_layout="replicated")
    spl, = by(vs, world_size=2, data_layout="split", model="mlp")
    assert (rep.status, rep.diagnosis, spl.status, spl.diagnosis) == ("fail", "sqrt_n_inflation", "fail",
                                                                      "sample_mixing")
    for v in (rep, spl):
        assert v.message.startswith("reports the true per-sample norms but clips with other ones")
        assert v.evidence["ratio_min"] == pytest.approx(1.0)  # what it reports is right


def test_a_target_reporting_no_norms_is_judged_on_what_it_clips_with(pool):
    vs = run(pool, "norm_fidelity", "NoNormsReported", world_sizes=(2,), models=("mlp",), reductions=("mean",),
             dtypes=("float64",))
    assert_all_pass(vs)
    assert all("reports no per-sample norms" in v.message for v in vs)


@pytest.mark.parametrize("prop, extra", [
    ("norm_fidelity", {"data_layouts": ("split",)}), ("clipped_step", {}), ("trajectory", {}),
    ("sensitivity_bound", {}), ("noise_calibration", {}),
    ("deadlock_free", {"local_batches": ("even",)}),
    ("mode_equivalence", {"modes": {"immediate": IMMEDIATE, "deferred": DEFERRED}}),
])
@pytest.mark.slow
def test_nan_is_a_non_finite_failure_everywhere(pool, prop, extra):
    vs = run(pool, prop, "NaNClipCoefficients", world_sizes=(2,), models=("mlp",), reductions=("mean",),
             dtypes=("float64",), **extra)
    # noise_calibration's fresh-process case, its two exact-only cases and its one-row case (its bf16 case
    # needs float32) release NaN too, and so do trajectory's noisy-update cases (float64, and float32 since
    # the release judge needs one)
    assert [(v.status, v.diagnosis) for v in vs] == [("fail", "non_finite")] * (
        {"noise_calibration": 5, "trajectory": 3}.get(prop, 1))
    assert "NaN" in vs[0].message and "rank 0, step 0" in vs[0].message


def test_duplicated_samples_and_early_return_are_named(pool):
    for prop in ("clipped_step", "trajectory"):
        vs = run(pool, prop, "DuplicatedSamples", world_sizes=(2,), models=("mlp",), reductions=("mean",),
                 dtypes=("float64",))
        # trajectory: its noisy-update cases too (float64, float32)
        assert len(vs) == (3 if prop == "trajectory" else 1)
        for v in vs:
            assert (v.status, v.diagnosis) == ("fail", "mismatch")
            assert "rank 1, step 0: processed samples" in v.message and "foreign" in v.message
    vs = run(pool, "deadlock_free", "EarlyReturn", world_sizes=(2,), local_batches=("even",))
    assert [(v.status, v.diagnosis) for v in vs] == [("fail", "mismatch")]
    assert "ranks 0, 1 took 1 step(s) where 2 were asked for" in vs[0].message


def test_a_bug_only_visible_in_float32(pool):
    vs = run(pool, "clipped_step", "HalfPrecisionCoefficients", world_sizes=(2,), models=("mlp",),
             reductions=("mean",), dtypes=("float64", "float32"), precisions=("fp32",))
    assert [(v.config["dtype"], v.status) for v in vs] == [("float64", "pass"), ("float32", "fail")]
    vs = run(pool, "norm_fidelity", "HalfPrecisionCoefficients", world_sizes=(2,), models=("mlp",),
             reductions=("mean",), data_layouts=("split",), dtypes=("float32",))
    assert [v.status for v in vs] == ["fail"]
    assert "reports the true per-sample norms but clips with other ones" in vs[0].message


def test_stale_activations_pass_one_step_but_drift_over_steps(pool):
    assert_all_pass(run(pool, "clipped_step", "StaleActivations", world_sizes=(2,), models=("mlp",),
                        reductions=("mean",)))
    vs = by(run(pool, "trajectory", "StaleActivations", world_sizes=(2,), models=("mlp",), reductions=("mean",)),
            momentum=None)  # the noise-0 trajectory (not the noisy-update case)
    assert [(v.status, v.diagnosis) for v in vs] == [("fail", "mismatch")]
    assert "step 2 of 6" in vs[0].message


def test_deferred_drops_layer_breaks_mode_equivalence(pool):
    modes = {"immediate": IMMEDIATE, "deferred": DEFERRED}
    vs = run(pool, "mode_equivalence", "DeferredDropsLayer", world_sizes=(2,), modes=modes, models=("mlp",))
    assert [(v.status, v.diagnosis) for v in vs] == [("fail", "mismatch")]
    assert "mode 'immediate' matches the float64 reference, mode 'deferred' does not" in vs[0].message
    vs = run(pool, "norm_fidelity", "DeferredDropsLayer", world_sizes=(2,), modes={"deferred": DEFERRED},
             models=("mlp",), data_layouts=("split",), reductions=("mean",))
    assert [(v.status, v.diagnosis) for v in vs] == [("fail", "undercount")]


def test_hook_collective_hangs_are_reported_and_cleaned_up(pool):
    before = set(pool.group(2).pids())
    vs = run(pool, "deadlock_free", "HookCollective", world_sizes=(2,), local_batches=("even",),
             timeout=HANG_TIMEOUT)
    assert [(v.status, v.diagnosis) for v in vs] == [("hang", "deadlock")]
    assert "gloo:barrier" in vs[0].message and "on_backprop" in vs[0].message
    # a proven deadlock frees the ranks and keeps them warm; any other hang ends them: either
    # way no rank is left stuck, and the same key runs a correct job next
    after = set(pool.group(2).pids())
    assert wait_gone(before - after) == [], "the hung group's ranks must be ended or reused"
    assert [v.status for v in run(pool, "clipped_step", "Correct", world_sizes=(2,), models=("mlp",),
                                  reductions=("mean",))] == ["pass"]
    # a hang inside any other property is that property's verdict, not the caller's hang
    vs = run(pool, "norm_fidelity", "HookCollective", world_sizes=(2,), models=("mlp",), data_layouts=("split",),
             reductions=("mean", "sum"), timeout=HANG_TIMEOUT)
    # the two shared one job: it hung in its first configuration, so the other is not run (no hang
    # is claimed for it; a target hanging everywhere would cost a proof per configuration)
    assert [(v.status, v.diagnosis) for v in vs] == [("hang", "deadlock"), ("skip", None)]
    assert "the ranks' progress trails show the job hung in this one" in vs[0].message
    assert vs[1].message.startswith("not run: the job it shared hung in norm_fidelity [ws=2 split mlp mean")


def test_skip_empty_batch_deadlocks_only_on_empty_local_batch(pool):
    vs = run(pool, "deadlock_free", "SkipEmptyBatch", world_sizes=(2,), local_batches=("uneven", "empty"),
             timeout=HANG_TIMEOUT)
    assert [(v.config["local_batches"], v.status, v.diagnosis) for v in vs] == [
        ("uneven", "pass", None), ("empty", "hang", "deadlock")]
    assert "all_gather" in vs[1].message


def test_target_that_cannot_load_is_a_rank_crash_verdict(pool):
    vs = run(pool, "clipped_step", "NoSuchSpecimen", world_sizes=(2,), models=("mlp",), reductions=("mean",))
    assert [(v.status, v.diagnosis) for v in vs] == [("error", "rank_crash")]
    assert "TargetLoadError" in vs[0].message and "NoSuchSpecimen" in vs[0].message

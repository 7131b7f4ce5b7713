"""Privacy step accounting and resume, as the audit found them escaping (specimens:
``fixtures/audit_loop_specimens.py``): the runner's generic step-count check
(``prechecks.privacy_steps_problem``, ``step_count_wrong``) on every run that reports
``StepOutput.privacy_steps``, and checkpoint_resume's cross-rank noise / sampler checks and its
mid-epoch mask run -- each specimen fails with its property and diagnosis, ``Correct`` passes.
"""

from __future__ import annotations

import pytest

import dpfsdp_verify.properties as props
from dpfsdp_verify.properties.training.checkpoint_resume import _count_error
from dpfsdp_verify.properties.engine.prechecks import privacy_steps_problem
from dpfsdp_verify.targets import RankOutput, RunSpec, StepOutput
from tests.verdict_helpers import assert_all_pass

A = "fixtures.audit_loop_specimens:"
CORRECT = "fixtures.specimens:Correct"


def _ranks(counts, sizes=None, passes=None):
    """Rank outputs reporting ``counts[rank][step]`` (local batch sizes ``sizes``, physical passes ``passes``)."""
    out = []
    for r, row in enumerate(counts):
        steps = []
        for j, c in enumerate(row):
            n = sizes[r][j] if sizes else 1
            steps.append(StepOutput(indices=list(range(n)), norms=None, loss=0.0, privacy_steps=c,
                                    physical_batches=[1] * passes[r][j] if passes else None))
        out.append(RankOutput(rank=r, world_size=len(counts), steps=steps))
    return out


# -- the generic check, on made-up reports (no ranks) -----------------------------------------------
def test_privacy_steps_one_per_step_passes_and_unreported_is_not_judged():
    spec = RunSpec(steps=3)
    assert privacy_steps_problem(spec, _ranks([[1, 2, 3], [1, 2, 3]])) is None
    assert privacy_steps_problem(spec, _ranks([[None] * 3, [None] * 3])) is None


def test_privacy_steps_per_pass_is_named():
    spec = RunSpec(steps=3, physical_batch_size=2)
    d, msg, ev = privacy_steps_problem(spec, _ranks([[2, 4, 5]], passes=[[2, 2, 1]]))
    assert d == "step_count_wrong" and "one step per physical pass" in msg and "too large" in msg
    assert ev["privacy_steps"] == [[2, 4, 5]]


def test_privacy_steps_skipping_empty_batches_is_named_and_ranks_differ():
    spec = RunSpec(steps=3)
    d, msg, _ = privacy_steps_problem(spec, _ranks([[1, 2, 3], [1, 1, 2]], sizes=[[1, 1, 1], [1, 0, 1]]))
    assert d == "step_count_wrong" and "rank 1" in msg and "local batch on this rank was empty" in msg
    assert "PRIVACY VIOLATION" in msg and "the ranks' counts differ" in msg


def test_privacy_steps_of_a_resumed_half_count_from_where_it_starts():
    spec = RunSpec(steps=4, resume_at=2, phase="load", checkpoint_dir="d")
    # where it starts is checkpoint_resume's to judge; one per step from there is the runner's
    assert privacy_steps_problem(spec, _ranks([[3, 4], [3, 4]])) is None
    assert privacy_steps_problem(spec, _ranks([[1, 2], [1, 2]])) is None
    d, msg, _ = privacy_steps_problem(spec, _ranks([[3, 3], [3, 3]]))
    assert d == "step_count_wrong" and "does not advance at step 3" in msg
    d, msg, _ = privacy_steps_problem(spec, _ranks([[3, 4], [1, 2]]))
    assert d == "step_count_wrong" and "counts differ" in msg


def test_resume_step_count_wording():
    assert "counts from 1 again" in _count_error([1, 2, 1, 2], [1, 2, 3, 4], 2)
    stalled = _count_error([1, 2, 2, 3], [1, 2, 3, 4], 2)
    assert "does not advance at the first step after the resume" in stalled and "again" not in stalled
    assert "stays at 2" in stalled
    assert "continues from 1, not 3: the accountant lost 2 of the 3" in _count_error([1, 2, 3, 2], [1, 2, 3, 4], 3)
    assert "already before the checkpoint" in _count_error([2, 4, 5, 6], [1, 2, 3, 4], 2)
    assert "counts steps that were not taken" in _count_error([1, 2, 5, 6], [1, 2, 3, 4], 2)


# -- on ranks ---------------------------------------------------------------------------------------
def test_count_per_pass_fails_mode_equivalence(pool):
    vs = props.run("mode_equivalence", A + "PrivacyStepsCountPasses", pool=pool, world_sizes=(1,), models=("mlp",),
                   timeout=120)
    assert vs and all((v.status, v.diagnosis) == ("fail", "step_count_wrong") for v in vs), [v.message for v in vs]
    assert all("one step per physical pass" in v.message for v in vs)


def test_skip_empty_fails_poisson_trajectory(pool):
    # a dataset of 2 samples a rank (q = 1/4): some rank's batch comes out empty in all but ~5e-5 of runs
    # (the trajectory's own Poisson cases draw 64 a rank, so that empty batches essentially never happen)
    vs = props.run("trajectory", A + "PrivacyStepsSkipEmpty", pool=pool, world_sizes=(2,), models=("mlp",),
                   reductions=("mean",), samplings=("poisson",), dataset_size=4, timeout=120)
    assert vs and all((v.status, v.diagnosis) == ("fail", "step_count_wrong") for v in vs), [v.message for v in vs]
    assert all("local batch on this rank was empty" in v.message for v in vs)


def test_correct_counts_one_per_step(pool):
    assert_all_pass(props.run("mode_equivalence", CORRECT, pool=pool, world_sizes=(1,), models=("mlp",), timeout=120))
    assert_all_pass(props.run("trajectory", CORRECT, pool=pool, world_sizes=(2,), models=("mlp",),
                              reductions=("mean",), samplings=("poisson",), timeout=120))


# -- checkpoint_resume: ranks that all restore rank 0's random state -------------------------------
@pytest.mark.parametrize("name, diagnosis, words", [
    # uneven shards (the default models' rows do not divide by 2) leave the ranks' restored streams at
    # different offsets: equal places differ, the stream-level comparison finds the shared values
    ("ResumeNoiseFromRankZero", "dependent_noise", "different ranks draw their noise from one stream"),
    ("ResumeSamplerFromRankZero", "correlated_sampling", "draw the same Poisson mask over their shards"),
])
@pytest.mark.slow
def test_resume_from_rank_zero_fails(pool, name, diagnosis, words):
    [v] = props.run("checkpoint_resume", A + name, pool=pool, world_sizes=(2,), timeout=120)
    assert (v.status, v.diagnosis) == ("fail", diagnosis), v.message
    assert words in v.message and " Also: " not in v.message  # one bug, one finding


# -- checkpoint_resume: a mid-epoch resume ---------------------------------------------------------
def test_sampler_saved_at_epoch_start_fails_the_mid_epoch_resume(pool):
    """The default k = 2 is an epoch boundary at q = 0.5, where an epoch-start sampler state is
    right; the second mask run (q = 1/3, 3 steps per epoch) resumes mid-epoch and sees the replay."""
    [v] = props.run("checkpoint_resume", A + "ResumeSamplerAtEpochStart", pool=pool, world_sizes=(1,), timeout=120)
    assert (v.status, v.diagnosis) == ("fail", "mask_replayed"), v.message
    assert "is mid-epoch (epochs of int(1/q) = 3 steps)" in v.message and " Also: " not in v.message
    assert v.evidence["mid_epoch"]["mask_false_alarm_bound"] < 1e-11


@pytest.mark.slow
def test_correct_passes_both_resumes_and_cross_rank_checks(pool):
    [v] = props.run("checkpoint_resume", CORRECT, pool=pool, world_sizes=(2,), timeout=120)
    assert v.status == "pass", v.message
    assert "mid-epoch resume at step 2" in v.message and "no two ranks' noise shards are equal" in v.message
    assert v.evidence["cross_rank_mask_false_alarm_bound"] < 1e-9
    # the stream-level comparison: the shared values it needs, and its stated false-alarm bound
    assert "no rank's noise values turn up among another's" in v.message
    assert v.evidence["cross_rank_stream_shared_needed"] >= 4
    assert v.evidence["cross_rank_stream_false_alarm_bound"] < 1e-12

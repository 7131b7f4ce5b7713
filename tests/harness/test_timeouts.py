"""Deadlines: a deadline that passes with no deadlock proven is ``hang`` / ``timeout`` naming the
busy rank(s), never ``deadlock`` or ``step_divergence``; a case's built-in deadline never exceeds the
user's timeout and is raised by a longer one (``runner.case_deadline``). The slow specimen
(``fixtures/slow_specimens.py``: correct, ~1 s per step) is the false alarm this guards against."""

from __future__ import annotations

import json
import time
from importlib import resources

import pytest

from dpfsdp_verify.harness import DEFAULT_TIMEOUT_S, wait_gone
from dpfsdp_verify.properties.hangs.check import POISSON_DEADLINE_S
from dpfsdp_verify.properties.engine.runner import case_deadline
from dpfsdp_verify.targets import progress
from dpfsdp_verify.verdict import DIAGNOSES
import dpfsdp_verify.properties as props  # noqa: E402

SLOW = "fixtures.slow_specimens:SlowCorrect"
P = "fixtures.poisson_specimens:"
SHORT = 4.0


def test_case_deadline_rule():
    # no built-in deadline: the timeout itself
    assert case_deadline(None, 7.0) == 7.0
    # at the default timeout: the built-in deadline
    assert case_deadline(POISSON_DEADLINE_S, DEFAULT_TIMEOUT_S) == POISSON_DEADLINE_S
    # a user timeout shorter than the built-in deadline is honoured
    assert case_deadline(POISSON_DEADLINE_S, SHORT) == SHORT
    assert case_deadline(30.0, 20.0) == 20.0
    # a longer timeout raises it in proportion; never beyond the timeout
    assert case_deadline(30.0, 4 * DEFAULT_TIMEOUT_S) == 4 * 30.0
    for deadline in (1.0, 10.0, 30.0, 59.0, 200.0):
        for timeout in (0.5, 4.0, 30.0, 60.0, 61.0, 600.0):
            got = case_deadline(deadline, timeout)
            assert got <= timeout and (got >= min(deadline, timeout))


def test_timeout_is_a_diagnosis_of_the_report_schema():
    schema = json.loads(resources.files("dpfsdp_verify").joinpath("schema/report.schema.json").read_text())
    enum = schema["$defs"]["diagnosis"]["enum"]
    assert "timeout" in DIAGNOSES and set(enum) == set(DIAGNOSES) | {None}


def test_step_counts_differing_mid_step_are_no_divergence(tmp_path):
    """A rank one step ahead of another (mid-step) proves nothing; a rank that *ended* its run
    after n steps while another began more does."""
    for rank, steps in ((0, 3), (1, 2)):
        progress.open_sink(str(tmp_path), rank)
        progress.run_begun("train")
        for k in range(steps):
            progress.step_begun(k, 1)
        progress.close_sink()
    trails = progress.read(str(tmp_path), 2)
    assert [t.begun for t in trails] == [3, 2] and not progress.diverged(trails)
    assert "had not finished it when the deadline passed" in progress.describe(trails, proven=False)
    progress.open_sink(str(tmp_path), 1)
    progress.run_ended()
    progress.close_sink()
    assert progress.diverged(progress.read(str(tmp_path), 2))


def _assert_group_gone(pool, before):
    after = set(pool.group(2).pids())
    assert wait_gone(before - after) == [], "the timed-out group's ranks must be ended"


@pytest.mark.slow
def test_slow_correct_target_under_a_short_timeout_is_a_timeout_naming_the_busy_rank(pool):
    # warm: the ranks import the target (and opacus) once under a long deadline, so the short one
    # below times the target's own slowness, not a cold group's imports
    props.run("deadlock_free", SLOW, pool=pool, world_sizes=(2,), local_batches=("single",), timeout=120)
    before = set(pool.group(2).pids())
    t0 = time.monotonic()
    # the Poisson scenarios (12 steps of ~1 s; built-in deadline 30 s): the user's 4 s is honoured
    vs = props.run("deadlock_free", SLOW, pool=pool, world_sizes=(2,),
                                     local_batches=("poisson_same", "poisson_per_rank"), timeout=SHORT)
    elapsed = time.monotonic() - t0
    assert [v.config["local_batches"] for v in vs] == ["poisson_same", "poisson_per_rank"]
    for v in vs:
        assert (v.status, v.diagnosis) == ("hang", "timeout"), v.message
        assert f"no deadlock proven: the job did not finish within {SHORT:g} s" in v.message
        assert "busy outside any collective, still in the job: rank" in v.message  # "rank r" or "ranks 0, 1"
        assert "slow_specimens.py" in v.message and "in local_batches" in v.message  # the busy rank's site
        assert "never" not in v.message and "diverge" not in v.message
        assert v.evidence["busy_ranks"] and set(v.evidence["busy_ranks"]) <= {0, 1}
        assert v.seconds < SHORT + 10
    # the deadline was the user's 4 s, not the Poisson scenario's built-in 30 s
    assert elapsed < 2 * (SHORT + 10)
    _assert_group_gone(pool, before)


@pytest.mark.slow
def test_slow_correct_target_passes_the_poisson_scenarios_under_the_default_timeout(pool):
    """12 steps of ~1 s each: longer than the Poisson scenarios' former fixed 10 s deadline."""
    v, = props.run("deadlock_free", SLOW, pool=pool, world_sizes=(2,), local_batches=("poisson_same",))
    assert v.status == "pass", v.message
    assert v.evidence["step_counts"] == [12, 12] and v.seconds > 10.0


def test_proven_deadlocks_stay_proven_and_fast(pool):
    v, = props.run("deadlock_free", P + "SkipEmptyLocalBatch", pool=pool, world_sizes=(2,),
                                     local_batches=("poisson_same",))
    assert (v.status, v.diagnosis) == ("hang", "step_divergence"), v.message
    assert "deadlock proven after " in v.message and v.seconds < 15
    v, = props.run("deadlock_free", "fixtures.specimens:HookCollective", pool=pool, world_sizes=(2,),
                                     local_batches=("even",))
    assert (v.status, v.diagnosis) == ("hang", "deadlock"), v.message
    assert "deadlock proven after " in v.message and v.seconds < 15


def test_watch_reports_idle_time_and_an_unconfirmed_suspicion():
    """What a timeout's message reads from the proof's watch: per-rank time since a change was
    seen (or "at least" since first seen), and a proof that held but not for the quiet period."""
    from dpfsdp_verify.harness.proof import DeadlockWatch
    from dpfsdp_verify.harness.protocol import Probe

    ar = ("gloo:all_reduce", "[[5]]")

    def probe(rank, entries, done=6):
        return Probe(rank=rank, job_id=7, running=7, done=done, recent={"0": dict(entries)})

    w = DeadlockWatch(2, 7)
    w.update(probe(0, {2: ar}), now=10.0)
    w.update(probe(1, {2: ar}), now=10.0)
    w.update(probe(0, {2: ar, 3: ar}), now=11.0)   # rank 0 progressed
    w.update(probe(1, {2: ar}), now=11.0)          # rank 1 did not
    assert w.idle_for(14.0) == {0: (3.0, True), 1: (4.0, False)}
    # rank 1 still in the job: nothing to suspect
    assert w.candidate(set()) is None
    # rank 1 finished after #2: a proof, but only a suspicion until it holds for the quiet period
    w.update(probe(1, {2: ar}, done=7), now=11.5)
    assert "rank 1 can never issue" in w.candidate(set())
    assert w.check(set(), 11.6) is None

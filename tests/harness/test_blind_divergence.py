"""A pass-count divergence the flight recorder cannot see (issue 33 item 4): the ranks' progress
trails prove it, and the watchdog decides it as soon as the ranks are stalled (``harness/proof.py``,
``targets.progress.watch``), not at the deadline. On the specimens of ``fixtures/blind_specimens.py``
(FSDP and a logging all-reduce on process groups of their own: the default group's trace shows none
of their collectives) and on hand-made trails: what must be proven, and what never is (ranks at
different points of a correct run)."""

from __future__ import annotations

import os
import re

import pytest

from dpfsdp_verify.harness.proof import DeadlockWatch
from dpfsdp_verify.harness.protocol import Probe
from dpfsdp_verify.targets import progress
import dpfsdp_verify.properties as props  # noqa: E402
from tests.verdict_helpers import assert_all_pass

B = "fixtures.blind_specimens:"
ACCUM = ("uneven_accum", "poisson_per_rank_accum")


def run(pool, target, world_size=2, local_batches=("uneven_accum",), timeout=60):
    return props.run("deadlock_free", target, pool=pool, world_sizes=(world_size,), local_batches=local_batches,
                     dtypes=("float64",), timeout=timeout)


# -- end to end -----------------------------------------------------------------------------------
def test_a_pass_divergence_the_flight_recorder_cannot_see_is_step_divergence_in_seconds(pool):
    # the same group warm first (the correct twin passes): the verdict's seconds time the watchdog,
    # not the ranks' start-up on a loaded machine
    assert_all_pass(run(pool, B + "OwnGroupsCorrect"))
    [v] = run(pool, B + "BlindPassDivergence")
    assert (v.status, v.diagnosis) == ("hang", "step_divergence"), v.message
    # decided from the trails, within seconds, not at the accumulation case's 15 s deadline
    proven_after = float(re.search(r"step divergence proven after ([0-9.]+) s", v.message).group(1))
    assert proven_after < 10 and v.seconds < 10, (proven_after, v.seconds)
    assert "from the ranks' progress" in v.message
    assert ("in logical step 1, rank 0 had begun 2 physical passes in it; rank 1 finished it after 1 physical "
            "pass(es)") in v.message, v.message
    assert "deadlock proven" not in v.message  # the trace proved nothing: it saw none of it
    assert v.evidence["physical_passes_per_step"] == [[2], [1]]
    assert "the ranks stalled" in v.message and "in forward" in v.message and "in local_loss" in v.message


def test_the_blind_correct_target_and_a_slow_rank_are_never_divergent(pool):
    """Ranks legitimately at different passes or steps while nothing moves for twice the quiet
    period (rank 1 finished a step rank 0 is still in) are no divergence."""
    assert_all_pass(run(pool, B + "OwnGroupsCorrect", local_batches=ACCUM + ("uneven",)))
    vs = run(pool, B + "SlowStepEndOnRankZero", local_batches=ACCUM)
    assert_all_pass(vs)
    assert all(v.seconds > 2.0 for v in vs), [v.seconds for v in vs]  # the stalls happened


def test_a_group_whose_job_made_its_own_process_groups_is_replaced_not_renewed(pool):
    """A proven deadlock in a job that made process groups of its own (the blind specimen shards on
    one) ends that group instead of renewing it: renewed, the ranks handed upstream's next FSDP job
    a cached mesh on a group that no longer existed ("Could not resolve the process group
    registered under the name 1": every later 2-rank upstream case a rank crash)."""
    [v] = run(pool, B + "BlindPassDivergence")
    assert (v.status, v.diagnosis) == ("hang", "step_divergence"), v.message
    after = props.run("norm_fidelity", "opacus", pool=pool, world_sizes=(2,), models=("mlp",), reductions=("mean",),
                      dtypes=("float64",), data_layouts=("split",))
    assert [(x.status, x.diagnosis) for x in after] == [("pass", None)], [x.message for x in after]


@pytest.mark.slow
def test_three_ranks_diverging_blind_as_on_the_gpu_box(pool):
    """The GPU box's shape: local batches [3, 2, 1] in passes of 1 at 3 ranks."""
    assert_all_pass(run(pool, B + "OwnGroupsCorrect", world_size=3))  # warm, as above
    [v] = run(pool, B + "BlindPassDivergence", world_size=3)
    assert (v.status, v.diagnosis) == ("hang", "step_divergence") and v.seconds < 10, (v.seconds, v.message)
    assert "rank 2 finished it after 1 physical pass(es)" in v.message, v.message


# -- the trails' proof ----------------------------------------------------------------------------
def write(tmp_path, rank, lines, partial=""):
    with open(os.path.join(tmp_path, f"rank{rank}.progress"), "w") as f:
        f.write("".join(line + "\n" for line in lines) + partial)


def evidence(tmp_path, world_size=2):
    return progress.watch(str(tmp_path), world_size)()


def test_ranks_at_different_passes_of_a_correct_run_prove_nothing(tmp_path):
    # rank 1 is one pass ahead of rank 0 in step 1; then rank 1 finished step 1 after 2 passes
    # while rank 0 is still in its 2nd
    write(tmp_path, 0, ["run train", "begin 0 2", "pass 0 0 1"])
    write(tmp_path, 1, ["run train", "begin 0 2", "pass 0 0 1", "pass 0 1 1"])
    assert evidence(tmp_path)[1] is None
    write(tmp_path, 0, ["run train", "begin 0 2", "pass 0 0 1", "pass 0 1 1"])
    write(tmp_path, 1, ["run train", "begin 0 2", "pass 0 0 1", "pass 0 1 1", "end 0", "begin 1 2"])
    assert evidence(tmp_path)[1] is None
    # a rank that ended its run after 2 steps while another is in its 2nd: behind, not diverged
    write(tmp_path, 0, ["run train", "begin 0 2", "end 0", "begin 1 2"])
    write(tmp_path, 1, ["run train", "begin 0 2", "end 0", "begin 1 2", "end 1", "done"])
    assert evidence(tmp_path)[1] is None


def test_final_counts_that_differ_are_proven(tmp_path):
    write(tmp_path, 0, ["run train", "begin 0 3", "pass 0 0 1", "pass 0 1 1"])
    write(tmp_path, 1, ["run train", "begin 0 1", "pass 0 0 1", "end 0"])
    state, proof = evidence(tmp_path)
    assert proof == ("in logical step 1, rank 0 had begun 2 physical passes in it; rank 1 finished it after 1 "
                     "physical pass(es)")
    write(tmp_path, 0, ["run train", "begin 0 1", "end 0", "begin 1 1", "end 1", "begin 2 1"])
    write(tmp_path, 1, ["run train", "begin 0 1", "end 0", "begin 1 1", "end 1", "done"])
    assert evidence(tmp_path)[1] == "rank 1 ended its run after 2 step(s), while rank 0 began step 3"
    assert evidence(tmp_path)[0] != state  # the state moves with the trails


def test_trails_of_different_runs_or_a_line_being_written_prove_nothing(tmp_path):
    # rank 1 already in the job's next run (its trail restarts): not comparable with rank 0's
    write(tmp_path, 0, ["run a", "begin 0 1", "end 0", "begin 1 1"])
    write(tmp_path, 1, ["run a", "begin 0 1", "end 0", "begin 1 1", "end 1", "done", "run b", "begin 0 1"])
    assert evidence(tmp_path)[1] is None
    # "end 0" half written ("end" without its newline) is not read as a finished step
    write(tmp_path, 0, ["run a", "begin 0 3", "pass 0 0 1", "pass 0 1 1"])
    write(tmp_path, 1, ["run a", "begin 0 3", "pass 0 0 1"], partial="end")
    assert evidence(tmp_path)[1] is None


def _probe(rank, entries=None, error=None):
    return Probe(rank=rank, job_id=7, running=7, done=6, recent={"0": dict(entries or {})}, error=error)


def test_the_watch_decides_a_divergence_only_when_nothing_moved_for_the_quiet_period():
    watch = DeadlockWatch(2, job_id=7, quiet_s=0.5)
    for r in (0, 1):  # the recorder is off: no trace at all
        watch.update(_probe(r, error="RuntimeError: recorder off"))
    trail = {"state": 1, "proof": None}

    def ev():
        return trail["state"], trail["proof"]

    assert watch.check(set(), 10.0, ev) is None  # without evidence nothing could be proven
    assert watch.check(set(), 11.0) is None
    trail.update(state=2, proof="in logical step 1, ...")
    assert watch.check(set(), 12.0, ev) is None
    assert watch.check(set(), 12.3, ev) is None  # not quiet long enough
    trail["state"] = 3  # a rank wrote a line: the clock restarts
    assert watch.check(set(), 12.6, ev) is None
    assert watch.check(set(), 13.0, ev) is None
    assert watch.check(set(), 13.2, ev) == "in logical step 1, ..." and watch.proof_kind == "step_divergence"


def test_a_deadlock_proof_is_preferred_to_the_trails():
    ar = ("gloo:all_reduce", "[[5]]")
    watch = DeadlockWatch(2, job_id=7, quiet_s=0.0)
    watch.update(_probe(0, {2: ar}))
    watch.update(_probe(1, {2: ("gloo:barrier", "[]")}))

    def ev():
        return 0, "in logical step 1, ..."

    assert watch.check(set(), 1.0, ev) is None
    assert "issued different collectives as #2" in watch.check(set(), 2.0, ev) and watch.proof_kind == "deadlock"

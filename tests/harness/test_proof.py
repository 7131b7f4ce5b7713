"""The deadlock proof (harness/proof.py) on hand-made probes: what it must prove, what it must
never call a deadlock (a slow peer, legitimately different sizes), and the quiet period."""

from __future__ import annotations

from dpfsdp_verify.harness.proof import DeadlockWatch, stuck_reason
from dpfsdp_verify.harness.protocol import Probe

AR = ("gloo:all_reduce", "[[5]]")


def probe(rank, entries, running=True, job=7):
    return Probe(rank=rank, job_id=job, running=job if running else None, done=job - (1 if running else 0),
                 recent={"0": dict(entries)})


def test_a_rank_waiting_for_a_finished_peer_is_proven():
    probes = {0: probe(0, {2: AR, 3: AR}), 1: probe(1, {2: AR}, running=False)}
    reason = stuck_reason(probes, done={1})
    assert reason == ("rank 0 waits in collective #3 (gloo:all_reduce [[5]]), which rank 1 can never issue: "
                      "rank 1 finished the job after #2")


def test_a_slow_peer_still_in_the_job_is_not_a_deadlock():
    # rank 0 waits in #3; rank 1 is still in the job and has not issued #3 yet: it may
    assert stuck_reason({0: probe(0, {2: AR, 3: AR}), 1: probe(1, {2: AR})}, done=set()) is None


def test_different_ops_under_one_sequence_id_are_proven():
    probes = {0: probe(0, {2: AR}), 1: probe(1, {2: ("gloo:barrier", "[]")})}
    assert "issued different collectives as #2" in stuck_reason(probes, done=set())


def test_sizes_count_only_where_every_rank_must_agree():
    assert stuck_reason({0: probe(0, {2: ("gloo:all_reduce", "[[4]]")}),
                         1: probe(1, {2: ("gloo:all_reduce", "[[5]]")})}, done=set())
    # scatter's root passes the list, the others nothing: different sizes, one collective
    assert stuck_reason({0: probe(0, {2: ("gloo:scatter", "[[2], [2]]")}),
                         1: probe(1, {2: ("gloo:scatter", "[]")})}, done=set()) is None


def test_an_old_mismatch_both_ranks_got_past_proves_nothing_now():
    probes = {0: probe(0, {2: AR, 3: AR, 4: AR}), 1: probe(1, {2: ("gloo:barrier", "[]"), 3: AR, 4: AR})}
    assert stuck_reason(probes, done=set()) is None


def test_a_proof_must_hold_unchanged_for_the_quiet_period():
    watch = DeadlockWatch(2, job_id=7, quiet_s=1.0)
    stuck = [probe(0, {2: AR, 3: AR}), probe(1, {2: AR}, running=False)]
    for p in stuck:
        watch.update(p)
    assert watch.check(set(), now=10.0) is None
    assert watch.check(set(), now=10.5) is None
    # rank 0 moved on: the clock restarts
    watch.update(probe(0, {2: AR, 3: AR, 4: AR}))
    assert watch.check(set(), now=10.9) is None
    assert watch.check(set(), now=11.5) is None
    assert "rank 0 waits in collective #4" in watch.check(set(), now=12.0)


def test_answers_to_another_jobs_probe_are_ignored():
    watch = DeadlockWatch(2, job_id=8, quiet_s=0.0)
    watch.update(probe(0, {2: AR, 3: AR}, job=7))
    watch.update(probe(1, {2: AR}, running=False, job=7))
    assert watch.check(set(), now=1.0) is None and watch.check(set(), now=2.0) is None

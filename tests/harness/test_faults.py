"""The harness under injected faults: every fault is detected, classified, diagnosed, bounded in
time, and leaves no process behind."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from dpfsdp_verify.harness import BackendUnavailable, JobPicklingError, WorkerGroup, check_backend, wait_gone

HANG_TIMEOUT = 3.0
#: The deadline of tests that expect a *proven* deadlock (proved in ~1-2 s; a deadline that
#: passes first would be an honest ``timeout``, not the deadlock under test).
PROOF_TIMEOUT = 10.0
#: A hang verdict must not wait for gloo's own 30-minute timeout. This bound is about
#: boundedness, not speed (the latency target is measured by benchmarks/run.py), so it is
#: generous enough for a loaded 2-core runner.
VERDICT_BOUND = 20.0


def assert_gone(pids):
    assert wait_gone(pids) == [], "rank processes left behind"


def run_fault(pool, fn, timeout=HANG_TIMEOUT, **kw):
    """Run fn on a 2-rank group of the pool; return (result, elapsed). A failed group must be
    gone at once (its ranks, and its temp dir with the store file) -- unless it was a proven
    deadlock whose ranks were freed: then the same ranks must run the next job correctly."""
    g = pool.group(2)
    pids = g.pids()
    t0 = time.monotonic()
    res = pool.run(fn, world_size=2, timeout=timeout, **kw)
    elapsed = time.monotonic() - t0
    if res.recovered:
        assert not g.closed
        after = pool.run(job_sum, world_size=2, timeout=30)
        assert after.ok and [v[1] for v in after.values()] == [3.0, 3.0], after.message
        assert [v[2] for v in after.values()] == pids, "a recovered group keeps its warm ranks"
    elif not res.ok:
        # a failed group is ended at once: its store file and logs go with its temp dir
        assert g.closed and not os.path.exists(g.tmpdir)
        assert_gone(pids)
    return res, elapsed


# --- jobs (module level: shipped to ranks by reference) --------------------------------

def job_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return (dist.get_rank(), t.item(), os.getpid())


def job_mismatched():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(4))
    else:
        dist.all_gather([torch.ones(4), torch.ones(4)], torch.ones(4))


def job_skip_collective():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(5))


def job_extra_barrier():
    if dist.get_rank() == 1:
        dist.barrier()
    dist.all_reduce(torch.ones(5))


def job_raise():
    if dist.get_rank() == 1:
        raise AssertionError("norm 3.0 != 2.0 on rank 1")
    dist.all_reduce(torch.ones(2))


def job_exit3():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(2))


def job_sigkill():
    if dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(2))


def job_spin():
    if dist.get_rank() == 0:
        while True:  # the infinite loop under test
            pass
    dist.all_reduce(torch.ones(2))


def job_gather_sizes():
    r = dist.get_rank()
    out = [torch.zeros(2 + r) for _ in range(2)]
    dist.all_gather(out, torch.ones(2 + r))


def job_slow_rank(n=3, pause=2.5):
    """Slow but progressing: rank 1 sleeps before each collective while rank 0 waits in it."""
    total = 0.0
    for _ in range(n):
        if dist.get_rank() == 1:
            time.sleep(pause)
        t = torch.ones(3)
        dist.all_reduce(t)
        total += t.sum().item()
    return total


def job_sleep_outside_collectives():
    """A hang no probe can prove: rank 1 is stuck outside any collective, still in the job."""
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.all_reduce(torch.ones(2))


def job_pollute():
    os.environ["DPFSDP_LEAK"] = "1"
    torch.manual_seed(999)
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True, warn_only=True)
    assert torch.are_deterministic_algorithms_enabled()
    return torch.rand(1).item()


def job_observe():
    return (os.environ.get("DPFSDP_LEAK"), torch.get_default_dtype(), torch.rand(1).item(),
            torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())


def job_env(name):
    return os.environ.get(name)


# --- tests ------------------------------------------------------------------------------

def test_job_runs_on_every_rank_and_group_stays_warm(pool):
    res = pool.run(job_sum, world_size=2)
    assert res.ok, res.message
    (r0, s0, p0), (r1, s1, p1) = res.values()
    assert (r0, r1) == (0, 1) and s0 == s1 == 3.0
    again = pool.run(job_sum, world_size=2).values()
    assert [v[2] for v in again] == [p0, p1], "a healthy group must be reused, not respawned"


def test_mismatched_collectives_are_a_diagnosed_hang(pool):
    res, elapsed = run_fault(pool, job_mismatched, timeout=PROOF_TIMEOUT)
    assert (res.status, res.diagnosis) == ("hang", "deadlock")
    assert "mismatched collectives" in res.message
    assert "rank 0: gloo:all_reduce [[4]]" in res.message and "rank 1: gloo:all_gather" in res.message
    assert elapsed <= PROOF_TIMEOUT + VERDICT_BOUND


def test_skipped_collective_names_the_missing_rank(pool):
    res, elapsed = run_fault(pool, job_skip_collective, timeout=PROOF_TIMEOUT)
    assert (res.status, res.diagnosis) == ("hang", "deadlock")
    assert "gloo:all_reduce [[5]]" in res.message and "never by rank 1" in res.message
    assert "job_skip_collective" in res.message  # the Python call site of the stuck rank
    assert "missing ranks: {1}" in res.details  # torch's analyser, same conclusion
    assert elapsed <= PROOF_TIMEOUT + VERDICT_BOUND


def test_extra_barrier_on_one_rank(pool):
    res, elapsed = run_fault(pool, job_extra_barrier, timeout=PROOF_TIMEOUT)
    assert (res.status, res.diagnosis) == ("hang", "deadlock")
    assert "rank 1: gloo:barrier" in res.message and "rank 0: gloo:all_reduce [[5]]" in res.message
    assert "test_faults.py" in res.details  # stacks are attached
    # torch's own analyser (fr_trace) agrees, on the same traces
    assert "torch flight_recorder analyser" in res.details
    assert "Culprit rank 1; Error type: COLLECTIVE_TYPE_MISMATCH" in res.details


#: The deadline of the proof tests: far beyond the verdict they must give.
LONG_TIMEOUT = 60.0


@pytest.mark.parametrize("job, says", [
    (job_skip_collective, "rank 0 waits in collective #"),
    (job_extra_barrier, "issued different collectives as #"),
    (job_mismatched, "issued different collectives as #"),
])
def test_deadlock_is_proven_long_before_the_deadline(pool, job, says):
    res, elapsed = run_fault(pool, job, timeout=LONG_TIMEOUT)
    assert (res.status, res.diagnosis) == ("hang", "deadlock")
    assert res.message.startswith("deadlock proven after ") and f"before the {LONG_TIMEOUT:g} s deadline" in res.message
    assert says in res.message
    # the full diagnosis is the same as at a deadline: divergence, call sites, torch's analyser
    assert "never by rank 1" in res.message or "mismatched collectives at #" in res.message
    assert "torch flight_recorder analyser" in res.details
    assert elapsed < VERDICT_BOUND, "a proven deadlock must not wait for the deadline"


def test_a_recovered_group_diagnoses_its_next_deadlock_from_its_new_process_group(pool):
    first, _ = run_fault(pool, job_extra_barrier, timeout=LONG_TIMEOUT)
    assert first.recovered, first.details
    # the renewed group restarts its sequence ids: the old group's trace must not confuse the
    # next diagnosis
    second, elapsed = run_fault(pool, job_skip_collective, timeout=LONG_TIMEOUT)
    assert second.status == "hang" and second.message.startswith("deadlock proven")
    # renewed group: #1 its set-up barrier, #2 run_fault's check job; the aborted group's entries
    # (which went higher) are not mixed in
    assert ("collective #3 (gloo:all_reduce [[5]]) was issued by rank 0 but never by rank 1 (last issued #2)"
            in second.message)
    assert elapsed < VERDICT_BOUND


@pytest.mark.slow
def test_slow_but_progressing_job_is_not_a_deadlock(pool):
    # rank 0 waits ~2.5 s in each all_reduce, longer than the probes' quiet period, while
    # rank 1 sleeps outside any collective: slow, not stuck
    res = pool.run(job_slow_rank, world_size=2, timeout=LONG_TIMEOUT)
    assert res.ok, res.message
    assert res.values() == [18.0, 18.0]  # 3 all_reduces of ones(3) over 2 ranks
    assert res.seconds >= 3 * 2.5


def test_a_hang_outside_collectives_waits_for_the_deadline(pool):
    # nothing proves rank 1 would never come back: a timeout naming it, never a deadlock
    res, elapsed = run_fault(pool, job_sleep_outside_collectives, timeout=4.0)
    assert (res.status, res.diagnosis) == ("hang", "timeout")
    assert res.message.startswith("no deadlock proven: the job did not finish within 4 s")
    assert "busy outside any collective, still in the job: rank 1 (at " in res.message
    assert "in job_sleep_outside_collectives" in res.message and "no progress for at least " in res.message
    assert "rank 0 waited in collective #" in res.message and "gloo:all_reduce [[2]]" in res.message
    assert "never" not in res.message and "diverge" not in res.message + res.details
    assert res.busy_ranks == [1]
    assert 4.0 <= elapsed <= 4.0 + VERDICT_BOUND


class _Interrupt(BaseException):
    """Stands in for what pytest-timeout or Ctrl-C raise in the middle of a wait."""


@pytest.mark.slow
def test_an_interrupted_run_ends_the_group_and_the_next_job_is_clean(pool):
    g = pool.group(2)
    pids = g.pids()

    def interrupt(signum, frame):
        raise _Interrupt()

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.5)
        with pytest.raises(_Interrupt):
            pool.run(job_sleep_outside_collectives, world_size=2, timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert g.closed and not os.path.exists(g.tmpdir)
    assert_gone(pids)
    # the next job gets a fresh group and its own result, not the interrupted job's
    res = pool.run(job_sum, world_size=2, timeout=30)
    assert res.ok and [v[1] for v in res.values()] == [3.0, 3.0]
    assert not set(v[2] for v in res.values()) & set(pids)


def test_rank_raising_ends_group_at_once(pool):
    res, elapsed = run_fault(pool, job_raise, timeout=30)
    assert (res.status, res.diagnosis) == ("error", "rank_crash")
    assert res.message.startswith("rank 1 raised AssertionError: norm 3.0 != 2.0 on rank 1")
    assert "Traceback" in res.details and "job_raise" in res.details
    assert elapsed < VERDICT_BOUND, "survivors must not wait for the deadline"


@pytest.mark.parametrize("job, says", [(job_exit3, "rank 1 died (exit code 3)"),
                                       (job_sigkill, "rank 0 died (killed by SIGKILL)")])
def test_a_dying_rank_is_a_rank_crash_naming_exit_code_or_signal(pool, job, says):
    res, elapsed = run_fault(pool, job, timeout=30)
    assert (res.status, res.diagnosis) == ("error", "rank_crash")
    assert says in res.message
    assert elapsed < VERDICT_BOUND, "survivors must not wait for the deadline"


@pytest.mark.slow
def test_infinite_python_loop_is_located(pool):
    res, elapsed = run_fault(pool, job_spin)
    # a loop that never ends looks like a slow rank: a timeout naming it, not a proven deadlock
    assert (res.status, res.diagnosis) == ("hang", "timeout")
    assert "rank 0 (at " in res.message and res.busy_ranks == [0]
    assert "in job_spin" in res.message  # rank 0's call site: the loop
    assert elapsed <= HANG_TIMEOUT + VERDICT_BOUND


def test_all_gather_with_different_sizes(pool):
    res, elapsed = run_fault(pool, job_gather_sizes, timeout=HANG_TIMEOUT)
    # gloo detects the size mismatch and aborts the receiving rank; either way it is reported
    assert res.status in ("error", "hang") and res.diagnosis in ("rank_crash", "deadlock")
    text = res.message + res.details
    assert "rank" in res.message and ("size" in text or "all_gather" in text)


@pytest.mark.slow
def test_pool_recovers_after_faults(pool):
    res = pool.run(job_sum, world_size=2)
    assert res.ok and [v[1] for v in res.values()] == [3.0, 3.0]


def test_job_state_does_not_leak_between_jobs(pool):
    first = pool.run(job_pollute, world_size=2).values()
    leak, dtype, draw, deterministic, warn_only = pool.run(job_observe, world_size=2).values()[0]
    assert leak is None and dtype == torch.float32
    assert not deterministic and not warn_only, "torch.use_deterministic_algorithms leaked into the next job"
    torch.manual_seed(0)
    assert draw == torch.rand(1).item(), "every job starts from the same seed"
    assert first[0] != draw


@pytest.mark.slow
def test_env_jobs_get_their_own_ranks(pool):
    res = pool.run(job_env, "OPACUS_USE_DEFERRED_NORM", world_size=2, env={"OPACUS_USE_DEFERRED_NORM": "1"})
    assert res.values() == ["1", "1"]
    assert pool.run(job_env, "OPACUS_USE_DEFERRED_NORM", world_size=2).values() == [None, None]


def test_unpicklable_job_is_a_clear_error(pool):
    with pytest.raises(JobPicklingError, match="importable module-level"):
        pool.run(lambda: 1, world_size=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_nccl_without_gpus_is_unavailable_not_a_failure():
    with pytest.raises(BackendUnavailable, match="needs CUDA GPUs"):
        check_backend("nccl", 2)
    with pytest.raises(BackendUnavailable):
        WorkerGroup(2, backend="nccl")


def test_bad_backend_and_world_size():
    with pytest.raises(ValueError, match="unknown backend"):
        check_backend("mpi2", 2)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        check_backend("gloo", 0)

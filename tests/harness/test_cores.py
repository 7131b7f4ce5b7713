"""The cores a run shares out among its ranks (``harness/cores.py``): the plan at 1, 2, 16 and 64
cores with the core count mocked, ranks x threads <= cores, a user's ``OMP_NUM_THREADS`` winning,
the gate's pool sized by its plan, and a rank actually running on the planned threads."""

from __future__ import annotations

import os

import pytest

from dpfsdp_verify.gate import cli
from dpfsdp_verify.gate import scheduler
from dpfsdp_verify.gate import session as gate_session
from dpfsdp_verify.gate.plan import RunPlan
from dpfsdp_verify.harness import Pool, wait_gone
from dpfsdp_verify.harness import cores
from dpfsdp_verify.harness.launch import rank_env, rank_threads

#: the default gate's group sizes: world sizes 1, 2, the wide world size 3, the node world size 4
GATE_SIZES = (1, 2, 3, 4)


def oversubscribed(plan: cores.CorePlan) -> bool:
    """Whether ``plan`` runs more threads than it has cores where its ranks alone fit on them."""
    return plan.ranks_at_once <= plan.cores and plan.ranks_at_once * plan.rank_threads > plan.cores


@pytest.mark.parametrize("n, want", [
    # cores: (groups at once, threads per rank, ranks at once)
    (1, (1, 1, 4)),   # one group at a time: no side lane on one core
    (2, (2, 1, 5)),   # what the harness did before the plan: one thread per rank, the side lane
    (16, (2, 3, 5)),  # (16 - 1) // 5: the gate's own process keeps a core
    (64, (2, 4, 5)),  # capped at MAX_RANK_THREADS: the suite's models are tiny
])
def test_the_plan_at_1_2_16_and_64_cores(n, want):
    plan = cores.plan_cores(n, GATE_SIZES)
    assert (plan.groups_at_once, plan.rank_threads, plan.ranks_at_once) == want
    assert plan.side_lane == (n >= 2)
    assert not oversubscribed(plan)
    assert plan.rank_threads <= cores.MAX_RANK_THREADS


def test_more_cores_never_give_a_rank_fewer_threads_nor_oversubscribe():
    for sizes in ((1,), (1, 2), GATE_SIZES, (2, 4, 8)):
        plans = [cores.plan_cores(n, sizes) for n in range(1, 129)]
        assert all(not oversubscribed(p) for p in plans), sizes
        assert [p.rank_threads for p in plans] == sorted(p.rank_threads for p in plans), sizes


def test_the_check_sees_one_thread_per_core_in_every_rank():
    """torch's own default (each rank's intra-op pool as wide as the machine) is what 16 cores ran
    the gate 2x slower with: the check above fails it."""
    naive = cores.CorePlan(cores=16, groups_at_once=2, rank_threads=16, ranks_at_once=5)
    assert oversubscribed(naive)


def test_usable_cores_are_the_affinity_else_the_count(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert cores.usable_cores() == 16  # a container's or taskset's limit, not the machine's count

    def no_affinity(pid):
        raise AttributeError("not on Linux")

    monkeypatch.setattr(os, "sched_getaffinity", no_affinity, raising=False)
    assert cores.usable_cores() == 64
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert cores.usable_cores() == 1


def test_a_users_omp_num_threads_wins(monkeypatch):
    """The plan's threads are set in the rank (0: torch's own, from ``OMP_NUM_THREADS``) unless the
    user or a mode's environment gives ``OMP_NUM_THREADS``; the rank's environment keeps one OpenMP
    thread otherwise, so that its zygote imports torch without a worker thread (and can fork)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert rank_threads(None, 3) == 3 and rank_env(None)["OMP_NUM_THREADS"] == "1"
    assert rank_threads({"OMP_NUM_THREADS": "2"}, 3) == 0  # a mode's environment
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert rank_threads(None, 3) == 0 and rank_env(None)["OMP_NUM_THREADS"] == "7"


@pytest.mark.parametrize("n, threads, policy", [(1, 1, scheduler.Serial), (2, 1, scheduler.Pipelined),
                                                (16, 3, scheduler.Pipelined), (64, 4, scheduler.Pipelined)])
def test_the_gate_sizes_its_pool_from_the_usable_cores(monkeypatch, n, threads, policy):
    """The default gate's pool on a machine of ``n`` usable cores (mocked): its ranks' threads and
    whether its 1-rank jobs run beside the larger groups (the scheduler's policy). Nothing starts."""
    monkeypatch.setattr(cores, "usable_cores", lambda: n)
    monkeypatch.setattr(gate_session, "usable_cores", lambda: n)
    plan = RunPlan.from_args(cli.build_parser().parse_args(["run"]), load_target=False)
    assert gate_session.run_world_sizes(plan) == GATE_SIZES
    pool = gate_session.size_pool(Pool(zygote_preload=None), plan)
    try:
        assert pool.cores == cores.plan_cores(n, GATE_SIZES)
        assert pool.cores.rank_threads == threads
        assert isinstance(scheduler.choose(pool), policy)
    finally:
        pool.close()


def _threads():
    import torch

    x = torch.randn(512, 512)
    return torch.get_num_threads(), float((x @ x).sum()) == float((x @ x).sum()), os.getppid()


def test_a_rank_runs_on_the_planned_threads(monkeypatch):
    """A rank forked by a zygote runs torch on the plan's intra-op threads (a parallel matmul
    included), the zygote still forks (no thread of its own), and the ranks are gone after. Two
    threads: this machine's torch caps its pool at the 2 cores it has."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    pool = Pool(cores=cores.plan_cores(7, (1, 2)))  # (7 - 1) // 3: 2 threads per rank
    assert pool.cores.rank_threads == 2
    try:
        result = pool.run(_threads, world_size=1)
        assert result.status == "ok", result.message
        (threads, same, parent), = result.values()
        assert (threads, same) == (2, True)
        assert parent in pool.zygotes.pids(), "the rank was spawned, not forked by a zygote"
    finally:
        pool.close()
    assert wait_gone(pool.started_pids) == [], "rank or zygote processes left behind"

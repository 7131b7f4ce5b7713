"""The gate's pipelined run (``gate/scheduler.py``'s ``Pipelined`` policy): the same verdicts as
property by property (``Serial``), runs two properties ask for made once, a bug of one property its own
internal error, no wait left behind on an interrupt; and what it rests on: the pool's side lane and
per-group locking (``Pool.run``), the zygotes started ahead (``session.early_pool``), the counted one-thread
switch, the model lock."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from dpfsdp_verify.gate import cli, scheduler
from dpfsdp_verify.gate import run as gate_run
from dpfsdp_verify.gate import session as gate_session
from dpfsdp_verify.gate.plan import RunPlan
from dpfsdp_verify.harness import Pool, wait_gone
from dpfsdp_verify.properties import PROPERTIES
from dpfsdp_verify.properties.engine import runner

SMALL = ["--properties", "norm_fidelity,clipped_step", "--world-sizes", "1,2", "--models", "mlp", "--dtypes",
         "float64,float32", "--loss-reductions", "mean", "--sampling", "fixed", "--horizon", "0",
         "--wide-world-size", "0", "--node-world-size", "0", "--explore", "0", "--seed", "5"]


def _plan(target: str, *extra: str) -> RunPlan:
    return RunPlan.from_args(cli.build_parser().parse_args(["run", "--target", target, *SMALL, *extra]))


def _key(v):
    return (v.property, v.status, v.diagnosis, tuple(sorted((k, repr(x)) for k, x in v.config.items())))


class _Counting:
    """A view of the tests' pool that counts the runs shipped to ranks (one per spec of a job)."""

    def __init__(self, pool, lane: bool = True):
        self._pool, self.runs, self._lane = pool, 0, lane
        self._lock = threading.Lock()

    def run(self, fn, *args, **kwargs):
        with self._lock:
            self.runs += len(args[1])  # run_many_on_rank(target_ref, specs, ...)
        return self._pool.run(fn, *args, **kwargs)

    def fresh_group(self, *args, **kwargs):
        return self._pool.fresh_group(*args, **kwargs)

    def close(self):
        pass

    def side_lane(self, name="side"):
        return self._pool.side_lane(name) if self._lane else None

    def __getattr__(self, name):
        return getattr(self._pool, name)


@pytest.mark.parametrize("target", ["fixtures.specimens:Correct", "fixtures.specimens:NoClipMin"])
def test_pipelined_verdicts_are_the_property_by_property_ones(pool, target):
    """The same verdicts, in the same order, with and without the pipeline -- on a correct target and on
    one whose clipping fails -- and the pipelined run ships fewer runs to the ranks (the one-step clip
    runs both properties ask for run once)."""
    piped, plain = _Counting(pool), _Counting(pool, lane=False)
    assert isinstance(scheduler.choose(piped), scheduler.Pipelined)
    assert isinstance(scheduler.choose(plain), scheduler.Serial)
    a = gate_run.run_plan(_plan(target), pool=piped)
    b = gate_run.run_plan(_plan(target), pool=plain)
    assert [_key(v) for v in a] == [_key(v) for v in b]
    assert any(v.status == "fail" for v in a) == (target.endswith("NoClipMin"))
    assert 0 < piped.runs < plain.runs


def _failing_for(pid, real, boom):
    return lambda cases, *a, **k: boom() if cases[0].property == pid else real(cases, *a, **k)


def test_a_property_that_raises_is_its_own_internal_error(pool, monkeypatch):
    """A bug in one property's planning, judging or jobs is that property's ``internal_error`` verdict;
    the other property's verdicts stand."""
    plan = _plan("fixtures.specimens:Correct")
    good = [_key(v) for v in gate_run.run_plan(plan, pool=pool) if v.property == "clipped_step"]

    def boom(*a, **k):
        raise RuntimeError("planted")

    for where in ("plan", "judge", "jobs"):
        with monkeypatch.context() as m:
            prop = PROPERTIES["norm_fidelity"]
            if where == "plan":
                m.setitem(PROPERTIES, "norm_fidelity", dataclasses.replace(prop, cases=boom))
            elif where == "judge":
                m.setitem(PROPERTIES, "norm_fidelity", dataclasses.replace(prop, judge=boom))
            else:
                m.setattr(runner, "run_cases", _failing_for("norm_fidelity", runner.run_cases, boom))
            verdicts = gate_run.run_plan(plan, pool=pool)
        broken = [v for v in verdicts if v.property == "norm_fidelity"]
        assert len(broken) == 1 and broken[0].diagnosis == "internal_error" and "planted" in broken[0].message, where
        assert [_key(v) for v in verdicts if v.property == "clipped_step"] == good, where


def test_a_failing_progress_report_is_an_internal_error(pool):
    """A bug in reporting progress (a journal that cannot write, say) is the property's internal
    error, never a lost verdict list or a dead judge thread the caller waits on."""
    plan = _plan("fixtures.specimens:Correct")

    def progress(v):
        if v.property == "norm_fidelity":
            raise OSError("planted")

    found = scheduler.run_fixed(plan.properties, plan.options, pool, progress)
    assert found["norm_fidelity"][0] is None and "planted" in found["norm_fidelity"][1][0].message
    assert found["clipped_step"][0] is not None and all(v.status == "pass" for v in found["clipped_step"][1])


def test_an_interrupt_leaves_no_thread_waiting(pool, monkeypatch):
    """An interrupt in the thread that runs the jobs reaches the caller at once: the judge thread, waiting
    for outcomes that will not come, is told to stop and joined (never a hung gate)."""
    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_cases", interrupt)
    plan = _plan("fixtures.specimens:Correct")
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        scheduler.run_fixed(plan.properties, plan.options, pool)
    assert time.monotonic() - t0 < 20
    assert not [t for t in threading.enumerate() if t.name == "dpfsdp-judge"]


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _span(seconds: float):
    """``(start, end)`` wall-clock times of a sleep in the rank (one clock: the same machine)."""
    start = time.time()
    time.sleep(seconds)
    return start, time.time()


@pytest.mark.slow  # moved out of the README command to keep it near 5 min (CI runs it)
def test_jobs_on_different_groups_run_at_once_and_a_busy_group_is_kept():
    """``Pool.run`` holds its lock only to find a group: a 1-rank job on the side lane and a 2-rank job
    here overlap; two jobs on one group take turns; a group running a job is never closed to make room
    for another (``max_groups=1``)."""
    with Pool(max_groups=1) as p:
        for ws in (1, 2):
            assert p.run(_sleep, 0, world_size=ws).ok
        # the two jobs' sleeps overlap in time, whatever a group's start costs on a loaded box (the side
        # lane's 1-rank group is started afresh: max_groups=1 closed it for the 2-rank one)
        beside = p.side_lane().submit(p.run, _span, 1.0, world_size=1)
        here = p.run(_span, 1.0, world_size=2)
        assert here.ok and beside.result().ok
        spans = [here.results[0].value, beside.result().results[0].value]
        overlap = min(end for _, end in spans) - max(start for start, _ in spans)
        beside = p.side_lane().submit(p.run, _span, 0.6, world_size=1)
        here = p.run(_span, 0.6, world_size=1)
        assert here.ok and beside.result().ok
        turns = sorted([here.results[0].value, beside.result().results[0].value])
        started = list(p.started_pids)
    assert overlap > 0.2, spans
    assert turns[1][0] >= turns[0][1], turns  # one group: the second job starts after the first ends
    assert wait_gone(started) == []


def test_early_zygotes_fork_the_first_groups():
    """``early_pool`` starts the zygotes of the first groups before anything else runs; the first 1- and
    2-rank groups fork from them (no other zygote is started), and closing the pool ends them all."""
    pool = gate_session.early_pool("fixtures.specimens:Correct")
    try:
        if gate_session.EARLY_ZYGOTES == 0:  # the tests' own setting (tests/conftest.py): start them here
            pool.warm(2, None, gate_session.target_modules("fixtures.specimens:Correct"))
        zygotes = list(pool.started_pids)
        assert len(zygotes) == 2
        assert pool.run(_sleep, 0, world_size=2).ok and pool.run(_sleep, 0, world_size=1).ok
        assert set(pool.zygotes.pids()) == set(zygotes)
    finally:
        pool.close()
    assert wait_gone(pool.started_pids) == []
    with gate_session.early_pool("fixtures.specimens:Correct", ["m:X=1"]) as other:
        assert other.started_pids == []


def test_one_thread_is_the_calling_threads():
    """Torch's thread count is the calling thread's: the judge thread's ``one_thread`` gives it one
    thread and leaves the thread that runs the jobs as it was; leaving restores what it had."""
    import torch

    from dpfsdp_verify.properties.engine.threads import one_thread

    before = torch.get_num_threads()
    inside, leave = threading.Barrier(2), threading.Event()
    seen = {}

    def hold():
        outside = torch.get_num_threads()
        with one_thread():
            seen["judge inside"] = torch.get_num_threads()
            inside.wait()
            leave.wait()
        seen["judge restored"] = torch.get_num_threads() == outside

    t = threading.Thread(target=hold)
    t.start()
    inside.wait()
    seen["jobs meanwhile"] = torch.get_num_threads()
    leave.set()
    t.join()
    assert seen == {"judge inside": 1, "jobs meanwhile": before, "judge restored": True}


def test_models_built_in_threads_are_the_ones_built_alone():
    """Model parameters come from torch's default generator, seeded per model: built in two threads at
    once they equal those built one after another (``models._DEFAULT_GENERATOR``)."""
    import torch

    from dpfsdp_verify.models import build_model

    alone = {s: [p.detach().clone() for p in build_model("mlp", seed=s).parameters()] for s in range(16)}
    built = {}

    def build(seeds):
        for _ in range(3):
            for s in seeds:
                built[s] = [p.detach().clone() for p in build_model("mlp", seed=s).parameters()]

    threads = [threading.Thread(target=build, args=(range(k, 16, 2),)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(all(torch.equal(a, b) for a, b in zip(alone[s], built[s])) for s in range(16))


def test_every_explored_property_gets_its_draws_under_one_time_cap(monkeypatch):
    """--explore is draws per explored property (the seed's, on any machine), not seconds shared out:
    each explored property gets all of them; the one time cap (--explore-cap) starts when the
    explorations start and is the same deadline for every property."""
    plan = RunPlan.from_args(cli.build_parser().parse_args(
        ["run", "--target", "fixtures.specimens:Correct", "--explore", "6", "--explore-cap", "30", "--seed", "5"]))
    explored = [p for p in plan.properties if PROPERTIES[p].explore is not None]
    assert len(explored) == 2
    clock = [100.0]
    monkeypatch.setattr(gate_session.time, "monotonic", lambda: clock[0])
    budget = gate_session.ExploreBudget(plan)
    budget.begin()
    assert budget.share() == (6, 130.0)
    clock[0] += 25.0  # the first property's draws took 25 s: the second gets its 6 draws, capped at the same 130
    assert budget.share() == (6, 130.0)
    assert gate_session.ExploreBudget(RunPlan.from_args(cli.build_parser().parse_args(
        ["run", "--target", "fixtures.specimens:Correct", "--explore", "0"]))).share()[0] == 0

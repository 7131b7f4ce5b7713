"""The zygote (``harness/zygote.py``): a rank it forks is the rank ``python -m
dpfsdp_verify.harness.rank`` would have been (environment, ``sys.path``, threads, session, output,
parent-death signal); no rank outlives its zygote or the harness; a zygote that cannot start (or
cannot fork safely) leaves the pool spawning its ranks; an environment changed since gets zygotes
of its own."""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dpfsdp_verify.harness import Pool, WorkerGroup, wait_gone, zygote


def rank_facts():
    """What a rank can see of how it was started."""
    import torch

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    deathsig = ctypes.c_int()
    libc.prctl(2, ctypes.byref(deathsig))  # PR_GET_PDEATHSIG
    return dict(pid=os.getpid(), ppid=os.getppid(), sid=os.getsid(0), pgid=os.getpgid(0), env=dict(os.environ),
                path=list(sys.path), cwd=os.getcwd(), argv0=sys.argv[0], main=sys.modules["__main__"].__file__,
                threads=torch.get_num_threads(), interop=torch.get_num_interop_threads(),
                accelerator=str(torch._C._get_accelerator()), deathsig=deathsig.value, hash=hash("rank"),
                stdout=os.path.basename(os.readlink("/proc/self/fd/1")),
                stderr=os.path.basename(os.readlink("/proc/self/fd/2")), stdin=os.readlink("/proc/self/fd/0"))


def parent_and_env(name):
    return os.getppid(), os.environ.get(name)


def _run_and_close(group, fn, *args):
    try:
        return group.run(fn, args, timeout=120).values()
    finally:
        group.close()
        assert wait_gone(group.pids()) == [], "rank processes left behind"


def test_a_forked_rank_is_what_a_spawned_rank_would_be(pool):
    forked_group = pool.fresh_group(2)
    forked = _run_and_close(forked_group, rank_facts)
    spawned = _run_and_close(WorkerGroup(2), rank_facts)
    zygotes = pool.zygotes.pids()
    for r, (f, s) in enumerate(zip(forked, spawned)):
        assert f["ppid"] in zygotes, "forked by a zygote"
        assert s["ppid"] == os.getpid()
        assert f["sid"] == f["pgid"] == f["pid"] and s["sid"] == s["pgid"] == s["pid"], "a session of its own"
        same = ("env", "path", "cwd", "argv0", "main", "threads", "interop", "accelerator", "deathsig", "stdout",
                "stderr", "stdin")
        assert {k: f[k] for k in same} == {k: s[k] for k in same}
        assert f["env"]["RANK"] == str(r) and f["env"]["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1")
        assert f["stdout"] == f"rank{r}.log" and f["deathsig"] == signal.SIGKILL and f["accelerator"] == "cpu"
    # each rank index has its own zygote, so the ranks of a group hash strings differently, as
    # separate interpreters do
    assert forked[0]["hash"] != forked[1]["hash"]


@pytest.mark.slow  # moved out of the README command to keep it near 5 min (CI runs it)
def test_each_environment_has_its_zygotes_and_a_group_env_is_spawned(pool, monkeypatch):
    keep = pool.fresh_group(1)  # a rank of this environment's zygote stays up: it is busy
    try:
        (first, _), = keep.run(parent_and_env, ("X",), timeout=120).values()
        assert first in pool.zygotes.pids()
        monkeypatch.setenv("DPFSDP_ZYGOTE_TEST", "set after the zygotes started")
        (ppid, value), = _run_and_close(pool.fresh_group(1), parent_and_env, "DPFSDP_ZYGOTE_TEST")
        assert ppid in pool.zygotes.pids() and ppid != first and value == "set after the zygotes started"
        # a new environment ends an idle set of zygotes when there are too many, never a busy one
        monkeypatch.setattr(pool.zygotes, "MAX_ENVIRONMENTS", 1)
        monkeypatch.setenv("DPFSDP_ZYGOTE_TEST", "a third environment")
        (ppid, value), = _run_and_close(pool.fresh_group(1), parent_and_env, "DPFSDP_ZYGOTE_TEST")
        assert ppid == os.getpid() and value == "a third environment", "spawned"
        monkeypatch.delenv("DPFSDP_ZYGOTE_TEST")
        group = pool.fresh_group(1, env={"DPFSDP_ZYGOTE_TEST": "group env"})  # read at import: spawned
        (ppid, value), = _run_and_close(group, parent_and_env, "DPFSDP_ZYGOTE_TEST")
        assert ppid == os.getpid() and value == "group env"
        (ppid, value), = _run_and_close(pool.fresh_group(1), parent_and_env, "DPFSDP_ZYGOTE_TEST")
        assert ppid == first and value is None
    finally:
        keep.close()
    assert wait_gone(keep.pids()) == []


def imports(name):
    importlib.import_module(name)


def loaded_at_start(name):
    """Whether ``name`` was imported before the rank became ready (``rank._startup_modules``)."""
    return name in sys.modules["__main__"]._startup_modules


def test_the_zygotes_learn_torch_and_opacus_modules_the_jobs_imported(pool):
    pool.run(imports, "opacus", world_size=1)
    pool.run(imports, "hypothesis", world_size=1)  # not a package the zygotes learn from
    group = pool.fresh_group(1)
    assert _run_and_close(group, loaded_at_start, "opacus") == [True]
    assert "opacus" in pool.zygotes.learned and not any(m.startswith("hypothesis") for m in pool.zygotes.learned)
    assert _run_and_close(pool.fresh_group(1), loaded_at_start, "hypothesis") == [False]


def test_a_killed_zygote_leaves_no_rank_behind_and_is_replaced():
    p = Pool()
    try:
        (first_zygote, _), = p.run(parent_and_env, "X", world_size=1).values()
        assert p.zygotes.pids() == [first_zygote] and first_zygote in p.started_pids
        ranks = p.pids()
        os.kill(first_zygote, signal.SIGKILL)
        assert wait_gone(ranks) == [], "the zygote's ranks outlived it"
        # the pool's warm group is gone with it: its next job is a crash naming the signal...
        res = p.run(parent_and_env, "X", world_size=1)
        assert (res.status, res.diagnosis) == ("error", "rank_crash") and "killed by SIGKILL" in res.message
        # ...and the job after it runs on a rank forked by a new zygote
        (ppid, _), = p.run(parent_and_env, "X", world_size=1).values()
        assert ppid != first_zygote and p.zygotes.pids() == [ppid]
    finally:
        p.close()
    assert wait_gone(p.started_pids) == [], "rank or zygote processes left behind"


@pytest.mark.parametrize("broken, says", [
    (dict(module="dpfsdp_verify.no_such_zygote"), "No module named dpfsdp_verify.no_such_zygote"),
    (dict(preload=zygote.PRELOAD + ("tests.zygote_thread_at_import",)), "2 threads run after the imports"),
])
def test_a_zygote_that_cannot_start_leaves_the_pool_spawning(monkeypatch, broken, says):
    monkeypatch.setattr(zygote, "ZYGOTE_MODULE", broken.get("module", zygote.ZYGOTE_MODULE))
    p = Pool(zygote_preload=broken.get("preload", zygote.PRELOAD))
    try:
        with pytest.warns(RuntimeWarning, match="rank processes are spawned"):
            (ppid, _), = p.run(parent_and_env, "X", world_size=1).values()
        assert ppid == os.getpid(), "spawned by this process"
        assert says in p.zygotes.failed
        (ppid, _), = p.run(parent_and_env, "X", world_size=1).values()  # a warm spawned group
        assert ppid == os.getpid() and p.zygotes.pids() == []
    finally:
        p.close()
    assert wait_gone(p.started_pids) == [], "rank or zygote processes left behind"


HARNESS_THAT_DIES = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, sys.argv[1])
    from dpfsdp_verify.harness import Pool, zygote
    from tests.harness.test_zygote import parent_and_env
    p = Pool()
    p.run(parent_and_env, "X", world_size=2)
    print(json.dumps(p.started_pids), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.slow
def test_the_zygotes_and_their_ranks_die_with_the_harness():
    out = subprocess.run([sys.executable, "-c", HARNESS_THAT_DIES,
                          os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))],
                         capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == -signal.SIGKILL, out.stderr
    pids = json.loads(out.stdout)
    assert len(pids) == 4, "two zygotes and their two ranks"
    assert wait_gone(pids) == [], "zygote or rank processes outlived the harness"


def imported(name):
    return name in sys.modules


def test_a_prestarted_group_is_the_one_the_first_job_runs_on_with_its_preload():
    """``Pool.prestart`` (the gate starts its groups as a run begins, and again before each
    property): it never waits for a zygote's imports -- while they run it starts the zygotes and
    no group, and a later call starts the group -- the group starts in the background, the first job
    at that size runs on its ranks (no second start), its ranks imported the preload before they
    were ready, a second prestart of a live key starts nothing, and nothing is left behind."""
    from dpfsdp_verify.gate.session import target_modules

    assert target_modules("opacus") == ("opacus", "dpfsdp_verify.targets.opacus_target")
    assert target_modules("fixtures.specimens:Correct") == ("fixtures.specimens",)
    assert target_modules("some-entry-point") == ()
    p = Pool()
    try:
        t0 = time.monotonic()
        assert p.prestart(2, preload=("fixtures.specimens",)) is False  # the zygotes import torch first
        waited = time.monotonic() - t0
        zygotes = list(p.started_pids)
        assert len(zygotes) == 2 and waited < 1.0, (zygotes, waited)  # started, not waited for (imports take s)
        deadline = time.monotonic() + 120
        while not p.prestart(2, preload=("fixtures.specimens",)):
            assert time.monotonic() < deadline, "the zygotes never answered"
            assert p.started_pids == zygotes  # no group (and no second zygote) before they answer
            time.sleep(0.05)
        started = list(p.started_pids)
        assert len(started) >= 2 and p.prestart(2) is False  # pending: not started twice
        res = p.run(imported, "fixtures.specimens", world_size=2)
        assert res.status == "ok" and list(res.values()) == [True, True], res.message
        assert p.started_pids == started  # the job ran on the prestarted ranks
        assert p.prestart(2) is False  # a live group: nothing to start
    finally:
        p.close()
    assert wait_gone(p.started_pids) == [], "rank or zygote processes left behind"


def test_prestart_keeps_the_target_its_group_preloads_out_of_the_zygotes():
    """A zygote forks the ranks of every target its pool runs: the modules a prestarted group's ranks
    import (its preload: the target's) stay out of the zygotes. Else a module that patches a library
    at import -- a fork's (``fixtures.sqrtn_fork``) -- patches every later group's ranks: it did, and
    upstream's tests in the same pool ran the planted bug."""
    p = Pool()
    try:
        deadline = time.monotonic() + 120
        while not p.prestart(2, preload=("fixtures.explore_specimens",)):
            assert time.monotonic() < deadline, "the zygotes never answered"
            time.sleep(0.05)
        res = p.run(imported, "fixtures.explore_specimens", world_size=2)
        assert res.status == "ok" and list(res.values()) == [True, True], res.message  # its own ranks did
        other = p.fresh_group(2)  # forked by the same zygotes, for another target
        try:
            assert list(other.run(imported, ("fixtures.explore_specimens",), timeout=120).values()) == [False, False]
        finally:
            other.close()
    finally:
        p.close()
    assert wait_gone(p.started_pids) == [], "rank or zygote processes left behind"


def test_the_zygotes_a_warmed_pool_starts_later_import_its_target_s_opacus_at_once():
    """``Pool.warm`` (the gate's pool, for its one target): the zygotes the pool starts later -- a
    wider group's -- import the preload's modules of the learned packages (opacus) at once, so the
    ranks they fork start with them. Without it each 3- and 4-rank group's later ranks imported
    opacus in their first job (~1 s of CPU each: 4 ranks of the default gate). The preload's other
    modules (the target's own: a fork may patch a library at import) stay out of the later zygotes."""
    p = Pool()
    try:
        p.warm(1, None, ("opacus", "fixtures.specimens"))
        assert p.zygotes is not None and p.zygotes.learned == ["opacus"]
        res = p.run(loaded_at_start, "opacus", world_size=2, timeout=120)  # rank 1's zygote starts now
        assert res.status == "ok" and list(res.values()) == [True, True], res.message
        res = p.run(loaded_at_start, "fixtures.specimens", world_size=2, timeout=120)
        assert list(res.values()) == [True, False], "the target's own module reached a later zygote"
    finally:
        p.close()
    assert wait_gone(p.started_pids) == [], "rank or zygote processes left behind"

"""The pytest plugin as a user meets it: a distributed test file run in a separate pytest
process (pool mode, xdist, torchrun mode). Each run proves no rank process outlives it."""

from __future__ import annotations

import os
import shutil
import sys
import time
import uuid

import pytest
import torch

USER_TESTS = '''
import os
import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=2)
def test_allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert world_size == 2 and t.item() == 3.0


@pytest.mark.distributed(world_size=2)
def test_fails_on_rank_1(rank):
    dist.barrier()
    assert rank != 1, "per-sample norm mismatch on this rank"


@pytest.mark.distributed(world_size=2, timeout=3)
def test_hangs(rank):
    if rank == 0:
        dist.all_reduce(torch.ones(3))


@pytest.mark.distributed(world_size=2, env={"OPACUS_USE_DEFERRED_NORM": "1"})
def test_env(rank):
    assert os.environ["OPACUS_USE_DEFERRED_NORM"] == "1"


@pytest.mark.distributed(world_size=1)
def test_after_hang_session_goes_on(rank, world_size):
    assert dist.get_world_size() == world_size == 1


@pytest.mark.distributed(world_size=2, backend="nccl")
def test_nccl(rank):
    dist.all_reduce(torch.ones(1, device="cuda"))
'''


def ranks_with_tag(tag: str):
    """pids of live processes whose environment carries ``tag`` (the run's rank processes)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"DPFSDP_TEST_TAG={tag}".encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def assert_no_ranks(tag):
    deadline = time.monotonic() + 3
    while ranks_with_tag(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ranks_with_tag(tag) == []


@pytest.fixture
def tagged(monkeypatch):
    tag = uuid.uuid4().hex
    monkeypatch.setenv("DPFSDP_TEST_TAG", tag)
    yield tag
    assert_no_ranks(tag)


def test_pool_mode_outcomes(pytester, tagged):
    pytester.makepyfile(test_user=USER_TESTS)
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    res.assert_outcomes(passed=3, failed=2, skipped=1 if not _cuda() else 0)
    out = res.stdout.str()
    assert "rank 1 raised AssertionError: per-sample norm mismatch on this rank" in out
    assert "HANG (deadlock) at world_size=2" in out and "never by rank 1" in out
    assert "needs CUDA GPUs" in out or _cuda()


def test_xdist_runs_collide_nowhere(pytester, tagged):
    pytester.makepyfile(test_user=USER_TESTS)
    for _ in range(2):
        res = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "-k", "not hangs")
        res.assert_outcomes(passed=3, failed=1, skipped=1 if not _cuda() else 0)


BAD_MARKERS = '''
import pytest


@pytest.mark.distributed(worldsize=2)
def test_typo(rank):
    pass


@pytest.mark.distributed(world_size=0)
def test_zero_ranks(rank):
    pass


@pytest.mark.distributed(world_size=2, backend="mpi")
def test_unknown_backend(rank):
    pass


@pytest.mark.distributed(world_size=2, timeout=-1)
def test_negative_timeout(rank):
    pass


@pytest.fixture
def handle():
    return lambda: 1


@pytest.mark.distributed(world_size=1)
def test_unpicklable_fixture(rank, handle):
    pass
'''


def test_marker_mistakes_fail_with_a_reason_not_a_torch_traceback(pytester, tagged):
    pytester.makepyfile(test_bad=BAD_MARKERS)
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rf")
    res.assert_outcomes(failed=5)
    out = res.stdout.str()
    assert "unknown argument(s) worldsize; accepted: world_size, backend, timeout, env" in out
    assert "world_size must be >= 1, got 0" in out
    assert "unknown backend 'mpi'" in out
    assert "timeout must be > 0 seconds" in out
    assert "cannot send job" in out and "picklable" in out
    assert "During handling of the above exception" not in out


def test_markers_and_options_are_documented(pytester):
    res = pytester.runpytest_subprocess("--markers")
    assert "distributed(world_size=2, backend='gloo', timeout=None, env=None)" in res.stdout.str()
    res = pytester.runpytest_subprocess("--help")
    assert "--dpfsdp-timeout" in res.stdout.str()


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
                    reason="torchrun not installed")
def test_torchrun_mode(pytester, tagged):
    pytester.makepyfile(test_user=USER_TESTS)
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    res = pytester.run(torchrun, "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                       "-m", "pytest", "-p", "no:cacheprovider", "-k", "allreduce or rank_1 or session_goes_on", "-rA",
                       timeout=180)
    out = res.stdout.str()
    # both ranks ran test_allreduce collectively; the rank-1 failure is reported on every rank;
    # the world_size=1 test is skipped (this job has 2 ranks)
    assert out.count("PASSED test_user.py::test_allreduce") == 2
    assert "rank 1: AssertionError: per-sample norm mismatch" in out
    assert "needs world_size=1; this torchrun job has 2 ranks" in out


def _cuda():
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2

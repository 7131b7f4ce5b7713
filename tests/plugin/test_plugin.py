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


@pytest.mark.slow
def test_pool_mode_outcomes(pytester, tagged):
    pytester.makepyfile(test_user=USER_TESTS)
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    res.assert_outcomes(passed=3, failed=2, skipped=1 if not _cuda() else 0)
    out = res.stdout.str()
    assert "rank 1 raised AssertionError: per-sample norm mismatch on this rank" in out
    assert "HANG (deadlock) at world_size=2" in out and "never by rank 1" in out
    assert "needs CUDA GPUs" in out or _cuda()


@pytest.mark.slow
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


@pytest.mark.slow  # moved out of the README command to keep it near 5 min (CI runs it)
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


TIMEOUT_TESTS = '''
import time
import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def slow_setup():
    time.sleep(1.5)  # counts against pytest-timeout's budget, not the marker's


@pytest.mark.distributed(world_size=2)
def test_a_warm(rank):
    dist.barrier()


@pytest.mark.timeout(2)
@pytest.mark.distributed(world_size=2, timeout=30)
def test_b_hangs(rank):
    if rank == 0:
        dist.all_reduce(torch.ones(3))
    else:
        time.sleep(60)  # stuck outside any collective: no proof, only a deadline ends it


@pytest.mark.distributed(world_size=2, timeout=4)
def test_c_innocent(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2.0


@pytest.mark.timeout(3, method="signal")
@pytest.mark.distributed(world_size=2, timeout=30)
def test_d_interrupted_mid_run(rank, slow_setup):
    if rank == 0:
        dist.all_reduce(torch.ones(3))
    else:
        time.sleep(60)


@pytest.mark.distributed(world_size=2, timeout=4)
def test_e_innocent_again(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2.0
'''


@pytest.mark.slow
def test_pytest_timeout_shorter_than_the_marker_poisons_nothing(pytester, tagged):
    pytester.makepyfile(test_user=TIMEOUT_TESTS)
    t0 = time.monotonic()
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", "-rA")
    elapsed = time.monotonic() - t0
    out = res.stdout.str()
    res.assert_outcomes(passed=3, failed=2)
    # b: the marker's 30 s deadline became pytest-timeout's 2 s minus a margin, so the plugin's
    # diagnosed verdict came first
    # rank 1 sleeps outside collectives: nothing proves it would never come back -- a timeout
    assert "HANG (timeout) at world_size=2: no deadlock proven: the job did not finish within 1.5 s" in out
    assert "busy outside any collective, still in the job: rank 1 (at " in out and "in test_b_hangs" in out
    # d: its fixture used half of pytest-timeout's 3 s, which interrupted the run itself
    assert "Timeout (>3.0s)" in out or "Timeout >3.0s" in out
    # c and e ran on fresh groups and got their own results, not b's or d's
    assert "PASSED test_user.py::test_c_innocent" in out and "PASSED test_user.py::test_e_innocent_again" in out
    assert elapsed < 120, "nobody waited for the marker's 30 s deadline"


ERGONOMICS_TESTS = '''
import pytest
import torch.distributed as dist
from hypothesis import given, strategies as st


@pytest.mark.distributed(world_size=2)
def test_values(rank):
    print(f"hello from rank {rank}")
    norms = [1.5, 2.5, float(rank)]
    assert norms == [1.5, 2.5, 0.0]


@pytest.mark.distributed(world_size=[1, 2])
def test_sizes(rank, world_size):
    assert dist.get_world_size() == world_size


@given(st.integers())
@pytest.mark.distributed(world_size=1)
def test_given(rank, x):
    pass
'''


@pytest.mark.slow
def test_pool_mode_ergonomics(pytester, tagged):
    pytester.makepyfile(test_user=ERGONOMICS_TESTS)
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", "-rA")
    out = res.stdout.str()
    res.assert_outcomes(passed=2, failed=1, errors=1)  # the error: @given refused at setup
    # the assertion was rewritten on the rank: the values are in the message
    assert "rank 1 raised AssertionError: assert [1.5, 2.5, 1.0] == [1.5, 2.5, 0.0]" in out
    # each rank's output is attached to the report
    assert "rank 1 stdout" in out and "hello from rank 1" in out and "hello from rank 0" in out
    # one item per world size
    assert "PASSED test_user.py::test_sizes[ws1]" in out and "PASSED test_user.py::test_sizes[ws2]" in out
    # @given + distributed: refused with one line saying what to do instead
    assert "@given cannot drive a @pytest.mark.distributed test" in out
    assert "has no attribute 'accept'" not in out


TORCHRUN_TESTS = '''
import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=2, timeout=4)
def test_a_rank1_raises_before_a_collective(rank):
    if rank == 1:
        raise ValueError("bad shard on rank 1")
    dist.all_reduce(torch.ones(2))  # rank 0 waits here for a partner that never comes


@pytest.mark.distributed(world_size=2)
def test_b_next_test_runs(rank):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == 3.0


@pytest.mark.distributed(world_size=2, timeout=3)
def test_c_rank0_hangs_in_a_collective_rank1_skips(rank):
    if rank == 0:
        dist.all_reduce(torch.ones(2))


@pytest.mark.distributed(world_size=2)
def test_d_after_the_hang(rank):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == 3.0
'''


def _torchrun():
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return exe if os.path.exists(exe) else shutil.which("torchrun")


@pytest.mark.slow
@pytest.mark.skipif(_torchrun() is None, reason="torchrun not installed")
def test_torchrun_mode(pytester, tagged):
    pytester.makepyfile(test_user=USER_TESTS, test_torchrun=TORCHRUN_TESTS)
    t0 = time.monotonic()
    res = pytester.run(_torchrun(), "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                       "127.0.0.1:0", "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly",
                       "-k", "allreduce or rank_1 or session_goes_on or test_a_ or test_b_ or test_c_ or test_d_",
                       "-rA",
                       "--junitxml=report.xml", timeout=240)
    elapsed = time.monotonic() - t0
    out = res.stdout.str()
    # only rank 0 reports: each test's line appears once
    assert out.count("PASSED test_user.py::test_allreduce") == 1
    assert out.count("test session starts") == 1
    assert "rank 1: AssertionError: per-sample norm mismatch" in out
    assert "needs world_size=1; this torchrun job has 2 ranks" in out
    # rank 1 raised before a collective rank 0 entered: the test ends naming rank 1 at the
    # 4 s process-group timeout, and the session goes on with a renewed group
    assert "rank 1: ValueError: bad shard on rank 1" in out
    assert "rank 0 was left waiting in a collective until the 4 s process-group timeout" in out
    assert out.count("PASSED test_torchrun.py::test_b_next_test_runs") == 1
    # rank 0 hung in a collective rank 1 never issued: named, and the session went on
    assert "rank 0 was left waiting in a collective until the 3 s process-group timeout" in out
    assert out.count("PASSED test_torchrun.py::test_d_after_the_hang") == 1
    assert (pytester.path / "report.xml").exists()
    assert elapsed < 200, "no test waited for torch's 30-minute default timeout"


def _cuda():
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2

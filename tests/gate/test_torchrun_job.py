"""The gate inside a torchrun job (``--launcher torchrun``): two torchrun agents on this host, as two
"nodes" of 2 ranks each, rendezvous through c10d on 127.0.0.1 and run the gate at world size 4 on
gloo. Its verdicts must be the spawned gate's at 4 ranks; a deadlocking specimen must end in
verdicts (and the run go on), never a stuck job; and no rank process may outlive the job."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from dpfsdp_verify.gate.cli import main
from dpfsdp_verify.gate.plan import UsageError, launched_world_sizes
from tests.plugin.test_plugin import ranks_with_tag

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: a selection small enough for CI (the full default gate at 4 ranks is compared by hand: docs/torchrun.md)
SELECTION = ["--properties", "clipped_step,sensitivity_bound", "--models", "mlp", "--loss-reductions", "mean",
             "--dtypes", "float64", "--seed", "11"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_agents(tmp_path, gate_args, timeout=240):
    """Run ``-m dpfsdp_verify run --launcher torchrun <gate_args>`` under two torchrun agents
    (2 nodes x 2 ranks, c10d rendezvous on 127.0.0.1); returns (exit codes, outputs, rank pids seen,
    seconds). The agents' addresses, the rendezvous endpoint and gloo's pairs are on loopback (the
    rendezvous TCPStore torch creates listens on its port on every interface: torch has no bind
    address for it). All of the job's processes are gone when it returns."""
    tag, port, run_id = uuid.uuid4().hex, _free_port(), f"gate-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, DPFSDP_TEST_TAG=tag, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=ROOT)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    agents, logs = [], []
    t0 = time.monotonic()
    for node in (0, 1):
        log = open(tmp_path / f"agent{node}.log", "w+")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
               "--node-rank", str(node), "--local-addr", "127.0.0.1", "--rdzv-conf", f"is_host={int(node == 0)}",
               "--monitor-interval", "0.5", "-m", "dpfsdp_verify", "run", "--launcher", "torchrun", *gate_args]
        agents.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True))
        logs.append(log)
    seen = set()
    try:
        while any(a.poll() is None for a in agents):
            seen.update(ranks_with_tag(tag))
            if time.monotonic() - t0 > timeout:
                pytest.fail(f"the torchrun job did not end within {timeout} s")
            time.sleep(0.5)
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    seconds = time.monotonic() - t0
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read())
        log.close()
    # every rank process (and agent) of the job is gone
    deadline = time.monotonic() + 5
    while ranks_with_tag(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ranks_with_tag(tag) == [], "a process of the torchrun job outlived it"
    ranks = seen - {a.pid for a in agents}
    return [a.returncode for a in agents], outs, ranks, seconds


def _verdicts(path):
    with open(path) as f:
        return [(r["property"], r["label"], r["status"], r["diagnosis"], r["message"]) for r in json.load(f)["results"]]


def test_launcher_torchrun_outside_torchrun_exits_2(monkeypatch, capsys):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert main(["run", "--launcher", "torchrun", "--target", "fixtures.specimens:Correct"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a torchrun rank" in err[0] and "hint:" in err[0]


def test_world_sizes_in_a_torchrun_job():
    assert launched_world_sizes(None, 4) == [4]  # default: the job's own size
    assert launched_world_sizes("2,4", 4) == [2, 4]  # size 2: reported as not run at this size
    with pytest.raises(UsageError, match="this torchrun job has 4 ranks"):
        launched_world_sizes("1,2", 4)
    with pytest.raises(UsageError, match="not a comma list"):
        launched_world_sizes("four", 4)


@pytest.mark.slow
def test_gate_in_a_two_node_torchrun_job_matches_the_spawned_gate(tmp_path):
    spawned = tmp_path / "spawned.json"
    # the matrix alike at both sizes: no long runs (at the largest size only) and no wide size
    reach = ["--horizon", "0", "--wide-world-size", "0", "--node-world-size", "0"]
    assert main(["run", "--target", "fixtures.specimens:Correct", "--world-sizes", "4", "-q",
                 "--json", str(spawned), *reach, *SELECTION]) == 0
    report = tmp_path / "torchrun.json"
    junit = tmp_path / "torchrun.xml"
    codes, outs, ranks, seconds = two_agents(
        tmp_path, ["--target", "fixtures.specimens:Correct", "--world-sizes", "2,4", "--json", str(report),
                   "--junit", str(junit), "-v", *reach, *SELECTION])  # -v: the per-verdict table and every skip
    both = "\n".join(outs)
    assert codes == [0, 0], both[-3000:]
    assert len(ranks) >= 4, f"saw rank processes {sorted(ranks)}"
    got = _verdicts(report)
    at4 = [v[:4] for v in got if v[1].startswith("ws=4 ")]
    # same cases, same verdicts (property, config, status, diagnosis) as the spawned gate at 4 ranks
    assert at4 == [v[:4] for v in _verdicts(spawned)]
    assert at4 and all(v[2] == "pass" for v in at4)
    # the cases at another world size are reported as not run at this size, one line each
    at2 = [v for v in got if v[1].startswith("ws=2 ")]
    assert [v[0] for v in at2] == [v[0] for v in at4]  # the same cases at size 2 (Poisson datasets scale with it)
    assert all(v[2] == "skip" and v[4] == "not run at this size: needs world_size=2; this torchrun job has 4 ranks"
               for v in at2)
    assert both.count("not run at this size: needs world_size=2") == len(at2)
    # rank 0 alone reports: one table, one banner, one JUnit file
    assert both.count("in a torchrun job of 4 ranks") == 1 and both.count("\nproperty ") == 1
    assert junit.exists()


@pytest.mark.slow
def test_deadlocking_specimen_ends_in_verdicts_not_a_stuck_job(tmp_path):
    # HookCollective: the last rank issues a barrier in a backward hook that no other rank issues
    report = tmp_path / "hang.json"
    codes, outs, ranks, seconds = two_agents(
        tmp_path, ["--target", "fixtures.specimens:HookCollective", "--properties", "clipped_step,sampling_accounting",
                   "--models", "mlp", "--loss-reductions", "mean", "--dtypes", "float64", "--seed", "11",
                   "--timeout", "10", "--json", str(report)])
    both = "\n".join(outs)
    assert codes == [1, 1], both[-3000:]  # a failing verdict, the same code on every rank
    got = _verdicts(report)
    # the job of clipped_step's configurations hung in its first one: that one is the hang, the others
    # are "not run" (skip), never a hang they did not have (runner._split_at_hang)
    steps = [v for v in got if v[0] == "clipped_step"]
    hung = [v for v in steps if v[2] == "hang"]
    assert hung and all(v[3] == "deadlock" for v in hung), steps
    assert all(v[2] == "skip" and v[4].startswith("not run: the job it shared hung in clipped_step")
               for v in steps if v[2] != "hang"), steps
    assert "gloo:barrier" in hung[0][4] and "on_backprop" in hung[0][4]
    # the run went on after the hang, on a renewed process group
    after = [v for v in got if v[0] == "sampling_accounting"]
    assert after and all(v[2] == "pass" for v in after), after


def _outcome(rank, ok=True, error=None, pg_timeout=False, overran=False, in_collective=False, site=None):
    from dpfsdp_verify.harness.protocol import JobError, JobResult

    res = JobResult(rank=rank, value="v") if ok else JobResult(rank=rank, error=JobError(error, "m", "tb"))
    return {"result": res, "trail": None, "overran": overran, "site": site, "in_collective": in_collective,
            "dump": None, "pg_timeout": pg_timeout}


def _dump(rank, ops):
    from dpfsdp_verify.harness.protocol import RankDump

    entries = [{"collective_seq_id": i + 1, "process_group": ["0", "default_pg"], "profiling_name": op,
                "input_sizes": [[3]], "is_p2p": False, "record_id": i} for i, op in enumerate(ops)]
    return RankDump(rank=rank, pid=0, flight_recorder={"entries": entries})


def test_outcomes_become_the_spawned_groups_verdicts():
    from dpfsdp_verify.harness.torchrun_pool import _group_result

    ok = _group_result({0: _outcome(0), 1: _outcome(1)}, 2, "gloo", 9)
    assert ok.ok and ok.values() == ["v", "v"]
    # a rank raised on its own; its peer waited for it in a collective until the timeout
    crash = _group_result({0: _outcome(0, False, "DistBackendError", pg_timeout=True),
                           1: _outcome(1, False, "ValueError")}, 2, "gloo", 9)
    assert (crash.status, crash.diagnosis) == ("error", "rank_crash")
    assert crash.message.startswith("rank 1 raised ValueError: m")
    assert "rank 0 was left waiting in a collective until the 9 s process-group timeout" in crash.message
    # a rank finished after collective #4 while its peer waits in #5: proven
    done = _outcome(0)
    stuck = _outcome(1, False, "JobDeadline", overran=True, in_collective=True, site="t.py:3 in step")
    done["newest"], stuck["dump"] = {"0": 4}, _dump(1, ["gloo:all_reduce"] * 5)
    dead = _group_result({0: done, 1: stuck}, 2, "gloo", 9)
    assert (dead.status, dead.diagnosis) == ("hang", "deadlock") and "rank 1 at t.py:3 in step" in dead.message
    assert "rank 1 waits in collective #5 (gloo:all_reduce [[3]]) of process group 0, which rank 0 never issues" \
        in dead.message
    # ... but a peer that has not issued #5 *yet* (still in the job, e.g. computing) proves nothing
    slow = _outcome(0, False, "JobDeadline", overran=True, site="t.py:9 in compute")
    slow["dump"] = _dump(0, ["gloo:all_reduce"] * 4)
    assert _group_result({0: slow, 1: stuck}, 2, "gloo", 9).diagnosis == "timeout"
    # two ranks issued different collectives under one sequence id: proven
    other = _outcome(0, False, "JobDeadline", overran=True, in_collective=True)
    other["dump"] = _dump(0, ["gloo:all_reduce"] * 4 + ["gloo:barrier"])
    mism = _group_result({0: other, 1: stuck}, 2, "gloo", 9)
    assert mism.diagnosis == "deadlock" and "mismatched collectives at #5" in mism.message
    # a rank busy outside collectives at the deadline: unproven, named with its call site
    busy = _group_result({0: _outcome(0, False, "DistBackendError", pg_timeout=True),
                          1: _outcome(1, False, "JobDeadline", overran=True, site="t.py:7 in load")}, 2, "gloo", 9)
    assert (busy.status, busy.diagnosis, busy.busy_ranks) == ("hang", "timeout", [1])
    assert "rank 1 was busy outside any collective at the 9 s deadline, at t.py:7 in load" in busy.message
    # a rank that never reported
    silent = _group_result({0: _outcome(0, False, "DistBackendError", pg_timeout=True), 1: None}, 2, "gloo", 9)
    assert (silent.status, silent.diagnosis, silent.busy_ranks) == ("hang", "timeout", [1])
    assert "rank 1 never reported" in silent.message


@pytest.mark.slow
def test_a_rank_busy_outside_collectives_is_named_and_the_job_ends(tmp_path):
    # SlowCorrect sleeps 1 s before each step on every rank: with a 2 s deadline the watchdog ends
    # the job on each rank (no deadlock is claimed) and the run goes on to the next property
    report = tmp_path / "slow.json"
    codes, outs, ranks, seconds = two_agents(
        tmp_path, ["--target", "fixtures.slow_specimens:SlowCorrect", "--properties", "sensitivity_bound,trajectory",
                   "--models", "mlp", "--seed", "11", "--timeout", "2", "--json", str(report)])
    assert codes == [1, 1], "\n".join(outs)[-3000:]
    got = _verdicts(report)
    assert {v[0] for v in got} == {"sensitivity_bound", "trajectory"}
    # in each property's shared job the configuration running at the deadline is the hang, named with
    # the busy rank's call site; the others are "not run" (an unproven timeout is not retried), never
    # a hang they were not seen to have (runner._split_at_hang)
    for prop in ("sensitivity_bound", "trajectory"):
        mine = [v for v in got if v[0] == prop]
        hung = [v for v in mine if v[2] == "hang"]
        assert hung and all(v[3] == "timeout" for v in hung), mine
        assert all("busy outside any collective at the 2 s deadline, at " in v[4] for v in hung), hung
        assert all(v[2] == "skip" and v[4].startswith(f"not run: the job it shared hung in {prop}")
                   for v in mine if v[2] != "hang"), mine

"""Rank 0's reports in a torchrun job, kept on disk as they must read should a rank process die
(issue 33 item 5, ``gate/journal.py``): without ranks (a plan, hand-fed events and a trail),
then the 2-agent job on upstream opacus, whose gloo abort kills rank 0 in ``deadlock_free``'s
accumulation case (slow)."""

from __future__ import annotations

import itertools
import json
import os
import time
from importlib import resources

import jsonschema
import pytest

from dpfsdp_verify.gate import cli
from dpfsdp_verify.gate.journal import POLL_S, Journal
from dpfsdp_verify.gate.plan import RunPlan
from dpfsdp_verify.properties import PROPERTIES
from dpfsdp_verify.properties.engine.contract import Case
from dpfsdp_verify.properties.engine.runner import judge_cases
from dpfsdp_verify.properties.engine.session import Session

SCHEMA = json.loads(resources.files("dpfsdp_verify").joinpath("schema/report.schema.json").read_text())


def plan_of(tmp_path, *args):
    argv = ["run", "--target", "fixtures.specimens:Correct", "--world-sizes", "2", "--horizon", "0",
            "--wide-world-size", "0",
            "--node-world-size", "0", "--models", "mlp", "--loss-reductions", "mean", "--dtypes", "float64",
            "--json", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml"), *args]
    return RunPlan.from_args(cli.build_parser().parse_args(argv))


def report(tmp_path):
    with open(tmp_path / "r.json") as f:
        data = json.load(f)
    jsonschema.validate(data, SCHEMA)
    return data


def cases_of(journal, pid):
    return [c for c in journal.items(pid) if isinstance(c, Case)]


def test_the_report_on_disk_is_the_one_a_death_now_would_leave(tmp_path):
    plan = plan_of(tmp_path, "--properties", "clipped_step,deadlock_free")
    j = Journal(plan, {"name": "specimen-correct", "version": "0", "ref": "fixtures.specimens:Correct", "opacus": None})
    j.started("clipped_step")
    clipped = cases_of(j, "clipped_step")
    for c in clipped:  # clipped_step's verdicts are in
        j(c.verdict("pass", None, "ok"))
    j.started("deadlock_free")
    planned = cases_of(j, "deadlock_free")
    at = next(i for i, c in enumerate(planned) if c.config().get("local_batches") == "uneven_accum")
    accum = planned[at]
    # the cases before it were judged as their jobs ended (the session's listener), from the runner's own plan
    prop = PROPERTIES["deadlock_free"]
    theirs = [c for c in prop.plan(prop.with_defaults(plan.options)) if isinstance(c, Case)]
    for c, status in zip(theirs[:at], itertools.cycle(["pass", "fail"])):
        j.judged(c, c.verdict(status, None if status == "pass" else "step_divergence", "judged"))
    j.on_job(7, ("fixtures.specimens:Correct", list(accum.specs)), None)
    data = report(tmp_path)
    assert data["exit_code"] == 1
    got = [(r["property"], r["status"], r["diagnosis"], r["config"].get("local_batches")) for r in data["results"]]
    assert got[:len(clipped)] == [("clipped_step", "pass", None, None)] * len(clipped)
    rest = data["results"][len(clipped):]
    assert len(rest) == len(j.items("deadlock_free"))  # every planned configuration, none dropped
    assert [(r["config"], r["status"], r["message"]) for r in rest[:at]] == \
        [(c.config(), s, "judged") for c, s in zip(theirs[:at], itertools.cycle(["pass", "fail"]))]
    [dying] = [r for r in rest if r["status"] == "error"]
    assert dying is rest[at]
    assert (dying["diagnosis"], dying["config"]["local_batches"]) == ("rank_crash", "uneven_accum")
    assert dying["message"].startswith("the torchrun job ended while this configuration ran (job 7, run 1 of 1)")
    assert rest[at + 1:] and all(r["status"] == "skip" and r["message"].startswith(
        "not run: the torchrun job ended in deadlock_free [") and "before this configuration ran" in r["message"]
        for r in rest[at + 1:])
    assert (tmp_path / "r.xml").read_text().count("<testcase") == len(data["results"])
    # the job ended normally: no configuration is blamed any more, the property is between jobs
    j.on_job(None, None, None)
    data = report(tmp_path)
    assert [r["diagnosis"] for r in data["results"] if r["status"] == "error"] == ["rank_crash"]
    assert "between jobs" in next(r for r in data["results"] if r["status"] == "error")["message"]
    j.close()


def test_a_shared_job_blames_the_run_rank_0_is_in_and_later_properties_are_not_run(tmp_path):
    plan = plan_of(tmp_path, "--properties", "norm_fidelity,clipped_step")
    j = Journal(plan, {"name": "specimen-correct", "version": "0", "ref": "fixtures.specimens:Correct", "opacus": None})
    j.started("norm_fidelity")
    cases = cases_of(j, "norm_fidelity")
    assert len(cases) >= 2
    specs = [m.apply(s) for c in cases for m in c.modes for s in c.specs]
    trails = tmp_path / "trail"
    trails.mkdir()
    (trails / "rank0.progress").write_text("run train\nbegin 0 2\nend 0\ndone\nrun train\nbegin 0 2\n")
    j.on_job(3, ("fixtures.specimens:Correct", specs), str(trails))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the watcher follows the trail into run 2
        data = report(tmp_path)
        blamed = [r for r in data["results"] if r["status"] == "error"]
        if blamed and "run 2 of" in blamed[0]["message"]:
            break
        time.sleep(POLL_S)
    second = next(c for c in cases if any(m.apply(s) == specs[len(cases[0].specs) * len(cases[0].modes)]
                                          for m in c.modes for s in c.specs))
    assert [r["config"] for r in blamed] == [second.config()], blamed
    # the run before it ended in this job, but its outputs reach rank 0 only with the job's: lost, said so
    first = next(r for r in data["results"] if r["config"] == cases[0].config() and r["property"] == "norm_fidelity")
    assert first["status"] == "skip" and first["message"].startswith("no verdict: it ran earlier in job 3, in which "
                                                                     "the torchrun job ended in norm_fidelity [")
    later = [r for r in data["results"] if r["property"] == "clipped_step"]
    assert later and all(r["status"] == "skip" and r["message"].startswith("not run: the torchrun job ended in "
                                                                           "norm_fidelity [") for r in later)
    assert len(later) == len(j.items("clipped_step"))
    j.close()


class _Died(BaseException):
    """Rank 0's death in a job: nothing after it runs (no ``except Exception`` catches it)."""


class _DyingJob:
    """The tests' pool as ``TorchrunPool`` drives the journal (``on_job`` before and after each job),
    but its ``die_at``-th job kills rank 0; what was on disk before each job is kept in ``seen``."""

    def __init__(self, pool, journal, die_at, path):
        self.pool, self.journal, self.die_at, self.path = pool, journal, die_at, path
        self.jobs, self.seen = 0, []

    def run(self, fn, *args, **kwargs):
        self.jobs += 1
        self.journal.on_job(self.jobs, args, None)
        self.seen.append(json.loads(self.path.read_text()))
        if self.jobs == self.die_at:
            raise _Died()
        try:
            return self.pool.run(fn, *args, **kwargs)
        finally:
            self.journal.on_job(None, None, None)


def test_the_cases_a_property_ran_before_a_job_killed_rank_0_keep_their_verdicts(tmp_path, pool):
    """The runner judges each case as its job ends (the session's listener, ``engine/session.py``), so
    the report on disk when a later job of the same property kills rank 0 has those cases' real verdicts
    -- the same as judged at the property's end -- the dying one's error, and only the cases never run
    as ``skip``."""
    plan = plan_of(tmp_path, "--properties", "deadlock_free", "--world-sizes", "1,2")
    prop = PROPERTIES["deadlock_free"]
    opts = prop.with_defaults(plan.options)
    cases = [c for c in prop.plan(opts) if isinstance(c, Case)]
    assert [c.world_size for c in cases[:3]] == [1, 1, 2] and len(cases) > 3 and all(c.isolate for c in cases)
    j = Journal(plan, {"name": "specimen-correct", "version": "0", "ref": "fixtures.specimens:Correct", "opacus": None})
    j.started("deadlock_free")
    dying = _DyingJob(pool, j, die_at=3, path=tmp_path / "r.json")
    with pytest.raises(_Died):
        judge_cases(prop, cases, dying, opts.timeout, Session(listener=j.judged))
    j.close()
    # before the second job, the first case's verdict was already on disk (judged when its job ended),
    # the second case blamed should that job kill rank 0
    assert [r["status"] for r in dying.seen[1]["results"][:3]] == ["pass", "error", "skip"]
    data = report(tmp_path)
    assert data["exit_code"] == 1
    results = data["results"]
    assert [r["config"] for r in results] == [c.config() for c in cases]  # every planned configuration, in order
    # the same verdicts as the runner gives when it judges at the end (without a listener)
    alone = judge_cases(prop, cases[:2], pool, opts.timeout)
    assert [(r["status"], r["diagnosis"]) for r in results[:2]] == [(v.status, v.diagnosis) for v in alone] \
        == [("pass", None)] * 2
    assert (results[2]["status"], results[2]["diagnosis"]) == ("error", "rank_crash")
    assert results[2]["message"].startswith("the torchrun job ended while this configuration ran (job 3, run 1 of 1)")
    assert all(r["status"] == "skip" and r["message"].startswith("not run: the torchrun job ended in deadlock_free [")
               for r in results[3:])


def test_no_report_file_no_journal(tmp_path):
    plan = RunPlan.from_args(cli.build_parser().parse_args(["run", "--target", "fixtures.specimens:Correct",
                                                            "--properties", "clipped_step", "--json", "-"]))
    j = Journal(plan, {"name": "x"})
    j.started("clipped_step")
    assert not j.enabled and os.listdir(tmp_path) == []


@pytest.mark.slow
def test_a_rank_killed_by_gloos_abort_in_a_two_node_job_still_leaves_a_report(tmp_path):
    """Issue 33 item 5's command (narrowed to the mlp, mean, float64 for time): upstream opacus at 4
    ranks; deadlock_free's accumulation case makes gloo abort a rank (SIGABRT) and torchrun's agents
    end the job. Every selected property has its verdicts in the report, the dying configuration
    its error, and no process of the job outlives it (``two_agents`` proves it)."""
    from tests.gate.test_torchrun_job import two_agents

    path = tmp_path / "r.json"
    codes, outs, ranks, seconds = two_agents(
        tmp_path, ["--target", "opacus", "--properties", "norm_fidelity,clipped_step,deadlock_free", "--models", "mlp",
                   "--loss-reductions", "mean", "--dtypes", "float64", "--json", str(path)], timeout=600)
    both = "\n".join(outs)
    assert any(c != 0 for c in codes), both[-3000:]
    assert "SIGABRT" in both or "EnforceNotMet" in both, both[-3000:]  # the death this is about happened
    assert path.exists(), both[-3000:]
    data = json.loads(path.read_text())
    jsonschema.validate(data, SCHEMA)
    assert data["exit_code"] == 1
    results = data["results"]
    assert {r["property"] for r in results} == {"norm_fidelity", "clipped_step", "deadlock_free"}
    # the two properties before the crash were judged at 4 ranks, none left out
    for pid in ("norm_fidelity", "clipped_step"):
        mine = [r for r in results if r["property"] == pid]
        assert mine and all(r["status"] != "skip" or "not run at this size" not in r["message"] for r in mine)
        assert any(r["status"] in ("pass", "fail", "error") for r in mine)
    # every planned configuration of every selected property is in the report, none dropped
    from dpfsdp_verify.gate.plan import RunPlan

    plan = RunPlan.from_args(cli.build_parser().parse_args(
        ["run", "--target", "opacus", "--properties", "norm_fidelity,clipped_step,deadlock_free", "--models", "mlp",
         "--loss-reductions", "mean", "--dtypes", "float64"]), job_world_size=4)
    journal = Journal(plan, {"name": "opacus"})
    for pid in plan.properties:
        assert [r["config"] for r in results if r["property"] == pid] == [c.config() for c in cases_of(journal, pid)]
    mine = [r for r in results if r["property"] == "deadlock_free"]
    at = next(i for i, r in enumerate(mine) if r["config"].get("local_batches") == "uneven_accum")
    crashed = mine[at]
    assert crashed["status"] == "error" and crashed["diagnosis"] in ("rank_crash", "step_divergence"), crashed
    # the configurations that ran before it (one job each) keep their own verdicts: upstream passes the
    # even, single, uneven and shared-seed Poisson splits and hangs on per-rank Poisson seeds (finding 6)
    ran = {r["config"]["local_batches"]: (r["status"], r["diagnosis"]) for r in mine[:at]}
    # (and the one process asked twice for its epsilon, history_twice, passes)
    assert ran == {"even": ("pass", None), "single": ("pass", None), "uneven": ("pass", None),
                   "poisson_same": ("pass", None), "poisson_per_rank": ("hang", "step_divergence"),
                   "history_twice": ("pass", None)}, mine[:at]
    # only those never run are skip, each saying so
    assert mine[at + 1:] and all(r["status"] == "skip" and r["message"].startswith("not run: the torchrun job ended "
                                                                                  "in deadlock_free [")
                                 for r in mine[at + 1:])

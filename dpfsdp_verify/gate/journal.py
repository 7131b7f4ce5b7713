"""Rank 0's reports of a torchrun job, kept on disk as they would be if the job ended now.

Inside a torchrun job a rank process can die without a word: gloo aborts a process on a
mismatched collective (a C++ ``terminate``, SIGABRT: nothing in it runs after, no handler, no
``finally``), and torchrun's agent then ends the other ranks of its node (SIGTERM), rank 0 -- the
gate, which holds every verdict -- among them when it is on that node, or is the one that died.
A report written at the end is then never written. So rank 0 writes its reports (``--json``,
``--junit``, ``--markdown``: each atomically, ``report.write_atomically``) *before* each job, as
they must read if this job kills the run, and again as the job goes on:

* the verdicts so far;
* the job's configuration -- the one whose run rank 0's own progress trail shows it in (a
  thread rereads the trail while the job runs) -- as ``error`` / ``rank_crash``: "the torchrun
  job ended while this configuration ran ...". Only rank 0's trail is at hand (the others' die
  with their ranks), so a step divergence is not claimed here: it is not proven;
* the running property's configurations already judged with their verdicts: the runner judges
  each as soon as the job that settles its runs has ended (the session's listener, ``engine/session.py``, on rank 0
  of a torchrun job), so a crash loses none that was in;
* its other configurations as ``skip``: "no verdict: ..." for one that ran earlier in the dying job
  (a job's outputs reach rank 0 only at its end), "not run: ..." for the rest; every configuration
  of the properties after it as ``skip`` ("not run: ...");
* exit code 1 (or what the verdicts give, if higher).

When the run ends normally the gate's own reports replace these (``report.finish``). What it
costs: one report written per job and per property, and a trail read every ``POLL_S`` while a
job runs (measured in ``docs/torchrun.md``).
"""

from __future__ import annotations

import os
import threading
from typing import Dict, List, Optional

from ..properties import PROPERTIES
from ..properties.engine.contract import Case, Property
from ..verdict import Verdict, config_label
from . import report
from .expectations import environment
from .result import judge

#: how often the running job's trail on rank 0 is reread
POLL_S = 0.2


def _key(spec) -> str:
    """A spec as the runner ships it, but for the checkpoint directory it places under a job's
    temporary directory (``runner.with_checkpoint_dir``)."""
    from dataclasses import fields

    return repr(tuple((f.name, getattr(spec, f.name)) for f in fields(spec) if f.name != "checkpoint_dir"))


def _asks(case: Case) -> set:
    """The runs (``_key``) ``case`` asks of the ranks."""
    return {_key(m.apply(s)) for m in case.modes for s in case.specs}


def _config_key(config: dict) -> str:
    """A configuration as a key: the journal's own plan of a property and the runner's give equal
    configurations, not the same ``Case`` objects."""
    return repr(sorted(config.items(), key=lambda kv: kv[0]))


class Journal:
    """See the module docstring. ``started`` and ``__call__`` are ``run.Progress``' hooks (a
    property begins; a verdict is in); ``judged`` is the runner's (the session's listener: a case of the
    running property is judged); ``on_job`` is ``TorchrunPool``'s."""

    def __init__(self, plan, target: Dict):
        self.plan, self.target = plan, target
        reports = plan.reports
        self.enabled = bool((reports.json and reports.json != "-") or reports.junit or reports.markdown)
        self.done: List[Verdict] = []
        self.current: Optional[str] = None
        #: the running property's configurations judged so far, by ``_config_key``
        self._judged: Dict[str, List[Verdict]] = {}
        self._items: Dict[str, list] = {}
        self._job: Optional[int] = None
        self._specs: list = []
        self._trail: Optional[str] = None
        self._run_index = 0
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._watcher: Optional[threading.Thread] = None

    # -- hooks ---------------------------------------------------------------------------------
    def started(self, property_id: str) -> None:
        with self._lock:
            self.current = property_id
            self._judged = {}
            self.write()

    def __call__(self, verdict: Verdict) -> None:
        with self._lock:
            self.done.append(verdict)

    def judged(self, case: Case, verdict: Verdict) -> None:
        """A case of the running property has its verdict (written with the next report: before the
        next job, or when the next property begins)."""
        with self._lock:
            if case.property == self.current:
                self._judged.setdefault(_config_key(verdict.config), []).append(verdict)

    def on_job(self, job: Optional[int], args, trail_dir: Optional[str]) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        with self._lock:
            self._job = job
            self._specs = list(args[1]) if job is not None and args and len(args) > 1 \
                and isinstance(args[1], (list, tuple)) else []
            self._trail = os.path.join(trail_dir, "rank0.progress") if trail_dir else None
            self._run_index = 0
            self.write()
        if job is not None and self._trail and self.enabled:
            self._stop = threading.Event()
            self._watcher = threading.Thread(target=self._watch, args=(self._stop, self._trail), daemon=True,
                                             name="dpfsdp-journal")
            self._watcher.start()

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None

    def _watch(self, stop: threading.Event, trail: str) -> None:
        """While a job runs: follow rank 0's trail, and rewrite the reports when it enters another run."""
        from ..targets import progress

        directory = os.path.dirname(trail)
        while not stop.wait(POLL_S):
            try:
                [t] = progress.read(directory, 1)
            except Exception:
                continue
            index = progress.hung_run_index([t]) if t is not None else None
            with self._lock:
                if stop.is_set():
                    return
                if index is not None and index != self._run_index:
                    self._run_index = index
                    self.write()

    # -- the reports ---------------------------------------------------------------------------
    def items(self, property_id: str) -> list:
        """The property's planned items (``Case``s and the plan's own verdicts), as the runner plans them."""
        if property_id not in self._items:
            prop: Property = PROPERTIES[property_id]
            try:
                self._items[property_id] = list(prop.plan(prop.with_defaults(self.plan.options)))
            except Exception as e:  # the runner reports the same failure as the property's verdict
                self._items[property_id] = [prop.internal_error(self.plan.options, "planning", e, 0.0)]
        return self._items[property_id]

    def verdicts(self) -> List[Verdict]:
        """The report's verdicts if the job ended now (module docstring)."""
        out = list(self.done)
        if self.current is None:
            return out
        order = list(self.plan.properties)
        at = order.index(self.current) if self.current in order else len(order)
        # the configurations judged so far keep their verdicts; only the others can be the dying one
        judged = {k: list(v) for k, v in self._judged.items()}
        told: Dict[int, Verdict] = {}
        for item in self.items(self.current):
            if isinstance(item, Case) and judged.get(_config_key(item.config())):
                told[id(item)] = judged[_config_key(item.config())].pop(0)
        cases = [c for c in self.items(self.current) if isinstance(c, Case) and id(c) not in told]
        dying = self._dying(cases)
        where = (f"{dying[0].property} [{config_label(dying[0].config())}]" if dying
                 else f"{self.current} [{config_label(Property.whole_run_config(self.plan.options))}]")
        ended = f"the torchrun job ended in {where} (a rank process died)"
        if not dying:  # between jobs (rank 0 planning or judging), or a job of no planned configuration
            when = (f"while job {self._job} of this property ran (not one of its planned configurations: a fuzzed "
                    "example)" if self._job is not None else
                    "while rank 0 planned or judged this property's configurations, between jobs")
            out.append(Verdict(self.current, "error", Property.whole_run_config(self.plan.options),
                               diagnosis="rank_crash", message=self._crash_text(when),
                               evidence={"torchrun_job_ended": True}))
        earlier = self._ran_earlier_in_job()
        for item in self.items(self.current):
            if not isinstance(item, Case):
                out.append(item)
            elif id(item) in told:
                out.append(told[id(item)])
            elif any(item is d for d in dying):
                out.append(item.verdict("error", "rank_crash", self._crash_text(
                    f"while this configuration ran (job {self._job}, run {self._run_index + 1} of {len(self._specs)})"),
                    {"torchrun_job_ended": True, "torchrun_job": self._job}))
            elif _asks(item) & earlier:
                out.append(item.verdict("skip", None, f"no verdict: it ran earlier in job {self._job}, in which "
                                        f"{ended}; a job's outputs reach rank 0 only when the job ends, so its "
                                        "outputs were lost with it. For its verdict run it on its own (--properties, "
                                        "--models, --loss-reductions, --dtypes narrow the matrix)"))
            else:
                out.append(item.verdict("skip", None, f"not run: {ended} before this configuration ran. For its "
                                        "verdict run it on its own, or with the spawning gate (without --launcher "
                                        "torchrun), which starts a fresh group after a crash"))
        for pid in order[at + 1:]:
            for item in self.items(pid):
                out.append(item if not isinstance(item, Case) else
                           item.verdict("skip", None, f"not run: {ended}. For its verdict run it on its own, or "
                                        "with the spawning gate (without --launcher torchrun), which starts a fresh "
                                        "group after a crash"))
        return out

    def _ran_earlier_in_job(self) -> set:
        """The runs (``_key``) of the job rank 0's trail shows ended before the one it is in."""
        if self._job is None or not self._specs:
            return set()
        return {_key(s) for s in self._specs[:min(self._run_index, len(self._specs) - 1)]}

    def _dying(self, cases: List[Case]) -> List[Case]:
        """The configuration(s) whose run rank 0 is in: those asking for the job's spec at the run
        index its trail shows (several cases asking the same run share it), else the job's first."""
        if self._job is None or not self._specs:
            return []
        index = min(self._run_index, len(self._specs) - 1)
        keys = [_key(s) for s in self._specs]
        in_job = [c for c in cases if _asks(c) & set(keys)]
        running = [c for c in in_job if keys[index] in _asks(c)]
        if running or in_job:
            return running or in_job[:1]
        # a job of no planned configuration (a fuzzed example): the property's own
        return []

    def _crash_text(self, when: str) -> str:
        return (f"the torchrun job ended {when}: a rank process died -- gloo, for one, aborts a process on a "
                "mismatched collective (C++ terminate, SIGABRT), and nothing in it runs after -- and torchrun's agent "
                "ended its node's other ranks. No verdict could be judged: rank 0 wrote this report before the job "
                "ended (the torchrun agents' output names the rank and its signal). The spawning gate (without "
                "--launcher torchrun) runs such a target in fresh groups and goes on.")

    def write(self) -> None:
        """Write every report file the plan asks for, as of now (no-op without one)."""
        if not self.enabled:
            return
        with self._lock:
            opts = self.plan.options
            # an unfinished run fails; its expectations judged in the default (gloo) environment
            judged = judge(self.verdicts(), self.target, opts.backend, opts.seed, self.plan.expectations,
                           env=environment(), unfinished=True)
            report.write_reports(self.plan.reports, judged, plot=False)


__all__ = ["POLL_S", "Journal"]

"""Run a checked ``RunPlan`` (``plan.py``) as one ``session.Session`` on one warm pool, with progress
lines on stderr; judge the verdicts once (``result.judge_plan``) and hand the result to
``report.finish``.

Kept apart from ``cli.py`` so that the CLI only parses; both launchers (``cli.cmd_run``, and rank 0
of a torchrun job, ``torchrun_job.py``) call ``execute``; tests and the benchmark call ``run_plan``
(the verdicts alone, no banner and no report).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, List, Optional

from ..harness import JobPool
from ..properties.engine.session import Listener
from ..verdict import Verdict, config_label
from . import report, target_info
from .plan import RunPlan
from .result import judge_plan
from .session import Session, Silent


class Progress:
    """``[3 done  12.4s] PROPERTY ws=2 split mlp mean -> pass`` lines on stderr; each event is also
    handed to ``also`` (a torchrun job's ``journal.Journal``), if given."""

    def __init__(self, quiet: bool, also=None, expected: Optional[Callable[[Verdict], bool]] = None):
        self.quiet, self.t0, self.done, self.also = quiet, time.monotonic(), 0, also
        #: whether the expectations file lists a failing verdict (its line then says ``xfail``)
        self.expected = expected
        self._lock = threading.Lock()  # verdicts come from the judge thread (gate/scheduler.py) and this one

    def started(self, property_id: str) -> None:
        if self.also is not None:
            self.also.started(property_id)
        if not self.quiet:
            print(f"[{self.done} done {time.monotonic() - self.t0:6.1f}s] running {property_id} ...",
                  file=sys.stderr, flush=True)

    def exploring(self, property_id: str) -> None:
        """A property's fuzz runs or exploration begin (after every property's fixed cases)."""
        with self._lock:
            if self.quiet:
                return
            print(f"[{self.done} done {time.monotonic() - self.t0:6.1f}s] exploring {property_id} ...",
                  file=sys.stderr, flush=True)

    def __call__(self, verdict: Verdict) -> None:
        with self._lock:
            if self.also is not None:
                self.also(verdict)
            self.done += 1
            if self.quiet:
                return
            tail = f" ({verdict.diagnosis})" if verdict.diagnosis else ""
            status = verdict.status
            if self.expected is not None and self.expected(verdict):
                status, tail = "xfail", f" ({verdict.status} {verdict.diagnosis}, expected)"
            print(f"[{self.done} done {time.monotonic() - self.t0:6.1f}s] {verdict.property} "
                  f"{config_label(verdict.config)} -> {status}{tail}", file=sys.stderr, flush=True)


def execute(plan: RunPlan, pool: Optional[JobPool] = None, where: str = "", journal=None) -> int:
    """The gate's ``run`` of a checked plan: banner and seed on stderr, progress, the reports; the
    exit code. ``where`` ends the banner (e.g. the torchrun job it runs in); ``journal``: a
    ``journal.Journal`` kept up to date as the run goes (a torchrun job's rank 0): told every case as
    soon as it is judged (the session's listener), so a later job's crash loses none."""
    progress = Progress(plan.quiet, also=journal, expected=_expected_test(plan))
    target = target_info.describe_target(plan.options.target, plan.info)
    if journal is not None:
        journal.target = target
    opts = plan.options
    if not plan.quiet:
        print(target_info.banner(target, opts.backend, opts.world_sizes, plan.properties, opts.meshes) + where,
              file=sys.stderr,
              flush=True)
        print(f"seed {opts.seed} (replay this run with --seed {opts.seed})", file=sys.stderr, flush=True)
        if plan.explore > 0:
            print(f"exploring {plan.explore} configurations per explored property beyond the fixed cases, drawn "
                  f"from seed {opts.seed} (time cap {plan.explore_cap:g} s; --explore 0: a fixed run; "
                  "docs/explore.md)", file=sys.stderr, flush=True)
        elif plan.explore_note:
            print(plan.explore_note, file=sys.stderr, flush=True)
    verdicts = Session(plan, pool, progress, journal.judged if journal is not None else None).run()
    if journal is not None:
        journal.close()
    result = judge_plan(plan, verdicts, target)
    return report.finish(plan, result)


def execute_spawned(plan: RunPlan) -> int:
    """``execute`` of a plan ``RunPlan.parse`` checked, on ranks the gate starts itself: the pool made
    first (its zygotes import torch and the target while this process loads the target,
    ``RunPlan.loaded``); closed at the end."""
    from .session import spawned_pool

    pool = spawned_pool(plan)
    try:
        return execute(plan.loaded(), pool)
    finally:
        pool.close()


def _expected_test(plan: RunPlan) -> Optional[Callable[[Verdict], bool]]:
    """Whether a verdict is a failure the plan's expectations list, as ``expectations.apply`` will
    judge it at the end (``None`` without ``--expect``)."""
    if plan.expectations is None:
        return None
    from ..verdict import FAILING, INTERNAL_ERROR
    from .expectations import environment

    env = environment(plan.options.backend)
    entries = [e for e in plan.expectations.entries if e.applies(env)]
    return lambda v: (v.status in FAILING and v.diagnosis != INTERNAL_ERROR and any(e.covers(v) for e in entries))


def run_plan(plan: RunPlan, progress: Optional[Callable[[Verdict], None]] = None,
             pool: Optional[JobPool] = None, listener: Optional[Listener] = None) -> List[Verdict]:
    """Every selected property's verdicts (then its fuzz runs' and exploration's), in plan order, then
    the release judge's: one ``Session`` run (``session.py``). ``progress``: a ``Progress`` or any
    callable taking each verdict; ``listener``: told each case as soon as it is judged. Never raises
    for a target's failure: a property that cannot run becomes an ``error`` verdict saying why."""
    reporter = progress if isinstance(progress, Progress) else Silent(progress)
    return Session(plan, pool, reporter, listener).run()


__all__ = ["Progress", "execute", "execute_spawned", "run_plan"]

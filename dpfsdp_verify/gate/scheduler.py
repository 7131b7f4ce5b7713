"""How a gate run's fixed cases are scheduled: one interface (``Scheduler``), two policies, chosen in
one place (``choose``) from what the pool declares it can do (``JobPool.side_lane``) and whether the
run tells a listener each case as it is judged (``Session.listener``):

* ``Serial``: property by property (``runner.run_property``'s steps), each property's cases judged
  once its jobs have run (or, with a listener, each as soon as its job ended) -- a torchrun job's
  rank 0 (its pool runs rank 0's share of a job in this very process and has no side lane, and its
  journal follows one property at a time) and a caller's own job pool;
* ``Pipelined``: the ranks run one property's jobs while this process judges the cases already run
  and plans the properties after it (below).

Both give the same verdicts in the same order (tests/gate/test_pipeline.py); exploration and the
release judge come after, in the session (``gate/session.py``).

Run property by property, the gate's own work -- planning (reference
norms for the clip bounds, the layer zoo), judging (the float64 reference of every case, the
noise statistics) and the ranks' jobs -- took turns: ~12 s of this process' CPU per default run
while the ranks waited, and the ranks' ~45 s of jobs while this process waited. Here the same
three steps (``runner.plan_property``, ``runner.judge_case``, ``runner.in_plan_order``) run in two
threads:

* the **judge** thread (which feeds the session's release ledger, ``releases/judge.py``) plans every
  property in order and hands each one's cases to the calling thread; then it judges each property's
  cases in case order as their outcomes come in, and hands the property's verdicts, in report order,
  to ``progress``;
* the **calling** thread runs the cases' jobs (``runner.run_cases``), property after property,
  and hands each case's outcome to the judge as soon as the job that settles it has ended.

Two more overlaps: a property's 1-rank gloo cases (``solo_case``) run on the pool's side lane
(``Pool.side_lane``, a thread of the pool's own) beside its larger groups' jobs -- a 1-rank job
leaves the second core to the judge, a 2-rank one none, so 1-rank jobs beside 2-rank ones fill the
cores -- and a run two properties ask for (the same target, world size, mode and specs:
two properties' one-step clip runs at the same bound: 14 in the default gate) runs once
(``runner.run_cases``' ``shared``; the runs are deterministic in their specs, seeds included).

Only the calling thread and the side lane start and talk to ranks, each on groups of its own (a
rank's parent-death signal follows the thread that started it: both live as long as the ranks
they start), and only the judge thread computes with torch while they run (on one torch thread,
``threads.one_thread``, as the ranks do). So the verdicts, and the order in which cases feed the
ledger, are those of the property-by-property run; only when each is judged differs. Fuzzing and
exploration (adaptive: each draw's verdict decides the next) run after, in the calling thread
(``gate/session.py``).

Where it is not used, ``Serial`` runs property by property, with the same verdicts.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union, cast

from ..harness import JobPool
from ..properties import PROPERTIES
from ..properties.engine import runner
from ..properties.engine.contract import Case, Options, Outputs, Property
from ..properties.engine.session import Session
from ..verdict import Verdict

#: each property's options (with its defaults; ``None``: its planning, jobs or judging raised) and its
#: fixed cases' verdicts in report order, by property id
Fixed = Dict[str, Tuple[Optional[Options], List[Verdict]]]

#: what the calling thread sends for a property whose jobs raised (a bug of the runner)
_CRASHED = -1
#: how often a waiting judge looks whether the calling thread stopped early (an interrupt)
_POLL_S = 0.25


class _Aborted(Exception):
    """The calling thread stopped before this property's jobs had run."""


@dataclass
class _Planned:
    pid: str
    prop: Property
    opts: Options
    items: list
    cases: List[Case]
    t0: float
    #: set when the calling thread stopped early: no more outcomes will come
    stop: threading.Event
    inbox: "queue.Queue[Tuple[int, object]]" = field(default_factory=queue.Queue)


class Scheduler(Protocol):
    """Runs and judges a gate run's fixed cases, property by property in report order."""

    name: str
    #: whether other jobs (the session's explorations) may run beside this policy's
    explores_beside: bool

    def fixed(self, properties: Sequence[str], opts: Options, pool: JobPool, session: Optional[Session] = None,
              progress: Optional[Callable[[Verdict], None]] = None, started: Optional[Callable[[str], None]] = None,
              warm_up: Optional[Callable[[], None]] = None) -> Fixed:
        """Each property's options and fixed verdicts (``Fixed``); ``progress`` gets each verdict once
        judged, ``started`` each property's id as its jobs begin, ``warm_up`` is called (never waits)
        before each property's jobs: groups started ahead (``Session.prestart``)."""
        ...


class Serial:
    """Property by property: plan, run, judge (``runner.run_property``'s steps); a property that
    raised is its ``internal_error`` verdict and the others go on."""

    name = "serial"
    explores_beside = False

    def fixed(self, properties: Sequence[str], opts: Options, pool: JobPool, session: Optional[Session] = None,
              progress: Optional[Callable[[Verdict], None]] = None, started: Optional[Callable[[str], None]] = None,
              warm_up: Optional[Callable[[], None]] = None) -> Fixed:
        results: Fixed = {}
        for pid in properties:
            if started is not None:
                started(pid)
            if warm_up is not None:
                warm_up()
            prop, t0 = PROPERTIES[pid], time.monotonic()
            try:
                popts, items, cases = runner.plan_property(prop, opts)
                judged = runner.judge_cases(prop, cases, pool, popts.timeout, session)
                results[pid] = (popts, runner.in_plan_order(items, judged))
            except Exception as e:  # a bug in a check or an unloadable target: report, go on
                results[pid] = (None, [prop.internal_error(opts, "running", e, time.monotonic() - t0)])
            for v in results[pid][1]:
                if progress is not None:
                    progress(v)
        return results


class Pipelined:
    """The ranks run one property's jobs while this process judges and plans (module docstring)."""

    name = "pipelined"
    explores_beside = True

    def fixed(self, properties: Sequence[str], opts: Options, pool: JobPool, session: Optional[Session] = None,
              progress: Optional[Callable[[Verdict], None]] = None, started: Optional[Callable[[str], None]] = None,
              warm_up: Optional[Callable[[], None]] = None) -> Fixed:
        return run_fixed(properties, opts, pool, progress, started, warm_up, session)


def choose(pool: JobPool, session: Optional[Session] = None) -> Scheduler:
    """The one place a policy is chosen: ``Pipelined`` where the pool has a side lane (ranks in
    processes of their own: ``harness.Pool``, or a view of one) and no listener must be told each case
    as it is judged; else ``Serial``."""
    if pool.side_lane() is not None and (session is None or session.listener is None):
        return Pipelined()
    return Serial()


def run_fixed(properties: Sequence[str], opts: Options, pool: JobPool,
              progress: Optional[Callable[[Verdict], None]] = None,
              started: Optional[Callable[[str], None]] = None, warm_up: Optional[Callable[[], None]] = None,
              session: Optional[Session] = None) -> Fixed:
    """Each property's options (with its defaults) and its fixed cases' verdicts in report order,
    by property id (module docstring). A property whose planning, jobs or judging raised has no
    options (``None``) and one ``error`` / ``internal_error`` verdict (a bug of this suite; the
    others' verdicts stand).
    ``progress`` gets each property's verdicts once it is judged, ``started`` each property's id as
    its jobs begin; ``warm_up`` is called in the calling thread while the first property is planned
    and again before each property's jobs (e.g. groups started ahead, ``Session.prestart``: it must not
    wait, and starts what it could not start before); ``session``: the run's ledger."""
    todo: "queue.Queue[Optional[_Planned]]" = queue.Queue()
    stop = threading.Event()
    results: Fixed = {}
    planned: List[_Planned] = []
    died: List[BaseException] = []

    def judge_all() -> None:
        try:
            with runner.one_thread():
                for pid in properties:
                    if stop.is_set():
                        break
                    item = _plan(pid, opts, results, stop)
                    if item is not None:
                        planned.append(item)
                        todo.put(item)
                todo.put(None)
                for item in planned:
                    results[item.pid] = _judge(item, session)
                    try:
                        for v in results[item.pid][1]:
                            if progress is not None:
                                progress(v)
                    except Exception as e:  # a bug in reporting progress: this property's internal error
                        results[item.pid] = (None, [item.prop.internal_error(item.opts, "reporting", e, 0.0)])
        except BaseException as e:  # never silently: the calling thread raises it once this thread ends
            died.append(e)
            raise
        finally:
            todo.put(None)  # never leave the calling thread waiting for a plan

    judge = threading.Thread(target=judge_all, name="dpfsdp-judge", daemon=True)
    judge.start()
    finished = False
    lane = pool.side_lane()
    beside: list = []  # the side lane's futures
    shared: Dict[object, list] = {}  # a run two properties ask for runs once (``run_cases``' ``shared``)
    try:
        if warm_up is not None:
            warm_up()
        while (item := todo.get()) is not None:
            if started is not None:
                started(item.pid)
            if warm_up is not None:  # groups whose zygotes were still importing last time
                warm_up()
            solo = [i for i, case in enumerate(item.cases) if solo_case(case)] if lane is not None else []
            if solo and lane is not None:
                beside.append(lane.submit(_run_part, item, solo, pool, shared))
            _run_part(item, sorted(set(range(len(item.cases))) - set(solo)), pool, shared)
        for future in beside:
            future.result()
        finished = True
    finally:
        if not finished:  # interrupted: no judge may wait for outcomes that will never come
            stop.set()
        judge.join()
    if died:
        raise RuntimeError(f"the gate's judge thread stopped: {died[0]!r}") from died[0]
    return results


def solo_case(case: Case) -> bool:
    """Whether ``case`` runs on the side lane: one gloo rank in a warm group of the pool's own
    environment (no mode variables, no fresh processes)."""
    return (case.world_size == 1 and case.backend == "gloo" and not case.fresh_groups
            and not any(m.env_dict for m in case.modes))


def _run_part(item: _Planned, indices: List[int], pool: JobPool, shared: Dict[object, list]) -> None:
    """Run the cases ``indices`` of ``item`` (``runner.run_cases``, runs made for an earlier property
    taken from ``shared``), each outcome handed to the property's judge under its index; a bug of
    the runner is handed over as ``_CRASHED``."""
    if not indices:
        return
    try:
        runner.run_cases([item.cases[i] for i in indices], pool, item.opts.timeout,
                         on_ready=lambda k, outcome: item.inbox.put((indices[k], outcome)), shared=shared)
    except Exception as e:  # a bug of the runner: this property's internal error, the others go on
        item.inbox.put((_CRASHED, e))


def _plan(pid: str, opts: Options, results: dict, stop: threading.Event) -> Optional[_Planned]:
    """``pid``'s plan, or ``None`` with its internal error in ``results`` when planning raised."""
    prop, t0 = PROPERTIES[pid], time.monotonic()
    try:
        popts, items, cases = runner.plan_property(prop, opts)
    except Exception as e:  # a bug in a check or an unloadable target: report, go on
        results[pid] = (None, [prop.internal_error(opts, "running", e, time.monotonic() - t0)])
        return None
    return _Planned(pid, prop, popts, items, cases, t0, stop)


def _judge(item: _Planned, session: Optional[Session]) -> Tuple[Optional[Options], List[Verdict]]:
    """``item``'s options and verdicts in report order, each case judged (``runner.judge_case``) in
    case order as its outcome comes in (no options: it raised)."""
    outcomes: Dict[int, object] = {}
    judged: List[Verdict] = []
    try:
        for i, case in enumerate(item.cases):
            while i not in outcomes:
                try:
                    k, outcome = item.inbox.get(timeout=_POLL_S)
                except queue.Empty:
                    if item.stop.is_set():
                        raise _Aborted(f"stopped before {item.pid}'s jobs had run") from None
                    continue
                if k == _CRASHED:
                    raise outcome  # type: ignore[misc]  # the runner's exception, with its traceback
                outcomes[k] = outcome
            outcome = outcomes.pop(i)
            judged.append(runner.settle(item.prop, case, cast(Union[Verdict, Outputs], outcome), session))
        return item.opts, runner.in_plan_order(item.items, judged)
    except Exception as e:  # a bug in a check: this property's internal error (as run property by property)
        return None, [item.prop.internal_error(item.opts, "running", e, time.monotonic() - item.t0)]


__all__ = ["Fixed", "Scheduler", "Serial", "Pipelined", "choose", "run_fixed", "solo_case"]

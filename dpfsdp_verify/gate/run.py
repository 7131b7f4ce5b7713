"""Run a checked ``RunPlan`` (``plan.py``) property by property on one warm pool, with progress
lines on stderr, and hand the verdicts to ``report.finish``.

Kept apart from ``cli.py`` so that the CLI only parses; both launchers (``cli.cmd_run``, and rank 0
of a torchrun job, ``torchrun_job.py``) call ``execute``; tests and the benchmark call ``run_plan``.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Union

from ..harness import JobPool, Pool
from ..properties import PROPERTIES
from ..properties.releases import judge as releases
from ..properties.engine.runner import Fuzzer, fuzz_property, run_property
from ..verdict import Verdict, config_label
from . import pipeline, report, target_info
from .plan import RunPlan

#: upper bound on warm worker groups kept by one gate run
MAX_WARM_GROUPS = 6


class Progress:
    """``[3 done  12.4s] PROPERTY ws=2 split mlp mean -> pass`` lines on stderr; each event is also
    handed to ``also`` (a torchrun job's ``journal.Journal``), if given."""

    def __init__(self, quiet: bool, also=None):
        self.quiet, self.t0, self.done, self.also = quiet, time.monotonic(), 0, also
        self._lock = threading.Lock()  # verdicts come from the judge thread (gate/pipeline.py) and this one

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
            print(f"[{self.done} done {time.monotonic() - self.t0:6.1f}s] {verdict.property} "
                  f"{config_label(verdict.config)} -> {verdict.status}{tail}", file=sys.stderr, flush=True)


def execute(plan: RunPlan, pool: Optional[JobPool] = None, where: str = "", journal=None) -> int:
    """The gate's ``run`` of a checked plan: banner and seed on stderr, progress, the reports; the
    exit code. ``where`` ends the banner (e.g. the torchrun job it runs in); ``journal``: a
    ``journal.Journal`` kept up to date as the run goes (a torchrun job's rank 0)."""
    progress = Progress(plan.quiet, also=journal)
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
            print(f"exploring {plan.explore:g} s beyond the fixed cases, drawn from seed {opts.seed} (--explore 0: a "
                  "fixed run; docs/explore.md)", file=sys.stderr, flush=True)
        elif plan.explore_note:
            print(plan.explore_note, file=sys.stderr, flush=True)
    verdicts = run_plan(plan, progress=progress, pool=pool)
    if journal is not None:
        journal.close()
    return report.finish(plan, verdicts, target)


def run_plan(plan: RunPlan, progress: Optional[Callable[[Verdict], None]] = None,
             pool: Optional[JobPool] = None) -> List[Verdict]:
    """Every selected property's verdicts (then its fuzz runs', with ``--fuzz``), in plan order.
    Never raises for a target's failure: a property that cannot run becomes an ``error`` verdict
    saying why."""
    own_pool = pool is None
    opts = plan.options
    pool = pool or size_pool(Pool(), plan)
    budget = _ExploreBudget(plan)
    fuzz = _fuzzer(plan.fuzz, budget.share)
    verdicts: List[Verdict] = []
    # every noisy run any property makes feeds the release judge (properties/releases/judge.py)
    ledger = releases.Ledger() if releases.PROPERTY_ID in plan.properties else None
    try:
        with releases.collecting(ledger):
            if pipeline.usable(pool):
                verdicts += _pipelined(plan, pool, fuzz, progress, budget)
            else:
                _prestart(pool, opts)
                verdicts += _one_by_one(plan, pool, fuzz, progress)
        if ledger is not None:
            t0 = time.monotonic()
            try:
                found = ledger.verdicts(opts)
            except Exception as e:  # a bug in the release judge: exit 3, the verdicts above still stand
                found = [PROPERTIES[releases.PROPERTY_ID].internal_error(opts, "judging every release for",
                                                                          e, time.monotonic() - t0)]
            for v in found:
                verdicts.append(v)
                if progress:
                    progress(v)
    finally:
        if own_pool:
            pool.close()
    return verdicts


def size_pool(pool: Pool, plan: RunPlan) -> Pool:
    """``pool`` keeping one warm group per (world size, mode) the plan (and its exploration) uses, so
    that no property restarts ranks another one just used (a restart costs seconds; idle ranks only
    cost memory), at most ``MAX_WARM_GROUPS`` (+2 with exploration)."""
    opts = plan.options
    sizes = (len(opts.world_sizes) + len(opts.meshes)
             + len({opts.wide_world_size, opts.node_world_size} - {0} - set(opts.world_sizes)))
    if plan.explore > 0:  # exploration draws world sizes 1..explore_max_world_size(): keep them warm too
        from ..config.space import explore_max_world_size

        sizes = len(set(opts.world_sizes) | set(range(1, explore_max_world_size() + 1))
                    | ({opts.wide_world_size, opts.node_world_size} - {0})) + len(opts.meshes)
    pool.max_groups = min(MAX_WARM_GROUPS + (2 if plan.explore > 0 else 0), sizes * len(opts.modes))
    return pool


#: the zygotes ``early_pool`` starts: those of the first groups a gate run forks (1 and 2 ranks)
EARLY_ZYGOTES = 2


def early_pool(target: str, mode_env: Sequence[str] = ()) -> Pool:
    """The gate's pool, made before its plan is checked, its first ``EARLY_ZYGOTES`` zygotes already
    importing torch and the target's modules (``target_modules``) while this process imports its own
    (~2.5 s on 2 cores that the first job no longer waits for). With ``--mode-env`` the first groups'
    environment is a mode's: nothing is started ahead. The caller closes it."""
    pool = Pool()
    if not mode_env and EARLY_ZYGOTES > 0:
        pool.warm(EARLY_ZYGOTES, None, target_modules(target))
    return pool


def _one_by_one(plan: RunPlan, pool: JobPool, fuzz: Optional[Fuzzer], progress) -> List[Verdict]:
    """Every selected property's verdicts, property by property (``runner.run_property``)."""
    verdicts: List[Verdict] = []
    for pid in plan.properties:
        if progress and hasattr(progress, "started"):
            progress.started(pid)
        t0 = time.monotonic()
        try:
            found = run_property(PROPERTIES[pid], plan.options, pool, fuzz=fuzz)
        except Exception as e:  # a bug in a check or an unloadable target: report, go on
            found = [PROPERTIES[pid].internal_error(plan.options, "running", e, time.monotonic() - t0)]
        for v in found:
            verdicts.append(v)
            if progress:
                progress(v)
    return verdicts


def _pipelined(plan: RunPlan, pool: JobPool, fuzz: Optional[Fuzzer], progress,
               budget: Optional["_ExploreBudget"] = None) -> List[Verdict]:
    """The same verdicts as ``_one_by_one``, in the same order: every property's fixed cases run and
    judged at once (``pipeline.run_fixed``: the ranks run jobs while this process judges and plans),
    then each property's fuzz runs and exploration."""
    started = progress.started if progress and hasattr(progress, "started") else None
    # the wide and node groups start while the first property is planned
    fixed = pipeline.run_fixed(plan.properties, plan.options, pool, progress, started,
                               warm_up=lambda: _prestart(pool, plan.options))
    explored = _explore_all(plan, pool, fuzz, fixed, progress, budget)
    return [v for pid in plan.properties for v in fixed[pid][1] + explored.get(pid, [])]


def _explores(plan: RunPlan, pid: str) -> bool:
    """Whether ``pid`` has fuzz runs or an exploration in this run."""
    prop = PROPERTIES[pid]
    return bool((plan.fuzz and prop.fuzz is not None) or (plan.explore > 0 and prop.explore is not None))


def _explore_all(plan: RunPlan, pool: JobPool, fuzz: Optional[Fuzzer], fixed: dict, progress,
                 budget: Optional["_ExploreBudget"] = None) -> Dict[str, List[Verdict]]:
    """Each property's fuzz and exploration verdicts (``runner.fuzz_property``), by property id, one
    property after another: explorations adapt (each draw's verdict decides the next) and keep both
    cores busy on their own (two at once, measured: as many draws in all as one after the other).
    ``budget`` shares the run's exploration seconds out among them as they go (``_ExploreBudget``)."""
    todo = [pid for pid in plan.properties if fuzz is not None and fixed[pid][0] is not None
            and _explores(plan, pid)]  # no options: its planning, jobs or judging raised
    if budget is not None:
        budget.begin(sum(1 for pid in todo if PROPERTIES[pid].explore is not None))

    out: Dict[str, List[Verdict]] = {}
    for pid in todo:
        if progress and hasattr(progress, "exploring"):
            progress.exploring(pid)
        out[pid] = fuzz_property(PROPERTIES[pid], fixed[pid][0], pool, fuzz)
        if progress:
            for v in out[pid]:
                progress(v)
    return out


def _prestart(pool, opts) -> None:
    """Start the groups of the run's world sizes (the wide and node ones too) in the background, as
    the run begins and again before each property (``pipeline.run_fixed``), so that a group's start
    (fork, rendezvous, process group, the target's imports: ``target_modules``) overlaps the jobs
    and planning before its first job instead of adding to the run's wall time. Never waits: a group
    whose zygotes still import (the wide and node ranks' at the start) is started by a later call
    (``Pool.prestart``); it waited 1-2.5 s here before its first job could run."""
    prestart = getattr(pool, "prestart", None)
    if prestart is None:  # a caller's own job pool
        return
    for ws in sorted(set(opts.world_sizes) | {opts.wide_world_size, opts.node_world_size} - {0}):
        if (ws == opts.wide_world_size and opts.wide_unavailable) or (
                ws == opts.node_world_size and opts.node_unavailable):
            continue
        for mode in opts.modes:
            prestart(ws, opts.backend, mode.env_dict or None, preload=target_modules(opts.target))


def target_modules(ref: str) -> tuple:
    """The modules a rank imports to load the target ``ref`` (``targets.load_target``): opacus and its
    adapter for ``opacus``, the module of a ``module:Attr`` reference; none for an entry point's name
    (found when a job loads it)."""
    from ..targets import BUILTIN

    ref = ref.strip()
    if ref in BUILTIN:
        return (("opacus",) if ref == "opacus" else ()) + (BUILTIN[ref].split(":")[0],)
    return (ref.split(":")[0],) if ":" in ref else ()


#: the least share of the exploration seconds a property gets when the ones before it spent them
#: all: its exploration then runs one draw (``fuzz.explore``: a budget > 0 always runs one)
MIN_EXPLORE_SHARE_S = 1e-3


class _ExploreBudget:
    """The run's exploration seconds (``--explore``) shared out among the explored properties. Where
    the explorations run one after another at the end (``_explore_all`` calls ``begin``), each gets an
    equal share of the seconds *left*: an exploration's last draw ends past its share (a draw is never
    cut), and that overrun comes out of the next ones' shares, so the phase ends near ``--explore``
    (measured on `Correct`: 12 s for 6 s before). Elsewhere (property by property, ``_one_by_one``) each
    gets ``--explore`` / the explored properties."""

    def __init__(self, plan: RunPlan):
        self.total = plan.explore
        self.properties = sum(1 for p in plan.properties if PROPERTIES[p].explore is not None)
        self.start: Optional[float] = None
        self.left = 0

    def begin(self, properties: int) -> None:
        self.start, self.left = time.monotonic(), max(1, properties)

    def share(self) -> float:
        """The seconds the next exploration may spend (0: no exploration in this run)."""
        if self.total <= 0 or not self.properties:
            return 0.0
        if self.start is None:
            return self.total / self.properties
        n, self.left = self.left, max(1, self.left - 1)
        return max((self.total - (time.monotonic() - self.start)) / n, MIN_EXPLORE_SHARE_S)


def _fuzzer(n_examples: int, explore_s: Union[float, Callable[[], float]] = 0.0) -> Optional[Fuzzer]:
    """With ``--fuzz N``: each fuzzable property's N fuzzed examples; with exploration
    (``--explore``, docs/explore.md): each explored property's ``explore_s`` seconds (a number, or
    a function giving each its share as it starts: ``_ExploreBudget.share``) of drawn configurations
    after them (hypothesis, the ``fuzz`` extra: the plan checked it is installed)."""
    share = explore_s if callable(explore_s) else (lambda: float(explore_s))
    if not n_examples and not share():
        return None

    def run(prop, opts, pool):
        verdicts = []
        if n_examples and prop.fuzz is not None:
            from ..fuzz import fuzz_examples

            verdicts += fuzz_examples(prop, opts, n_examples, pool)
        seconds = share() if prop.explore is not None else 0.0
        if seconds > 0:
            from ..fuzz.explore import explore_property
            from ..harness.backends import visible_gpus

            # nccl: one GPU per rank, so no draw beyond the GPUs this machine has (gloo: the cores decide)
            most = visible_gpus() if opts.backend == "nccl" else None
            verdicts += explore_property(prop, opts, seconds, pool, max_world_size=most)
        return verdicts

    return run


__all__ = ["MAX_WARM_GROUPS", "Progress", "execute", "run_plan"]

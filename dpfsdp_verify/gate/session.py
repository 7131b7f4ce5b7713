"""One object owns a gate run: ``Session``.

It holds what a run needs from start to end -- the checked plan (options, seed, properties), the
pool, the progress reporter, the release ledger and the verdict listener (the engine's part,
``properties/engine/session.py``, handed down to every case judged), the exploration budget and
the fuzzer, and the scheduling policy (``scheduler.choose``) -- and runs it in four steps::

    fixed = session.fixed()          # every property's fixed cases, by the scheduler's policy
    explored = session.explore(fixed)  # each property's fuzz runs and exploration, in order
    releases = session.judge()       # then the whole-run release judge over every noisy run
    session.close()                  # the pool, if the session made it

``run`` does the four and returns the verdicts in report order. Where the policy runs jobs beside
one another (``Pipelined``), the explorations run on a lane of the pool's own (``"explore"``) beside
the fixed cases instead of after them -- each draw is the seed's whatever runs beside it, and the
exploration's time cap starts only when the fixed cases are done (``ExploreBudget``) -- so that the
cores the fixed cases leave idle (group starts, a rank waiting for its peer, the judge's turns) draw
configurations; the verdicts and their order are the same. The gate (``run.execute``, for a
torchrun job's rank 0 too, with its journal as the listener) builds one, and the tests through
``run.run_plan``; nothing is found in a context variable or probed for with ``getattr``:
the pool declares what it can do (``JobPool.side_lane`` / ``prestart``).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from ..harness import JobPool, Pool
from ..harness.cores import plan_cores, usable_cores
from ..properties import PROPERTIES
from ..properties.engine import session as engine_session
from ..properties.engine.contract import Options, Property
from ..properties.engine.runner import Fuzzer, fuzz_property
from ..properties.releases import judge as releases
from ..verdict import Verdict
from . import scheduler

if TYPE_CHECKING:  # types only: the fuzzer (hypothesis) is imported when a run explores
    from ..fuzz.explore import Deadline
from .plan import RunPlan

#: upper bound on warm worker groups kept by one gate run
MAX_WARM_GROUPS = 6
#: the zygotes ``early_pool`` starts: those of the first groups a gate run forks (1 and 2 ranks)
EARLY_ZYGOTES = 2


class Reporter(Protocol):
    """What a session tells as it goes (``run.Progress``): each verdict, each property's start, each
    exploration's start."""

    def __call__(self, verdict: Verdict) -> None: ...

    def started(self, property_id: str) -> None: ...

    def exploring(self, property_id: str) -> None: ...


class Silent:
    """A ``Reporter`` that tells nothing, or only the verdicts to a plain callable."""

    def __init__(self, on_verdict: Optional[Callable[[Verdict], None]] = None):
        self.on_verdict = on_verdict

    def __call__(self, verdict: Verdict) -> None:
        if self.on_verdict is not None:
            self.on_verdict(verdict)

    def started(self, property_id: str) -> None:
        pass

    def exploring(self, property_id: str) -> None:
        pass


class Session(engine_session.Session):
    """One gate run's state and its steps (module docstring)."""

    def __init__(self, plan: RunPlan, pool: Optional[JobPool] = None, reporter: Optional[Reporter] = None,
                 listener: Optional[engine_session.Listener] = None):
        # every noisy run any property makes feeds the release judge (properties/releases/judge.py)
        ledger = releases.Ledger() if releases.PROPERTY_ID in plan.properties else None
        super().__init__(ledger=ledger, listener=listener)
        self.plan = plan
        self.options: Options = plan.options
        self.own_pool = pool is None
        self.pool: JobPool = pool if pool is not None else size_pool(Pool(), plan)
        self.reporter: Reporter = reporter if reporter is not None else Silent()
        self.budget = ExploreBudget(plan)
        self.fuzzer = self._fuzzer()
        self.policy: scheduler.Scheduler = scheduler.choose(self.pool, self)

    # -- the steps ------------------------------------------------------------------------------
    def run(self) -> List[Verdict]:
        """Every selected property's verdicts (then its fuzz runs' and exploration's), in plan order,
        then the release judge's; the pool closed if the session made it. Never raises for a target's
        failure: a property that cannot run becomes an ``error`` verdict saying why."""
        try:
            beside = self._explore_beside()
            fixed = self.fixed()
            if beside is not None:
                self.budget.begin()  # what is left of the explorations gets the cap from now
                explored = beside.result()
            else:
                explored = self.explore(fixed)
            # a property whose planning, jobs or judging raised has its internal error only (as run alone)
            verdicts = [v for pid in self.plan.properties
                        for v in fixed[pid][1] + (explored.get(pid, []) if fixed[pid][0] is not None else [])]
            return verdicts + self.judge()
        except BaseException:
            self.stopping.set()  # an exploration under way runs no further draw
            raise
        finally:
            self.close()

    def fixed(self) -> scheduler.Fixed:
        """Every property's fixed cases, run and judged by the session's policy."""
        return self.policy.fixed(self.plan.properties, self.options, self.pool, self, self.reporter,
                                 self.reporter.started, self.prestart)

    def explore(self, fixed: Optional[scheduler.Fixed] = None) -> Dict[str, List[Verdict]]:
        """Each property's fuzz and exploration verdicts (``runner.fuzz_property``), by property id, one
        property after another: explorations adapt (each draw's verdict decides the next). After the
        fixed cases (``fixed``: each property's options from them; the budget's time cap starts here),
        or beside them (``fixed=None``: each property's options with its defaults, ``_explore_beside``)."""
        todo = [(pid, opts) for pid in self.plan.properties if self.fuzzer is not None
                and self._explores(PROPERTIES[pid]) and (opts := self._options(pid, fixed)) is not None]
        if fixed is not None:
            self.budget.begin()
        out: Dict[str, List[Verdict]] = {}
        for pid, opts in todo:
            self.reporter.exploring(pid)
            out[pid] = fuzz_property(PROPERTIES[pid], opts, self.pool, self.fuzzer)
            for v in out[pid]:
                self.reporter(v)
        return out

    def judge(self) -> List[Verdict]:
        """The release judge's verdicts over every noisy run the session's cases made (none when
        its property is not selected); a bug there is its ``internal_error`` (exit 3), the
        verdicts before it still stand."""
        if self.ledger is None:
            return []
        t0 = time.monotonic()
        assert isinstance(self.ledger, releases.Ledger)
        try:
            found = self.ledger.verdicts(self.options)
        except Exception as e:  # a bug in the release judge
            found = [PROPERTIES[releases.PROPERTY_ID].internal_error(self.options, "judging every release for",
                                                                      e, time.monotonic() - t0)]
        for v in found:
            self.reporter(v)
        return found

    def close(self) -> None:
        """Close the pool if the session made it."""
        if self.own_pool:
            self.pool.close()

    # -- helpers --------------------------------------------------------------------------------
    def _explore_beside(self):
        """The explorations started on the pool's ``"explore"`` lane (a future of ``explore``'s
        result), where the policy runs jobs beside one another; ``None``: they run after the fixed cases."""
        if self.fuzzer is None or not self.policy.explores_beside:
            return None
        lane = self.pool.side_lane("explore")
        if lane is None:
            return None
        self.budget.beside = True
        return lane.submit(self.explore, None)

    def _options(self, pid: str, fixed: Optional[scheduler.Fixed]) -> Optional[Options]:
        """``pid``'s options with its defaults: the fixed cases' (``None`` where its planning, jobs or
        judging raised), or, beside them, computed here (``None`` where that raises: the fixed cases
        report it)."""
        if fixed is not None:
            return fixed[pid][0]
        try:
            return PROPERTIES[pid].with_defaults(self.options)
        except Exception:  # the fixed cases' planning raises the same: their internal error says it
            return None

    def prestart(self) -> None:
        """Start the groups of the run's world sizes (the wide and node ones too) in the background, as
        the run begins and again before each property, so that a group's start (fork, rendezvous,
        process group, the target's imports: ``target_modules``) overlaps the jobs and planning before
        its first job instead of adding to the run's wall time. Never waits: a group whose zygotes still
        import (the wide and node ranks' at the start) is started by a later call (``Pool.prestart``);
        a pool that cannot start groups ahead answers ``False`` (``JobPool.prestart``)."""
        opts = self.options
        for ws in sorted(set(opts.world_sizes) | {opts.wide_world_size, opts.node_world_size} - {0}):
            if (ws == opts.wide_world_size and opts.wide_unavailable) or (
                    ws == opts.node_world_size and opts.node_unavailable):
                continue
            for mode in opts.modes:
                self.pool.prestart(ws, opts.backend, mode.env_dict or None, preload=target_modules(opts.target))

    def _explores(self, prop: Property) -> bool:
        """Whether ``prop`` has fuzz runs or an exploration in this run."""
        return bool((self.plan.fuzz and prop.fuzz is not None) or (self.plan.explore > 0 and prop.explore is not None))

    def _fuzzer(self) -> Optional[Fuzzer]:
        """With ``--fuzz N``: each fuzzable property's N fuzzed examples; with exploration
        (``--explore``, docs/explore.md): each explored property's draws (the budget's: its draws and
        the cap's deadline as each starts) after them (hypothesis, the ``fuzz`` extra: the plan checked
        it is installed). Every run feeds the session's ledger."""
        return make_fuzzer(self.plan.fuzz, self.budget, self)


class ExploreBudget:
    """The run's exploration: ``--explore`` draws for each explored property, and one time cap for
    the whole phase (``--explore-cap``). The cap starts when the explorations start (``begin``), or,
    for explorations that run beside the fixed cases (``beside``), when the fixed cases are done: the
    draws are the seed's on any machine, and the cap only bounds what is left after the fixed cases
    (a ``fuzz.explore.CapClock``, asked as the draws go)."""

    def __init__(self, plan: RunPlan):
        self.draws = int(plan.explore) if any(PROPERTIES[p].explore is not None for p in plan.properties) else 0
        self.cap = float(plan.explore_cap or 0.0) or math.inf
        #: the explorations run beside the fixed cases: the cap starts when they are done
        self.beside = False
        self._until: Optional[float] = None

    def begin(self) -> None:
        self._until = time.monotonic() + self.cap

    def deadline(self) -> float:
        """The cap's deadline (``time.monotonic()``), ``math.inf`` until it starts."""
        return self._until if self._until is not None else math.inf

    def share(self) -> "Tuple[int, Deadline]":
        """``(draws, deadline)`` of the next exploration (0 draws: no exploration in this run); the
        deadline is this budget, asked as the draws go, for explorations beside the fixed cases."""
        if self.beside:
            return self.draws, self
        if self.draws and self._until is None:
            self.begin()
        return self.draws, self.deadline()


def make_fuzzer(n_examples: int, explore: "int | ExploreBudget" = 0,
                session: Optional[engine_session.Session] = None) -> Optional[Fuzzer]:
    """The runner's ``Fuzzer``: with ``n_examples``, each fuzzable property's fuzzed examples; with
    ``explore`` (a number of draws, no cap; or the run's ``ExploreBudget``), each explored property's
    draws after them; ``None`` with neither. Every verdict's runs feed ``session``'s ledger."""
    if isinstance(explore, int):
        drawn = int(explore)
        share: Callable[[], Tuple[int, Deadline]] = lambda: (drawn, math.inf)  # noqa: E731
    else:
        drawn, share = explore.draws, explore.share
    if not n_examples and not drawn:
        return None

    return PropertyFuzzer(n_examples, share, session)


class PropertyFuzzer:
    """A ``Fuzzer`` (``make_fuzzer``): called with a property, its options and the pool, the
    property's ``n_examples`` fuzzed examples, then its explored draws (``share``: how many, and the
    deadline they run to); every verdict's runs feed ``session``'s ledger."""

    def __init__(self, n_examples: int, share: Callable[[], Tuple[int, Deadline]],
                 session: Optional[engine_session.Session]):
        self.n_examples, self.share, self.session = n_examples, share, session

    def __call__(self, prop: Property, opts: Options, pool) -> List[Verdict]:
        verdicts: List[Verdict] = []
        if self.n_examples and prop.fuzz is not None:
            from ..fuzz import fuzz_examples

            verdicts += fuzz_examples(prop, opts, self.n_examples, pool, session=self.session)
        draws, deadline = self.share() if prop.explore is not None else (0, math.inf)
        if draws > 0:
            from ..fuzz.explore import explore_property
            from ..harness.backends import visible_gpus

            # nccl: one GPU per rank, so no draw beyond the GPUs this machine has (gloo: the cores decide)
            most = visible_gpus() if opts.backend == "nccl" else None
            verdicts += explore_property(prop, opts, draws, pool, max_world_size=most, deadline=deadline,
                                         session=self.session)
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
    group_sizes = run_world_sizes(plan)
    pool.max_groups = min(MAX_WARM_GROUPS + (2 if plan.explore > 0 else 0), sizes * len(opts.modes))
    pool.cores = plan_cores(usable_cores(), group_sizes)
    return pool


def run_world_sizes(plan: RunPlan) -> Tuple[int, ...]:
    """Every group size the run starts: its world sizes, wide and node world sizes, meshes' ranks and
    the world sizes exploration draws (what ``cores.plan_cores`` shares the cores among)."""
    from ..targets.mesh import Mesh

    opts = plan.options
    sizes = set(opts.world_sizes) | ({opts.wide_world_size, opts.node_world_size} - {0})
    sizes |= {Mesh.parse(m).world_size for m in opts.meshes}
    if plan.explore > 0:
        from ..config.space import explore_max_world_size

        sizes |= set(range(1, explore_max_world_size() + 1))
    return tuple(sorted(sizes))


def early_pool(target: str, mode_env: Sequence[str] = ()) -> Pool:
    """The gate's pool, made before its plan is checked, its first ``EARLY_ZYGOTES`` zygotes already
    importing torch and the target's modules (``target_modules``) while this process imports its own
    (~2.5 s on 2 cores that the first job no longer waits for). With ``--mode-env`` the first groups'
    environment is a mode's: nothing is started ahead. The caller closes it."""
    # its cores are shared for the run's group sizes by ``size_pool``, before its first group starts
    # (a zygote does not depend on them: a rank sets its threads after the fork, ``launch.rank_threads``)
    pool = Pool()
    if not mode_env and EARLY_ZYGOTES > 0:
        pool.warm(EARLY_ZYGOTES, None, target_modules(target))
    return pool


def spawned_pool(plan: RunPlan) -> Pool:
    """The pool of a gate that starts its own ranks: ``early_pool``'s for the plan's target and
    modes, sized for the plan (``size_pool``: nothing ``RunPlan.loaded`` changes). The caller closes it."""
    return size_pool(early_pool(plan.options.target, plan.mode_env), plan)


def target_modules(ref: str) -> tuple:
    """The modules a rank imports to load the target ``ref`` (``targets.load_target``): opacus and its
    adapter for ``opacus``, the module of a ``module:Attr`` reference; none for an entry point's name
    (found when a job loads it)."""
    from ..targets import BUILTIN

    ref = ref.strip()
    if ref in BUILTIN:
        return (("opacus",) if ref == "opacus" else ()) + (BUILTIN[ref].split(":")[0],)
    return (ref.split(":")[0],) if ":" in ref else ()


__all__ = ["Session", "Reporter", "Silent", "ExploreBudget", "make_fuzzer", "PropertyFuzzer", "size_pool",
           "early_pool", "spawned_pool", "target_modules", "MAX_WARM_GROUPS", "EARLY_ZYGOTES"]

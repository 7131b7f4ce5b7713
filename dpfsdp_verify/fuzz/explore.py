"""Exploration: configurations drawn from the configuration space beyond the gate's fixed cases
(``dpfsdp-verify run --explore DRAWS``, docs/explore.md).

The fixed cases are points someone picked; a bug one step outside them (rows >= 40 of a local
batch left unclipped, when the largest fixed local batch was 33 -- the floor now runs 64; a clip that only breaks in
float32 at lr 0.3 at 4 ranks) passes every one of them. Each property with an ``explore`` recipe
(``contract.ExploreRecipe``) therefore judges a number of configurations (``--explore DRAWS``) that
hypothesis draws from ``strategies.explore_specs`` -- every range is an axis'
``explore`` range in ``dpfsdp_verify.config.space``, draw ``i`` inside its regions of the stratified
axes (``fuzz/strata.py``: any 4 consecutive draws reach every quarter of sigma, lr, the local batch
and the C quantile, every world size 1..4, precision and batch mode) -- each prepared by the recipe (e.g. C at a drawn
quantile of the reference norms), run on the gate's warm pool and judged by the property's own
``judge``. The draws are seeded by the run's seed (``space.seed_for(seed, property, "explore",
0)``), so ``--seed S`` draws the same configurations in the same order, and as many of them, on
any machine: the count is the seed's, not the clock's.

One hypothesis run per draw, its strategy confined to the draw's regions (a run's choices must
not change with the draw: hypothesis replays them), seeded ``seed_for(seed, property, "explore",
i)``; its first example (hypothesis' simplest of the regions, their bottom corner) is not judged,
its second is the draw. Generation depends on the seed and on the examples' outcomes only, never on
time. Time is only a cap (``deadline``, ``--explore-cap``): a draw that
would start past it is not run, and the verdict says the cap was hit and how many of the seed's
draws ran (``config["explore"]["capped"]``; the exit line says so too). A draw that fails (``fail``,
``hang``, ``error``) is shrunk by hypothesis towards its smallest configuration inside its regions, in at most
``SHRINK_RUNS`` more runs (a count, so a replay shrinks to the same configuration on any machine;
``SHRINK_S`` seconds past the cap bound it on a slow host: a failing gate run is worth a short
report), and that is the property's exploration verdict: the property's diagnosis and message for
the smallest configuration, its config (``config["explore"]``: what it drew beyond the usual keys),
``evidence["explored"] = True``, and a ``dpfsdp-verify replay ... --exact`` line that re-runs
exactly that spec. Without a failure the property's one ``pass`` verdict says how many
configurations passed and what they covered.

Every result is cached by configuration, so hypothesis' own replay of the shrunk example sees the
same verdict, and a draw past the cap is not run (it passes, unrun and uncounted).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, Union

from hypothesis import HealthCheck, Phase, given
from hypothesis import seed as hypothesis_seed
from hypothesis import settings as Settings

from ..harness import Pool
from ..config.modes import Mode
from ..properties.engine import runner
from ..properties.engine.contract import Options, Property
from ..properties.engine.session import Session, stopping
from ..config import space
from ..config.space import explore_max_world_size, seed_for
from ..targets import RunSpec
from ..verdict import FAILING, Verdict
from . import strata as strata_mod
from . import strategies
from .search import Counterexample, run_to_counterexample

#: runs a found failure may spend shrinking: a number, not seconds, so that the same seed shrinks to the
#: same configuration on any machine; 8 runs take ~7 s on 2 idle cores (a known upstream failure found
#: by exploration took 29 runs, 26 s, under the former 30 s)
SHRINK_RUNS = 8
#: seconds a found failure may spend shrinking past the cap, on a host too slow for ``SHRINK_RUNS``
SHRINK_S = 30.0


class CapClock(Protocol):
    """A time cap whose deadline is known only later (``gate/session.ExploreBudget``: a gate that
    explores beside its fixed cases starts the cap when they are done): ``deadline()`` now
    (``math.inf`` until it starts), ``cap`` its length in seconds."""

    cap: float

    def deadline(self) -> float: ...


#: an exploration's time cap: a ``time.monotonic()`` deadline, or a ``CapClock``
Deadline = Union[float, CapClock]
#: the draws a pass verdict lists in its evidence (the first ones)
LISTED_DRAWS = 40


class _Explorer:
    """One property's exploration: its draws, the cap's clock, the cache, the counts."""

    def __init__(self, prop: Property, opts: Options, draws: int, pool: Pool, modes: Sequence[Mode],
                 max_world_size: int, deadline: "Deadline" = math.inf, session: Optional[Session] = None):
        self.prop, self.opts, self.pool, self.modes = prop, opts, pool, tuple(modes)
        self.session = session
        self.t0 = time.monotonic()
        self.n_draws = draws
        self._deadline = deadline
        #: draws of the seed's that were not run: the time cap was hit before them
        self.unrun = 0
        self.max_world_size = max_world_size
        self.cache: Dict[Tuple[int, str, str], Verdict] = {}
        self.seen: Counter = Counter()
        self.draws: List[str] = []
        self.found_at: Optional[float] = None
        #: how many draws had been judged when the first failure was found (the rest shrank it)
        self.found_draw = 0
        #: examples the current round's hypothesis run has made (its first, the regions' corner, is not judged)
        self.round_calls = 0

    def plan(self) -> List[Dict[str, Tuple[int, int]]]:
        """The regions of the seed's ``n_draws`` draws (``fuzz/strata.py``), named by the run seed."""
        assert self.prop.explore is not None
        kw: Dict[str, Any] = {"models": space.EXPLORE_MODELS, "samplings": space.choice("sampling").drawn,
              "precisions": space.choice("precision").drawn, "physical": True, "resume": False, "noise": False}
        kw.update((k, v) for k, v in self.prop.explore.draw_kwargs().items() if k in kw)
        counts = strata_mod.axis_counts(self.max_world_size, dtypes=strategies.DTYPES, **kw)
        return strata_mod.plan(seed_for(self.opts.seed, self.prop.id, "explore", "strata"), self.n_draws, counts)

    @property
    def deadline(self) -> float:
        """The time cap's deadline now (a ``CapClock`` is asked each time)."""
        return self._deadline if isinstance(self._deadline, (int, float)) else self._deadline.deadline()

    def spent(self) -> bool:
        """Whether the time cap is hit (an exploration always runs its first draw, however slow the
        host; a found failure shrinks for ``SHRINK_RUNS`` more runs, within ``SHRINK_S`` more seconds),
        or the run is stopping (an interrupt: no further draw)."""
        if stopping(self.session):
            return True
        if not self.seen:
            return False
        now = time.monotonic()
        if self.found_at is None:
            return now > self.deadline
        return (sum(self.seen.values()) - self.found_draw >= SHRINK_RUNS
                or now > max(self.deadline, self.found_at) + SHRINK_S)

    def example(self, drawn) -> None:
        ws, spec, knobs = drawn
        self.round_calls += 1
        if self.round_calls == 1 and self.found_at is None:
            return  # hypothesis' simplest example of the draw's regions: not the draw (module docstring)
        key = (ws, spec.to_json(), json.dumps(knobs, sort_keys=True))
        v = self.cache.get(key)
        if v is None:
            if self.spent():
                if self.found_at is None:
                    self.unrun += 1
                return  # past the cap: not run, not counted
            v = self.run(ws, spec, knobs)
            self.cache[key] = v
            self.seen[v.status] += 1
            if self.found_at is None:
                resumed = knobs.get("resume_fraction")
                self.draws.append(f"ws={ws} {strategies.spec_summary(spec, ws)}; lr {spec.lr:g}; "
                                  f"C quantile {knobs.get('clip_quantile', 0.5):.2f}"
                                  + (f"; resumed at {resumed:.2f} of its steps" if resumed is not None else "")
                                  + (f"; sigma {knobs['noise_multiplier']:.3g}" if "noise_multiplier" in knobs else ""))
        if v.status in FAILING:
            if self.found_at is None:
                self.found_at, self.found_draw = time.monotonic(), sum(self.seen.values())
            # the spec as run (the recipe's prepare applied): what the replay line re-runs
            ready = self.prop.explore.prepare(spec, knobs) if self.prop.explore else spec
            raise Counterexample(v, ready if isinstance(ready, RunSpec) else spec)

    def run(self, ws: int, spec: RunSpec, knobs: dict) -> Verdict:
        with runner.one_thread():
            case = self.prop.explore_case(self.opts, spec, knobs, ws, self.modes)
            if isinstance(case, Verdict):
                return case
            return unproven_timeout_skipped(runner.judge_cases(self.prop, [case], self.pool, self.opts.timeout,
                                                               self.session)[0])

    def round(self, index: int, strata: strata_mod.Strata) -> Optional[Verdict]:
        """Draw ``index`` in its regions ``strata`` (one hypothesis run: its simplest example, unjudged,
        then the draw); the shrunk failure's verdict, or ``None``."""
        seed = seed_for(self.opts.seed, self.prop.id, "explore", index)
        self.round_calls = 0
        settings = Settings(max_examples=2, database=None, derandomize=False, deadline=None,
                            report_multiple_bugs=False, print_blob=True, phases=(Phase.generate, Phase.shrink),
                            suppress_health_check=list(HealthCheck))
        assert self.prop.explore is not None
        strategy = strategies.explore_specs(self.max_world_size, grad_sample_mode=self.opts.grad_sample_mode,
                                            strata=strata, **self.prop.explore.draw_kwargs())
        def example(drawn):
            self.example(drawn)

        shrunk = run_to_counterexample(settings(hypothesis_seed(seed)(given(strategy)(example))))
        return self.failure(shrunk[0], shrunk[1], index) if shrunk is not None else None

    def failure(self, found: Counterexample, notes: List[str], index: int) -> Verdict:
        v = found.verdict
        run = sum(self.seen.values())
        explore = {**v.config.get("explore", {}), "draws": run, "found_at_draw": self.found_draw,
                   "seed": self.opts.seed, "round": index, "draws_asked": self.n_draws}
        evidence = {**v.evidence, "explored": True, "spec": json.loads(found.spec.to_json()), "draws_run": run,
                    "found_at_draw": self.found_draw}
        return Verdict(v.property, v.status, {**v.config, "explore": explore}, diagnosis=v.diagnosis,
                       evidence=evidence, repro=v.repro, seconds=round(time.monotonic() - self.t0, 3),
                       message=(f"exploration found a failing configuration (draw {self.found_draw} of run seed "
                                f"{self.opts.seed}; {run - self.found_draw} more to shrink it); shrunk to the "
                                "smallest: "
                                f"{strategies.spec_summary(found.spec, v.config.get('world_size') or 1)}, lr "
                                f"{found.spec.lr:g}, C {found.spec.max_grad_norm:.4g}. {v.message}"),
                       details="\n".join(["hypothesis: " + n for n in notes] + ([v.details] if v.details else [])))

    def summary(self, rounds: int) -> Verdict:
        n = sum(self.seen.values())
        seconds = round(time.monotonic() - self.t0, 3)
        explore = {"draws": n, "seed": self.opts.seed, "rounds": rounds, "max_world_size": self.max_world_size,
                   "draws_asked": self.n_draws, **self.cap_fields()}
        config = {"world_size": None, "data_layout": "explored", "model": "explored",
                  "mode": " vs ".join(m.label for m in self.modes), "grad_sample_mode": self.opts.grad_sample_mode,
                  "explore": explore}
        evidence = {"explored": True, "statuses": dict(self.seen), "draws": self.draws[:LISTED_DRAWS]}
        if self.seen["pass"] == 0:
            return Verdict(self.prop.id, "skip", config, seconds=seconds, evidence=evidence,
                           message=f"exploration ran no configuration ({n} drawn and run, none passed or failed)"
                                   + self.cap_note())
        return Verdict(self.prop.id, "pass", config, seconds=seconds, evidence=evidence, message=(
            f"{self.seen['pass']} explored configurations passed (drawn from the configuration space beyond the "
            f"fixed cases: world sizes 1..{self.max_world_size}, local batches up to 64, lr, C among the norms, "
            f"dtypes and precisions, model variants{self._more()}; {self.n_draws} draws of run seed "
            f"{self.opts.seed}, docs/explore.md)" + self.cap_note()))

    def cap_fields(self) -> dict:
        """``{"capped": True, "unrun_draws": k, "cap_s": ...}`` when the time cap stopped draws, else ``{}``."""
        if not self.unrun:
            return {}
        cap = (self.deadline - self.t0 if isinstance(self._deadline, (int, float)) else self._deadline.cap)
        return {"capped": True, "unrun_draws": self.unrun, "cap_s": round(cap, 3)}

    def cap_note(self) -> str:
        """The sentence a verdict ends with when the time cap stopped draws; "" otherwise."""
        if not self.unrun:
            return ""
        return (f". TIME CAP HIT: {self.n_draws - self.unrun} of the seed's {self.n_draws} draws ran; the last "
                f"{self.unrun} were not (--explore-cap; a replay of --seed {self.opts.seed} on a less loaded machine "
                "or with a larger cap runs them)")

    def _more(self) -> str:
        kw = self.prop.explore.draw_kwargs() if self.prop.explore is not None else {}
        parts = []
        if "poisson" in kw.get("samplings", ("poisson",)):
            parts.append("Poisson sampling" + (" and runs up to 200 steps" if kw.get("long_runs", True) else ""))
        if kw.get("physical", True):
            parts.append("physical batch sizes")
        if kw.get("resume", False):
            parts.append("resume points")
        if kw.get("noise", False):
            parts.append("noise multipliers")
        return "".join(", " + p for p in parts)


def unproven_timeout_skipped(v: Verdict) -> Verdict:
    """An explored draw that ran past its deadline with no deadlock proven (``hang`` / ``timeout``)
    is a ``skip`` saying so: a drawn configuration may be slow on a loaded runner, and a slow draw
    is not a finding (a *proven* deadlock, ``hang`` / ``deadlock`` or ``step_divergence``, stays a
    failure). The fixed cases keep their own rule."""
    if v.status == "hang" and v.diagnosis == "timeout":
        return Verdict(v.property, "skip", v.config, message="explored configuration not judged: it did not finish "
                       f"within its deadline and no deadlock was proven ({v.message[:300]})", evidence=v.evidence,
                       repro=v.repro, seconds=v.seconds)
    return v


def explore_property(prop: Property, opts: Options, draws: int, pool: Optional[Pool] = None,
                     max_world_size: Optional[int] = None, deadline: "Deadline" = math.inf,
                     session: Optional[Session] = None) -> List[Verdict]:
    """``prop``'s exploration: ``draws`` configurations drawn from the run's seed, one verdict (module
    docstring); none when ``draws`` is 0, the property has no recipe, the modes give it nothing to run,
    or ``max_world_size`` is 0 (no GPU for an nccl rank). ``max_world_size``: the largest world size
    drawn (default: ``space.explore_max_world_size()``, the same on every machine). ``deadline``: the time cap
    (``time.monotonic()``, or a ``CapClock``; draws that would start past it are not run, and the verdict says so).
    ``session``: the run's ledger and listener (``engine/session.py``): every draw feeds its ledger."""
    draws = int(draws)
    if draws <= 0 or prop.explore is None or max_world_size == 0:
        return []
    opts = prop.with_defaults(opts)
    groups = prop.mode_groups(opts.modes, opts.params)
    if not groups:
        return []
    own = pool is None
    pool = pool or Pool()
    try:
        ex = _Explorer(prop, opts, draws, pool, groups[0],
                       max_world_size if max_world_size is not None else explore_max_world_size(), deadline,
                       session)
        plan = ex.plan()
        for index, strata in enumerate(plan):
            found = ex.round(index, strata)
            if found is not None:
                return [found]
        return [ex.summary(len(plan))]
    finally:
        if own:
            pool.close()


def check_exact(prop: Property, opts: Options, spec: RunSpec, world_size: int, pool: Pool,
                modes: Sequence[Mode] = (), session: Optional[Session] = None) -> Verdict:
    """The property's verdict for ``spec`` exactly as given (an explored verdict's ``replay
    --exact`` line: no recipe ``prepare``), judged by its ``judge``."""
    opts = prop.with_defaults(opts)
    modes = tuple(modes) or prop.mode_groups(opts.modes, opts.params)[0]
    case = prop.exact_case(opts, spec, world_size, modes)
    with runner.one_thread():
        return runner.judge_cases(prop, [case], pool, opts.timeout, session)[0]


__all__ = ["SHRINK_RUNS", "SHRINK_S", "explore_property", "check_exact"]

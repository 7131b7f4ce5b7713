"""Fuzzing a property: hypothesis draws ``RunSpec``s from the property's recipe
(``Property.fuzz``: which ``strategies.run_specs``, and its ``prepare``), the contract turns each
into a ``Case`` (``Property.fuzz_case``), and ``check`` -- the runner's, ``runner.check_example``,
handed in by ``fuzz_examples`` -- runs and judges it. Nothing here runs ranks or knows a property by name.

One hypothesis run per world size (ascending) and mode group, so a pool keeps the same worker
group warm for a whole run and the first world size that fails is the smallest. When an example
fails (a ``fail``, ``hang`` or ``error`` verdict), hypothesis shrinks it to a minimal
configuration, and that is the run's verdict: the property's diagnosis and message for the
minimal spec, the spec itself (``evidence["spec"]``), the hypothesis seed and
``@reproduce_failure`` blob, and the ``dpfsdp-verify replay`` line (``repro``) that re-runs
exactly that spec (``Case.repro`` of a fuzzed case).

Imported only to fuzz: hypothesis is the optional ``fuzz`` extra.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

from hypothesis import given
from hypothesis import seed as hypothesis_seed
from hypothesis import settings as Settings

from ..config.hypothesis_profiles import profile_settings
from ..config.modes import Mode
from ..targets import RunSpec
from ..verdict import FAILING, Verdict
from ..properties.engine.contract import FuzzRecipe, Options, Property, modes_problem
from . import strategies

DEFAULT_MODELS = ("mlp", "transformer")
#: float64 unless asked (``--dtypes``): fuzzed shapes include degenerate layers (a LayerNorm over one
#: feature) whose float32 rounding, amplified by 1/sqrt(eps), exceeds any fixed float32 tolerance
#: -- measured 3e-3 relative on the correct specimen -- while float64 stays exact there
DEFAULT_DTYPES = ("float64",)

#: ``check(spec, world_size, modes) -> Verdict``: one example run and judged
Check = Callable[[RunSpec, int, Sequence[Mode]], Verdict]


class Counterexample(Exception):
    """Raised inside the hypothesis test for a failing example; carries its verdict and spec."""

    def __init__(self, verdict: Verdict, spec: RunSpec):
        super().__init__(f"{verdict.status}: {verdict.message}")
        self.verdict, self.spec = verdict, spec


def spec_strategy(prop: Property, world_size: int, opts: Options):
    """The ``run_specs`` a property is fuzzed with: its recipe's ``draw`` arguments over the
    options' models and dtypes (``DEFAULT_MODELS`` / ``DEFAULT_DTYPES`` when they name none).
    Every rank gets at least one sample: opacus' own data paths never give a rank an empty batch
    (its distributed Poisson sampler skips them), so an empty one would test the adapter, not the
    target."""
    draw: Dict[str, Any] = dict(models=tuple(opts.models or DEFAULT_MODELS), grad_sample_mode=opts.grad_sample_mode,
                dtype_values=tuple(opts.dtypes or DEFAULT_DTYPES), min_per_rank=1)
    draw.update(cast(FuzzRecipe, prop.fuzz).draw_kwargs())  # only a fuzzable property is fuzzed
    return strategies.run_specs(world_size, **draw)


def fuzz_groups(prop: Property, opts: Options, n_examples: int, check: Check,
                settings: Optional[Settings] = None) -> List[Verdict]:
    """``n_examples`` fuzzed examples at each of the options' world sizes (ascending) and mode
    groups (``Property.mode_groups``): one verdict each (a ``skip`` per world size where the
    modes give the property nothing to compare)."""
    groups = prop.mode_groups(opts.modes, opts.params)
    verdicts: List[Verdict] = []
    for ws in sorted(set(opts.world_sizes)):
        if not groups:
            # no mode group: the modes' problem is named
            verdicts.append(prop.skip(opts, cast(str, modes_problem(prop, opts.modes)), world_size=ws))
        for modes in groups:
            verdicts.append(search(prop, opts, ws, modes, n_examples, check, settings=settings))
    return verdicts


def search(prop: Property, opts: Options, world_size: int, modes: Sequence[Mode], n_examples: int, check: Check,
           *, strategy=None, settings: Optional[Settings] = None) -> Verdict:
    """One hypothesis run of ``n_examples`` examples at one world size under ``modes`` (one mode;
    two for a property that compares modes). ``strategy`` overrides ``spec_strategy``; ``settings``
    the profile's (``hypothesis_profiles.profile_settings()``). The hypothesis seed is the options'
    run seed (``0``: the profile's -- fixed under ``ci``, random otherwise; the verdict records it).
    Returns a ``pass`` verdict (``skip`` if every example skipped), or the minimal failing
    example's verdict (module docstring)."""
    base = settings or profile_settings()
    seed = opts.seed or (0 if base.derandomize else random.getrandbits(32))
    run_settings = Settings(base, max_examples=max(1, n_examples), derandomize=False, report_multiple_bugs=False,
                            deadline=None, print_blob=True)
    strategy = strategy if strategy is not None else spec_strategy(prop, world_size, opts)
    seen: Counter = Counter()
    t0 = time.monotonic()

    def example(spec):
        v = check(spec, world_size, modes)
        seen[v.status] += 1
        if v.status in FAILING:
            raise Counterexample(v, spec)

    # a database key per (property, target, world size, modes): a saved failure replays where it failed
    cast(Any, example)._hypothesis_internal_add_digest = repr((prop.id, opts.target, world_size, sorted(
        (m.label, list(m.env)) for m in modes))).encode()
    shrunk = run_to_counterexample(run_settings(hypothesis_seed(seed)(given(strategy)(example))))
    if shrunk is not None:
        return _shrunk_verdict(shrunk[0], shrunk[1], seed, seen, world_size, time.monotonic() - t0)
    return _summary_verdict(prop, opts, world_size, modes, seed, seen, time.monotonic() - t0)


def _summary_verdict(prop: Property, opts: Options, world_size: int, modes, seed: int, seen: Counter,
                     seconds: float) -> Verdict:
    models, dtypes = opts.models or DEFAULT_MODELS, opts.dtypes or DEFAULT_DTYPES
    n = sum(seen.values())
    fuzz = {"examples": n, "seed": seed, "statuses": dict(seen)}
    config = {**prop.fuzz_config(opts, world_size, modes, models, dtypes), "fuzz": fuzz}
    if seen["pass"] == 0:
        return Verdict(prop.id, "skip", config, message=f"all {n} fuzzed examples were skipped at "
                                                        f"world_size={world_size}",
                       evidence=fuzz, seconds=round(seconds, 3))
    return Verdict(prop.id, "pass", config,
                   message=(f"{seen['pass']} fuzzed configurations passed at world_size={world_size} "
                            f"(models {', '.join(models)}; dtypes {', '.join(dtypes)}; shard shapes, batch splits, "
                            f"layouts, reductions; hypothesis seed {seed})"),
                   evidence=fuzz, seconds=round(seconds, 3))


def _shrunk_verdict(found: Counterexample, notes: List[str], seed: int, seen: Counter, world_size: int,
                    seconds: float) -> Verdict:
    """The minimal failing example's verdict, with what reproduces it (module docstring)."""
    v, spec = found.verdict, found.spec
    blob = next((n for n in notes if "@reproduce_failure" in n), "")
    blob = blob[blob.index("@reproduce_failure"):].split(" as a decorator")[0].strip() if blob else ""
    examples = sum(seen.values())
    evidence = {**v.evidence, "spec": json.loads(spec.to_json()), "hypothesis_seed": seed,
                "reproduce_failure": blob, "examples_run": examples}
    return Verdict(v.property, v.status, {**v.config, "fuzz": {"examples": examples, "seed": seed}},
                   diagnosis=v.diagnosis, evidence=evidence, repro=v.repro, seconds=round(seconds, 3),
                   message=("fuzzing found a failing configuration; shrunk to the minimal one: "
                            f"{strategies.spec_summary(spec, world_size)}. {v.message}"),
                   details="\n".join(["hypothesis: " + n for n in notes] + ([v.details] if v.details else [])))


def run_to_counterexample(test: Callable[[], None]) -> Optional[Tuple[Counterexample, List[str]]]:
    """Run a hypothesis ``test``: ``None`` when every example passed, else the shrunk failing
    example (the ``Counterexample`` an example raised) and hypothesis' notes on it; anything else
    the test raised is re-raised."""
    try:
        test()
    except Exception as err:  # noqa: BLE001 - hypothesis re-raises what the example raised
        found = _find_counterexample(err)
        if found is None:
            raise
        return found, _notes(err)
    return None


def _find_counterexample(err: BaseException) -> Optional[Counterexample]:
    if isinstance(err, Counterexample):
        return err
    for sub in getattr(err, "exceptions", ()) or ():
        found = _find_counterexample(sub)
        if found:
            return found
    return None


def _notes(err: BaseException) -> List[str]:
    notes = list(getattr(err, "__notes__", []) or [])
    for sub in getattr(err, "exceptions", ()) or ():
        notes += _notes(sub)
    return notes


def format_failure(v: Verdict) -> str:
    """A failing fuzz verdict as the few lines a human needs: minimal config, message, seed and
    blob, the repro line."""
    lines = [f"{v.property}: {v.status.upper()} ({v.diagnosis})", v.message]
    if v.evidence.get("hypothesis_seed") is not None:
        lines.append(f"hypothesis seed: {v.evidence['hypothesis_seed']}")
    if v.evidence.get("reproduce_failure"):
        lines.append(f"blob: {v.evidence['reproduce_failure']}")
    lines.append(f"reproduce: {v.repro}")
    return "\n".join(lines)


__all__ = ["fuzz_groups", "search", "spec_strategy", "format_failure", "Counterexample", "Check",
           "run_to_counterexample", "DEFAULT_MODELS", "DEFAULT_DTYPES"]

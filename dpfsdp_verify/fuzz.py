"""Property-based drivers: run any property that has a fuzz recipe (``Property.fuzz``) on
hypothesis-generated ``RunSpec``s (``strategies.run_specs``), one spec per example, on a warm pool.

An example is one job on an already running worker group (milliseconds of harness overhead, not
a spawn) judged by the property's own ``judge`` against the float64 reference. Examples are
grouped by world size (one hypothesis run per world size and mode, ascending), so the pool keeps
the same group warm for a whole run and the first world size that fails is the smallest.

When an example fails (a ``fail``, ``hang`` or ``error`` verdict), hypothesis shrinks it to a
minimal configuration; the driver returns that as the verdict: the property's diagnosis and
message for the minimal spec, the spec itself (``evidence["spec"]``), the hypothesis seed and
``@reproduce_failure`` blob, and a one-line command (``repro``) that re-runs exactly that spec::

    dpfsdp-verify replay --target T --property P --world-size 2 --spec '{...}'

From the command line, ``dpfsdp-verify run --properties P --fuzz N`` fuzzes (``fuzz_options``).
Like running a property, fuzzing goes through one ``Options`` value (``fuzz_property`` turns the
Python API's keywords into it, once): target, world sizes, modes, models, dtypes, backend, timeout
and the run seed (the hypothesis seed) all come from it.
Nothing here knows a property by name: what to draw and how to prepare a drawn spec is the
property's recipe, how to judge it the property's ``judge``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import shlex
import time
from collections import Counter
from typing import List, Optional, Sequence, Union

from hypothesis import given
from hypothesis import seed as hypothesis_seed
from hypothesis import settings as Settings

from . import modes as modes_mod
from . import strategies
from .harness import Pool
from .hypothesis_profiles import profile_settings
from .modes import Mode
from .properties import PROPERTIES, Property, fuzzable, modes_problem
from .properties.contract import Case, Options
from .properties.runner import judge_case, run_cases
from .targets import RunSpec
from .verdict import FAILING, Verdict

DEFAULT_MODELS = ("mlp", "transformer")
#: float64 unless asked (``--dtypes``): fuzzed shapes include degenerate layers (a LayerNorm over one
#: feature) whose float32 rounding, amplified by 1/sqrt(eps), exceeds any fixed float32 tolerance
#: -- measured 3e-3 relative on the correct specimen -- while float64 stays exact there
DEFAULT_DTYPES = ("float64",)

#: modes as the Python API gives them (``{label: {VAR: value}}``) or as ``Mode``s
ModesLike = Union[dict, Sequence[Mode]]


def fuzzable_property(property_id: str) -> Property:
    """The property ``property_id`` if it has a fuzz recipe; ``ValueError`` naming the ones that do."""
    prop = PROPERTIES.get(property_id)
    if prop is None or prop.fuzz is None:
        raise ValueError(f"property {property_id!r} cannot be fuzzed; choose one of {', '.join(fuzzable())}")
    return prop


@contextlib.contextmanager
def _one_thread():
    """The reference computation in this process on one thread, as the ranks run (the harness
    starts them with ``OMP_NUM_THREADS=1``): threads per core on 2 shared cores slowed an example
    ~3-5x, measured."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- one example ------------------------------------------------------------------------------
def check_example(property_id: str, opts: Options, spec: RunSpec, world_size: int, *, pool: Pool,
                  modes: Sequence[Mode] = ()) -> Verdict:
    """The property's verdict for one spec at one world size, after the recipe's ``prepare`` (a
    spec it cannot use is a ``skip``). ``modes`` (default: the options' first mode group) holds one
    mode, or two for a property that compares modes (the first is compared with the second)."""
    prop = fuzzable_property(property_id)
    modes = tuple(modes) or prop.mode_groups(opts.modes, opts.params)[0]
    # one switch of the thread count per example, not two: a switch and back costs ~0.35 ms (measured)
    with _one_thread():
        ready = prop.fuzz.prepare(spec)
        case = Case(prop.id, opts.target, ready if isinstance(ready, RunSpec) else spec, world_size, modes,
                    backend=opts.backend, doing="fuzzed configuration")
        if isinstance(ready, str):
            return case.verdict("skip", None, ready)
        outcome = run_cases([case], pool, opts.timeout)[0]
        if isinstance(outcome, Verdict):
            return outcome
        return judge_case(prop, case, outcome)


# -- spec <-> JSON (for the repro line) --------------------------------------------------------
def spec_to_json(spec: RunSpec) -> str:
    return json.dumps(dataclasses.asdict(spec), sort_keys=True, separators=(",", ":"))


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def spec_from_json(text: str) -> RunSpec:
    """The ``RunSpec`` ``spec_to_json`` wrote (lists back to the tuples a frozen spec holds)."""
    d = json.loads(text)
    for key in ("rank_batches", "options", "model_kwargs"):
        if d.get(key) is not None:
            d[key] = _tuples(d[key])
    return RunSpec(**d)


def replay_command(property_id: str, target_ref: str, spec: RunSpec, world_size: int,
                   modes: ModesLike, backend: str = "gloo") -> str:
    """One shell line that re-runs exactly this spec (``dpfsdp-verify replay``)."""
    modes = modes_mod.from_mapping(modes)
    parts = ["dpfsdp-verify", "replay", "--target", target_ref, "--property", property_id,
             "--world-size", str(world_size), "--spec", spec_to_json(spec)]
    if backend != "gloo":
        parts += ["--backend", backend]
    parts += modes_mod.cli_args(modes, always=len(modes) > 1)
    return " ".join(shlex.quote(p) for p in parts)


# -- one hypothesis run -------------------------------------------------------------------------
class Counterexample(Exception):
    """Raised inside the hypothesis test for a failing example; carries its verdict and spec."""

    def __init__(self, verdict: Verdict, spec: RunSpec):
        super().__init__(f"{verdict.status}: {verdict.message}")
        self.verdict, self.spec = verdict, spec


def spec_strategy(property_id: str, world_size: int, opts: Options):
    """The ``run_specs`` a property is fuzzed with: its recipe's ``draw`` arguments over the
    options' models and dtypes (``DEFAULT_MODELS`` / ``DEFAULT_DTYPES`` when they name none).
    Every rank gets at least one sample: opacus' own data paths never give a rank an empty batch
    (its distributed Poisson sampler skips them), so an empty one would test the adapter, not the
    target."""
    draw = dict(models=tuple(opts.models or DEFAULT_MODELS), grad_sample_mode=opts.grad_sample_mode,
                dtype_values=tuple(opts.dtypes or DEFAULT_DTYPES), min_per_rank=1)
    draw.update(fuzzable_property(property_id).fuzz.draw_kwargs())
    return strategies.run_specs(world_size, **draw)


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


def fuzz_case(property_id: str, opts: Options, world_size: int, modes: Sequence[Mode], *, pool: Pool,
              n_examples: int, strategy=None, settings: Optional[Settings] = None) -> Verdict:
    """One hypothesis run of ``n_examples`` examples at one world size under ``modes`` (one mode;
    two for a property that compares modes). ``strategy`` overrides ``spec_strategy``; ``settings`` the
    profile's (``hypothesis_profiles.profile_settings()``). The hypothesis seed is the options' run
    seed (``0``: the profile's -- fixed under ``ci``, random otherwise; the verdict records it).
    Returns a ``pass`` verdict (or ``skip`` if every example skipped), or the minimal failing
    example's verdict (module docstring)."""
    base = settings or profile_settings()
    seed = opts.seed or (0 if base.derandomize else random.getrandbits(32))
    run_settings = Settings(base, max_examples=max(1, n_examples), derandomize=False, report_multiple_bugs=False,
                            deadline=None, print_blob=True)
    strategy = strategy if strategy is not None else spec_strategy(property_id, world_size, opts)
    models, dtypes = opts.models or DEFAULT_MODELS, opts.dtypes or DEFAULT_DTYPES
    seen: Counter = Counter()
    t0 = time.monotonic()

    def example(spec):
        v = check_example(property_id, opts, spec, world_size, pool=pool, modes=modes)
        seen[v.status] += 1
        if v.status in FAILING:
            raise Counterexample(v, spec)

    # a database key per (property, target, world size, modes): a saved failure replays where it failed
    example._hypothesis_internal_add_digest = repr((property_id, opts.target, world_size, sorted(
        (m.label, list(m.env)) for m in modes))).encode()
    test = run_settings(hypothesis_seed(seed)(given(strategy)(example)))
    config = {"world_size": world_size, "data_layout": "fuzzed", "model": "fuzzed:" + ",".join(models),
              "mode": " vs ".join(m.label for m in modes), "grad_sample_mode": opts.grad_sample_mode,
              "reduction": "fuzzed", "dtype": "fuzzed:" + ",".join(dtypes)}
    try:
        test()
    except Exception as err:  # noqa: BLE001 - hypothesis re-raises what the example raised
        found = _find_counterexample(err)
        if found is None:
            raise
        return _failure_verdict(property_id, opts, world_size, modes, found, err, seed, seen, time.monotonic() - t0)
    n = sum(seen.values())
    fuzz = {"examples": n, "seed": seed, "statuses": dict(seen)}
    if seen["pass"] == 0:
        return Verdict(property_id, "skip", {**config, "fuzz": fuzz},
                       message=f"all {n} fuzzed examples were skipped at world_size={world_size}",
                       evidence=fuzz, seconds=round(time.monotonic() - t0, 3))
    return Verdict(property_id, "pass", {**config, "fuzz": fuzz},
                   message=(f"{seen['pass']} fuzzed configurations passed at world_size={world_size} "
                            f"(models {', '.join(models)}; dtypes {', '.join(dtypes)}; shard shapes, batch splits, "
                            "layouts, reductions; "
                            f"hypothesis seed {seed})"),
                   evidence=fuzz, seconds=round(time.monotonic() - t0, 3))


def _failure_verdict(property_id, opts: Options, world_size, modes, found: Counterexample, err, seed,
                     seen, seconds) -> Verdict:
    v, spec = found.verdict, found.spec
    notes = _notes(err)
    blob = next((n for n in notes if "@reproduce_failure" in n), "")
    blob = blob[blob.index("@reproduce_failure"):].split(" as a decorator")[0].strip() if blob else ""
    summary = strategies.spec_summary(spec, world_size)
    config = dict(v.config)
    config.update({"model": spec.model, "data_layout": spec.data_layout, "reduction": spec.reduction,
                   "dtype": spec.dtype,
                   "model_kwargs": dict(spec.model_kwargs),
                   "fuzz": {"examples": sum(seen.values()), "seed": seed}})
    evidence = dict(v.evidence)
    evidence.update({"spec": json.loads(spec_to_json(spec)), "hypothesis_seed": seed, "reproduce_failure": blob,
                     "examples_run": sum(seen.values())})
    message = (f"fuzzing found a failing configuration; shrunk to the minimal one: {summary}. {v.message}")
    details = "\n".join(["hypothesis: " + n for n in notes] + ([v.details] if v.details else []))
    return Verdict(property_id, v.status, config, diagnosis=v.diagnosis, message=message, evidence=evidence,
                   repro=replay_command(property_id, opts.target, spec, world_size, modes, opts.backend),
                   seconds=round(seconds, 3), details=details)


# -- every world size -------------------------------------------------------------------------
def fuzz_property(property_id: str, target_ref: str, n_examples: int, *, pool: Optional[Pool] = None,
                  settings: Optional[Settings] = None, **options) -> List[Verdict]:
    """The Python API: ``fuzz_options`` with ``Options`` built from keywords, as a property call
    takes them (``world_sizes``, ``modes``, ``models``, ``dtypes``, ``grad_sample_mode``,
    ``backend``, ``timeout``, ``seed``; ``TypeError`` for one the property does not know).
    Raises ``ValueError`` for a property that cannot be fuzzed."""
    prop = fuzzable_property(property_id)
    return fuzz_options(property_id, prop.options(target_ref, **options), n_examples, pool=pool, settings=settings)


def fuzz_options(property_id: str, opts: Options, n_examples: int, *, pool: Optional[Pool] = None,
                 settings: Optional[Settings] = None) -> List[Verdict]:
    """``n_examples`` fuzzed examples of ``property_id`` at each of the options' world sizes
    (ascending) and mode groups (``Property.mode_groups``): one verdict each. ``pool=None`` uses a
    private pool closed at the end."""
    prop = fuzzable_property(property_id)
    groups = prop.mode_groups(opts.modes, opts.params)
    own = pool is None
    pool = pool or Pool()
    verdicts: List[Verdict] = []
    try:
        for ws in sorted(set(opts.world_sizes)):
            if not groups:
                verdicts.append(prop.skip(opts, modes_problem(prop, opts.modes), world_size=ws))
            for run_modes in groups:
                verdicts.append(fuzz_case(prop.id, opts, ws, run_modes, pool=pool, n_examples=n_examples,
                                          settings=settings))
    finally:
        if own:
            pool.close()
    return verdicts


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


__all__ = ["fuzz_property", "fuzz_options", "fuzz_case", "check_example", "fuzzable_property",
           "spec_strategy", "spec_to_json", "spec_from_json", "replay_command", "format_failure",
           "Counterexample", "DEFAULT_MODELS", "DEFAULT_DTYPES"]

"""Property-based drivers: run ``norm_fidelity``, ``clipped_step`` and ``mode_equivalence`` on
hypothesis-generated ``RunSpec``s (``strategies.run_specs``), one spec per example, on a warm pool.

An example is one job on an already running worker group (milliseconds of harness overhead, not
a spawn) judged by the property's own ``judge`` against the float64 reference. Examples are
grouped by world size (one hypothesis run per world size and mode, ascending), so the pool keeps
the same group warm for a whole run and the first world size that fails is the smallest.

When an example fails (a ``fail``, ``hang`` or ``error`` verdict), hypothesis shrinks it to a
minimal configuration; the driver returns that as the verdict: the property's diagnosis and
message for the minimal spec, the spec itself (``evidence["spec"]``), the hypothesis seed and
``@reproduce_failure`` blob, and a one-line command (``repro``) that re-runs exactly that spec::

    python -m dpfsdp_verify.fuzz replay --target T --property norm_fidelity --world-size 2 --spec '{...}'

``python -m dpfsdp_verify.fuzz run --target T --property P --examples N --world-sizes 1,2`` runs a
fuzz session from the command line (``dpfsdp-verify run --fuzz N`` calls ``fuzz_property``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import shlex
import sys
import time
from collections import Counter
from typing import Dict, List, Optional, Sequence

from hypothesis import given
from hypothesis import seed as hypothesis_seed
from hypothesis import settings as Settings

from . import strategies
from .harness import Pool
from .hypothesis_profiles import profile_settings
from .properties import clipped_step, mode_equivalence, norm_fidelity
from .properties.common import Case, run_cases
from .targets import RunSpec
from .verdict import Verdict

FUZZABLE = ("norm_fidelity", "clipped_step", "mode_equivalence")
DEFAULT_MODELS = ("mlp", "transformer")
FAILING = ("fail", "hang", "error")

Env = Dict[str, str]


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
def _run(case: Case, pool: Pool, timeout: float):
    """Every rank's ``RankOutput`` for ``case.spec``, or the case's failure verdict."""
    out = run_cases([case], [[case.spec]], pool, timeout, what="fuzzed configuration")[0]
    return out if isinstance(out, Verdict) else out[0]


def check_example(property_id: str, target_ref: str, spec: RunSpec, world_size: int, *, pool: Pool,
                  modes: Dict[str, Env], backend: str = "gloo", timeout: float = 60.0) -> Verdict:
    """The property's verdict for one spec at one world size. ``modes`` holds one label (two or
    more for ``mode_equivalence``: the first is compared with the second). For ``clipped_step``
    (and ``mode_equivalence``) the clip bound is set between the two middle reference norms, as
    the properties do; a spec whose norms tie is a ``skip``."""
    labels = list(modes)
    if property_id in ("clipped_step", "mode_equivalence"):
        with _one_thread():
            c = clipped_step.pick_clip_bound(spec) if spec.global_batch_size >= 2 else None
        if c is None and property_id == "clipped_step":
            return Case(property_id, target_ref, spec, world_size, labels[0], dict(modes[labels[0]]), backend).verdict(
                "skip", None, "reference norms tie: no clip bound separates clipped from unclipped samples")
        spec = spec.with_(max_grad_norm=c or 1.0)
    cases = [Case(property_id, target_ref, spec, world_size, label, dict(modes[label]), backend)
             for label in (labels[:2] if property_id == "mode_equivalence" else labels[:1])]
    outs = [_run(c, pool, timeout) for c in cases]
    with _one_thread():
        if property_id == "mode_equivalence":
            return mode_equivalence.judge(cases[0], cases[1], *[o if isinstance(o, Verdict) else [o] for o in outs])
        if isinstance(outs[0], Verdict):
            return outs[0]
        judge = norm_fidelity.judge if property_id == "norm_fidelity" else clipped_step.judge
        return judge(cases[0], outs[0])


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
                   modes: Dict[str, Env], backend: str = "gloo") -> str:
    """One shell line that re-runs exactly this spec (``python -m dpfsdp_verify.fuzz replay``)."""
    parts = ["python", "-m", "dpfsdp_verify.fuzz", "replay", "--target", target_ref,
             "--property", property_id, "--world-size", str(world_size), "--spec", spec_to_json(spec)]
    if backend != "gloo":
        parts += ["--backend", backend]
    for label, env in modes.items():
        if env or len(modes) > 1:
            parts += ["--mode-env", f"{label}:" + ",".join(f"{k}={v}" for k, v in sorted(env.items()))]
    return " ".join(shlex.quote(p) for p in parts)


# -- one hypothesis run -------------------------------------------------------------------------
class Counterexample(Exception):
    """Raised inside the hypothesis test for a failing example; carries its verdict and spec."""

    def __init__(self, verdict: Verdict, spec: RunSpec):
        super().__init__(f"{verdict.status}: {verdict.message}")
        self.verdict, self.spec = verdict, spec


def spec_strategy(property_id: str, world_size: int, *, models: Sequence[str] = DEFAULT_MODELS,
                  grad_sample_mode: str = "ghost_fsdp", dtype_values: Sequence[str] = ("float64",)):
    """The ``run_specs`` a property is fuzzed with: ``norm_fidelity`` both layouts and reductions,
    one step, any global batch; ``clipped_step`` split data (the layout opacus defines a DP step
    for), at least 2 samples so a clip bound can separate them; ``mode_equivalence`` like
    ``clipped_step`` with 2 steps (state carried between steps is compared too). Every rank gets at
    least one sample: opacus' own data paths never give a rank an empty batch (its distributed
    Poisson sampler skips them), so an empty one would test the adapter, not the target."""
    common = dict(models=tuple(models), grad_sample_mode=grad_sample_mode, dtype_values=tuple(dtype_values),
                  min_per_rank=1)
    if property_id == "norm_fidelity":
        return strategies.run_specs(world_size, **common)
    if property_id == "clipped_step":
        return strategies.run_specs(world_size, layouts=("split",), min_global_batch=2, **common)
    if property_id == "mode_equivalence":
        return strategies.run_specs(world_size, layouts=("split",), min_global_batch=2, steps=2,
                                    reduction_values=("mean",), **common)
    raise ValueError(f"property {property_id!r} cannot be fuzzed; choose one of {', '.join(FUZZABLE)}")


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


def fuzz_case(property_id: str, target_ref: str, world_size: int, *, pool: Pool, modes: Dict[str, Env],
              n_examples: int, seed: Optional[int] = None, models: Sequence[str] = DEFAULT_MODELS,
              grad_sample_mode: str = "ghost_fsdp", backend: str = "gloo", timeout: float = 60.0,
              strategy=None, settings: Optional[Settings] = None) -> Verdict:
    """One hypothesis run of ``n_examples`` examples at one world size under ``modes`` (one label;
    two for ``mode_equivalence``). ``strategy`` overrides ``spec_strategy``; ``settings`` the
    profile's (``hypothesis_profiles.profile_settings()``). Returns a ``pass`` verdict (or ``skip``
    if every example skipped), or the minimal failing example's verdict (module docstring)."""
    base = settings or profile_settings()
    if seed is None:
        seed = 0 if base.derandomize else random.getrandbits(32)
    run_settings = Settings(base, max_examples=max(1, n_examples), derandomize=False, report_multiple_bugs=False,
                            deadline=None, print_blob=True)
    strategy = strategy if strategy is not None else spec_strategy(property_id, world_size, models=models,
                                                                  grad_sample_mode=grad_sample_mode)
    labels = list(modes)
    seen: Counter = Counter()
    t0 = time.monotonic()

    def example(spec):
        v = check_example(property_id, target_ref, spec, world_size, pool=pool, modes=modes, backend=backend,
                          timeout=timeout)
        seen[v.status] += 1
        if v.status in FAILING:
            raise Counterexample(v, spec)

    # a database key per (property, target, world size, modes): a saved failure replays where it failed
    example._hypothesis_internal_add_digest = repr((property_id, target_ref, world_size, sorted(
        (k, sorted(v.items())) for k, v in modes.items()))).encode()
    test = run_settings(hypothesis_seed(seed)(given(strategy)(example)))
    mode = " vs ".join(labels[:2]) if property_id == "mode_equivalence" else labels[0]
    config = {"world_size": world_size, "data_layout": "fuzzed", "model": "fuzzed:" + ",".join(models),
              "mode": mode, "grad_sample_mode": grad_sample_mode, "reduction": "fuzzed"}
    try:
        test()
    except Exception as err:  # noqa: BLE001 - hypothesis re-raises what the example raised
        found = _find_counterexample(err)
        if found is None:
            raise
        return _failure_verdict(property_id, target_ref, world_size, modes, backend, found, err, seed, seen,
                                time.monotonic() - t0)
    n = sum(seen.values())
    fuzz = {"examples": n, "seed": seed, "statuses": dict(seen)}
    if seen["pass"] == 0:
        return Verdict(property_id, "skip", {**config, "fuzz": fuzz},
                       message=f"all {n} fuzzed examples were skipped at world_size={world_size}",
                       evidence=fuzz, seconds=round(time.monotonic() - t0, 3))
    return Verdict(property_id, "pass", {**config, "fuzz": fuzz},
                   message=(f"{seen['pass']} fuzzed configurations passed at world_size={world_size} "
                            f"(models {', '.join(models)}; shard shapes, batch splits, layouts, reductions; "
                            f"hypothesis seed {seed})"),
                   evidence=fuzz, seconds=round(time.monotonic() - t0, 3))


def _failure_verdict(property_id, target_ref, world_size, modes, backend, found: Counterexample, err, seed,
                     seen, seconds) -> Verdict:
    v, spec = found.verdict, found.spec
    notes = _notes(err)
    blob = next((n for n in notes if "@reproduce_failure" in n), "")
    blob = blob[blob.index("@reproduce_failure"):].split(" as a decorator")[0].strip() if blob else ""
    summary = strategies.spec_summary(spec, world_size)
    config = dict(v.config)
    config.update({"model": spec.model, "data_layout": spec.data_layout, "reduction": spec.reduction,
                   "model_kwargs": dict(spec.model_kwargs),
                   "fuzz": {"examples": sum(seen.values()), "seed": seed}})
    evidence = dict(v.evidence)
    evidence.update({"spec": json.loads(spec_to_json(spec)), "hypothesis_seed": seed, "reproduce_failure": blob,
                     "examples_run": sum(seen.values())})
    message = (f"fuzzing found a failing configuration; shrunk to the minimal one: {summary}. {v.message}")
    details = "\n".join(["hypothesis: " + n for n in notes] + ([v.details] if v.details else []))
    return Verdict(property_id, v.status, config, diagnosis=v.diagnosis, message=message, evidence=evidence,
                   repro=replay_command(property_id, target_ref, spec, world_size, modes, backend),
                   seconds=round(seconds, 3), details=details)


# -- every world size -------------------------------------------------------------------------
def fuzz_property(property_id: str, target_ref: str, n_examples: int, *, pool: Optional[Pool] = None,
                  world_sizes: Sequence[int] = (1, 2), grad_sample_mode: str = "ghost_fsdp",
                  modes: Optional[Dict[str, Env]] = None, timeout: float = 60.0, seed: Optional[int] = None,
                  models: Sequence[str] = DEFAULT_MODELS, backend: str = "gloo",
                  settings: Optional[Settings] = None) -> List[Verdict]:
    """``n_examples`` fuzzed examples of ``property_id`` at each world size (ascending) and mode;
    one verdict per (world size, mode) -- for ``mode_equivalence`` per (world size, first label vs
    each other label). ``seed=None`` uses the profile's (fixed under ``ci``, random otherwise; the
    verdict records it). ``pool=None`` uses a private pool closed at the end. Raises ``ValueError``
    for a property that cannot be fuzzed."""
    if property_id not in FUZZABLE:
        raise ValueError(f"property {property_id!r} cannot be fuzzed; choose one of {', '.join(FUZZABLE)}")
    modes = dict(modes or {"default": {}})
    labels = list(modes)
    own = pool is None
    pool = pool or Pool()
    verdicts: List[Verdict] = []
    try:
        for ws in sorted(set(world_sizes)):
            if property_id == "mode_equivalence":
                if len(labels) < 2:
                    verdicts.append(Verdict(property_id, "skip", {
                        "world_size": ws, "data_layout": "fuzzed", "model": "fuzzed", "mode": labels[0],
                        "grad_sample_mode": grad_sample_mode}, message="mode_equivalence needs two mode labels"))
                    continue
                runs: List[Dict[str, Env]] = [{labels[0]: modes[labels[0]], other: modes[other]}
                                              for other in labels[1:]]
            else:
                runs = [{label: env} for label, env in modes.items()]
            for run_modes in runs:
                verdicts.append(fuzz_case(property_id, target_ref, ws, pool=pool, modes=run_modes,
                                          n_examples=n_examples, seed=seed, models=models,
                                          grad_sample_mode=grad_sample_mode, backend=backend, timeout=timeout,
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


# -- command line -------------------------------------------------------------------------------
def _parse_modes(items: Sequence[str]) -> Dict[str, Env]:
    modes: Dict[str, Env] = {}
    for item in items or ():
        label, _, assignments = item.partition(":")
        env = {}
        for a in filter(None, assignments.split(",")):
            k, _, v = a.partition("=")
            env[k] = v
        modes[label] = env
    return modes or {"default": {}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dpfsdp_verify.fuzz", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "replay"):
        p = sub.add_parser(name)
        p.add_argument("--target", default="opacus")
        p.add_argument("--property", required=True, choices=FUZZABLE)
        p.add_argument("--mode-env", action="append", default=[], metavar="LABEL:VAR=VAL[,VAR=VAL]")
        p.add_argument("--backend", default="gloo")
        p.add_argument("--timeout", type=float, default=60.0)
    run_p, replay_p = sub.choices["run"], sub.choices["replay"]
    run_p.add_argument("--examples", type=int, default=20)
    run_p.add_argument("--world-sizes", default="1,2")
    run_p.add_argument("--seed", type=int, default=None)
    run_p.add_argument("--models", default=",".join(DEFAULT_MODELS))
    replay_p.add_argument("--world-size", type=int, required=True)
    replay_p.add_argument("--spec", required=True, help="the JSON RunSpec of a failing fuzz verdict's repro line")
    args = ap.parse_args(argv)
    modes = _parse_modes(args.mode_env)
    with Pool() as pool:
        if args.cmd == "replay":
            verdicts = [check_example(args.property, args.target, spec_from_json(args.spec), args.world_size,
                                      pool=pool, modes=modes, backend=args.backend, timeout=args.timeout)]
        else:
            verdicts = fuzz_property(args.property, args.target, args.examples, pool=pool,
                                     world_sizes=[int(w) for w in args.world_sizes.split(",")], modes=modes,
                                     timeout=args.timeout, seed=args.seed, models=args.models.split(","),
                                     backend=args.backend)
    for v in verdicts:
        print(format_failure(v) if v.status in FAILING and args.cmd == "run" else f"{v.property}: {v.status}: {v.message}")
    return 1 if any(v.status in FAILING for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())

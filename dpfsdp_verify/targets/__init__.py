"""Implementations under test, behind one contract (``base.Target``), and how to load them.

``load_target(ref)`` accepts:

* ``"opacus"`` -- the built-in adapter for whatever opacus is importable (``opacus_target``);
* ``"package.module:Attr"`` -- ``Attr`` is a ``Target`` subclass, a ``Target`` instance, or a
  zero-argument factory returning one;
* a name registered in the entry-point group ``dpfsdp_verify.targets`` (value ``module:attr``).

Failures raise ``TargetLoadError`` whose message is one line saying what was wrong.

``run_many_on_rank(target_ref, specs)`` is the job the properties ship to every rank of a worker
group: it loads the target there and returns that rank's ``RankOutput`` for each spec.
"""

from __future__ import annotations

import importlib
from typing import List, Optional, Sequence

from .base import (DATA_LAYOUTS, FEATURE_BF16_AUTOCAST, FEATURE_BF16_FSDP, FEATURE_MOMENTUM, FEATURE_PHYSICAL_BATCHES,
                   FEATURE_RESUME, PRECISION_FEATURES, PRECISIONS, RankOutput, Refused, RunSpec, StepOutput, Target)

ENTRY_POINT_GROUP = "dpfsdp_verify.targets"
BUILTIN = {"opacus": "dpfsdp_verify.targets.opacus_target:OpacusTarget"}


class TargetLoadError(ValueError):
    """The target reference cannot be turned into a ``Target``; the message says why (one line)."""


def _entry_point(name: str):
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.value
    return None


def _import_attr(ref: str):
    module_name, _, attr_path = ref.partition(":")
    if not module_name or not attr_path:
        raise TargetLoadError(f"target {ref!r} must look like 'package.module:Attr'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise TargetLoadError(f"cannot import module {module_name!r} for target {ref!r}: {e}") from e
    try:
        for part in attr_path.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise TargetLoadError(f"module {module_name!r} has no attribute {attr_path!r} (target {ref!r})") from None
    return obj


def load_target(ref: str) -> Target:
    """The ``Target`` named by ``ref`` (see module docstring). Raises ``TargetLoadError``."""
    if not isinstance(ref, str) or not ref.strip():
        raise TargetLoadError(f"target reference must be a non-empty string, got {ref!r}")
    ref = ref.strip()
    spec = BUILTIN.get(ref)
    if spec is None and ":" not in ref:
        spec = _entry_point(ref)
        if spec is None:
            raise TargetLoadError(f"unknown target {ref!r}: not 'opacus', not 'module:Attr', and no entry point "
                                  f"named {ref!r} in group {ENTRY_POINT_GROUP!r}")
    if ref == "opacus":
        try:
            import opacus
        except ImportError as e:
            raise TargetLoadError(f"target 'opacus' needs opacus installed: {e}") from e
        from .opacus_api import problem

        lacking = problem(getattr(opacus, "__version__", "?"))
        if lacking:  # one line, not a crash per case (a fork on an older opacus)
            raise TargetLoadError(lacking)
    obj = _import_attr(spec or ref)
    if isinstance(obj, Target):
        return obj
    try:
        made = obj()
    except Exception as e:
        raise TargetLoadError(f"calling {ref!r} to build the target raised {type(e).__name__}: {e}") from e
    if not isinstance(made, Target):
        raise TargetLoadError(f"{ref!r} gave {type(made).__name__}, not a dpfsdp_verify.targets.Target")
    return made


def target_info(ref: str) -> dict:
    """``{"name", "version"}`` of a target, for reports. Raises ``TargetLoadError``."""
    t = load_target(ref)
    return {"name": getattr(t, "name", ref), "version": t.version()}


def run_many_on_rank(target_ref: str, specs: Sequence[RunSpec], progress_dir: Optional[str] = None
                     ) -> List[RankOutput]:
    """Harness job: several runs in one job (e.g. repeated noise draws), in order. ``task="sample"``
    specs call ``Target.sample_batches`` (each step's drawn indices as a ``StepOutput``; a target
    without it answers ``RankOutput.unsupported``). A target that raises ``Refused`` answers
    ``RankOutput.refused``. ``progress_dir``: where each rank leaves its
    progress trail (``targets.progress``) for the parent to read after a hang."""
    from . import progress
    from .util import device, float32_numerics, numerics, world

    rank, world_size = world()
    float32_numerics()  # what the float32 tolerances assume; a target that changes it is reported so
    progress.open_sink(progress_dir, rank)
    try:
        target = load_target(target_ref)
        out = []
        for s in specs:
            progress.run_begun(s.task)
            missing = unsupported_feature(target, s)
            if missing:
                out.append(RankOutput(rank, world_size, unsupported=missing))
            elif s.task == "sample":
                out.append(_sample_on_rank(target, s, rank, world_size))
            else:
                try:
                    out.append(target.run(s))
                except Refused as e:
                    out.append(RankOutput(rank, world_size, refused=str(e) or type(e).__name__))
            progress.run_ended()
        where, how = str(device()), numerics()
        for o in out:
            o.device, o.numerics = where, how
        return out
    finally:
        progress.close_sink()


def unsupported_feature(target: Target, spec: RunSpec) -> Optional[str]:
    """Why ``target`` cannot run ``spec`` (a feature it does not declare in ``Target.features``),
    or ``None``. An adapter that predates a feature would ignore the field and run without it: it
    is told so instead."""
    features = tuple(getattr(target, "features", ()))
    name = getattr(target, "name", "?")
    if spec.physical_batch_size and FEATURE_PHYSICAL_BATCHES not in features:
        return (f"target {name!r} does not declare gradient accumulation "
                f"(RunSpec.physical_batch_size={spec.physical_batch_size}; add {FEATURE_PHYSICAL_BATCHES!r} to "
                "Target.features once run() computes each logical step in physical passes)")
    if spec.resume_at and FEATURE_RESUME not in features:
        return (f"target {name!r} does not declare checkpoint/resume (RunSpec.resume_at={spec.resume_at}; add "
                f"{FEATURE_RESUME!r} to Target.features once run() saves a checkpoint after step k (phase 'save') "
                "and resumes from it in a fresh run (phase 'load'), reporting StepOutput.privacy_steps)")
    if spec.momentum and FEATURE_MOMENTUM not in features:
        return (f"target {name!r} does not declare SGD momentum (RunSpec.momentum={spec.momentum}; add "
                f"{FEATURE_MOMENTUM!r} to Target.features once run() trains with torch.optim.SGD(momentum=...))")
    feature = PRECISION_FEATURES.get(spec.precision)
    if feature and feature not in tuple(getattr(target, "features", ())):
        return (f"target {getattr(target, 'name', '?')!r} does not declare mixed precision {spec.precision!r} "
                f"(RunSpec.precision; add {feature!r} to Target.features once run() computes in bf16 that way); "
                "it is not run in float32 instead")
    return None


def _sample_on_rank(target: Target, spec: RunSpec, rank: int, world_size: int) -> RankOutput:
    if type(target).sample_batches is Target.sample_batches:
        return RankOutput(rank, world_size, unsupported=f"target {getattr(target, 'name', '?')!r} does not "
                          "expose its data pipeline (implement Target.sample_batches: the global indices "
                          "each step draws on this rank)")
    try:  # a sampling configuration the target cannot express is a refusal, as in run()
        batches = target.sample_batches(spec)
    except Refused as e:
        return RankOutput(rank, world_size, refused=str(e) or type(e).__name__)
    steps = [StepOutput(indices=[int(i) for i in b], norms=None, loss=0.0) for b in batches]
    return RankOutput(rank, world_size, steps=steps)


__all__ = ["DATA_LAYOUTS", "FEATURE_PHYSICAL_BATCHES", "FEATURE_RESUME", "FEATURE_MOMENTUM", "FEATURE_BF16_FSDP",
           "FEATURE_BF16_AUTOCAST", "PRECISIONS", "PRECISION_FEATURES", "unsupported_feature", "RankOutput", "Refused",
           "RunSpec",
           "StepOutput", "Target", "TargetLoadError", "load_target",
           "target_info", "run_many_on_rank", "ENTRY_POINT_GROUP"]

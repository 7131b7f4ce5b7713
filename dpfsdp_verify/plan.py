"""The gate's run plan: what ``dpfsdp-verify run`` was asked to do, checked once.

``RunPlan.from_args`` turns the CLI's arguments into a frozen, typed plan or raises
``UsageError`` (one line + a hint; the CLI exits 2 and nothing runs). Every rule about what may
be combined is written here, once; the gate (``gate.py``) and the reports only read the plan.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from . import modes as modes_mod
from .modes import Mode, ModeSyntaxError

#: gloo ranks are processes on this host: more than this is a mistake on a CI runner
MAX_GLOO_WORLD_SIZE = 16
REDUCTIONS = ("mean", "sum")


class UsageError(Exception):
    """A configuration mistake: reported as one line + hint, exit 2, nothing run."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


def csv(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


@dataclass(frozen=True)
class RunPlan:
    target: str
    target_info: Tuple[Tuple[str, str], ...]
    grad_sample_mode: str
    modes: Tuple[Mode, ...]          # () = run once with no extra environment
    world_sizes: Tuple[int, ...]
    backend: str
    properties: Tuple[str, ...]
    #: ``None``: each property's own defaults (``Property.models`` / ``reductions`` / ``dtypes``)
    models: Optional[Tuple[str, ...]]
    reductions: Optional[Tuple[str, ...]]
    timeout: float
    fuzz: int = 0
    #: ``None``: each property's own (float64, and float32 where the property runs it by default)
    dtypes: Optional[Tuple[str, ...]] = None
    #: ``--physical-batch-size``: the properties' option ``physical_batch_size`` (``None``: their defaults)
    physical_batch_size: Optional[int] = None

    @property
    def info(self) -> Dict[str, str]:
        """``{"name", "version"}`` of the target (for reports)."""
        return dict(self.target_info)

    def options(self):
        """The ``properties.Options`` every property of the plan runs with."""
        from .properties import Options

        return Options(target=self.target, world_sizes=self.world_sizes, modes=self.modes or modes_mod.DEFAULT_MODES,
                       grad_sample_mode=self.grad_sample_mode, models=self.models, reductions=self.reductions,
                       dtypes=self.dtypes, backend=self.backend, timeout=self.timeout,
                       params=(("physical_batch_size", self.physical_batch_size),) if self.physical_batch_size else ())

    @classmethod
    def from_args(cls, args) -> "RunPlan":
        """The plan for the parsed ``run`` arguments, or ``UsageError`` saying what is wrong."""
        from .harness import BackendUnavailable, check_backend
        from .models import MODEL_NAMES
        from .properties import PROPERTIES, modes_problem

        try:
            world_sizes = sorted({int(w) for w in csv(args.world_sizes)})
        except ValueError:
            raise UsageError(f"--world-sizes {args.world_sizes!r}: not a comma list of integers",
                             "e.g. --world-sizes 1,2") from None
        if not world_sizes or world_sizes[0] < 1:
            raise UsageError(f"--world-sizes {args.world_sizes!r}: world sizes must be >= 1", "e.g. --world-sizes 1,2")
        if args.backend == "gloo" and world_sizes[-1] > MAX_GLOO_WORLD_SIZE:
            raise UsageError(f"--world-sizes: {world_sizes[-1]} gloo ranks is more than this gate runs on one host "
                             f"(max {MAX_GLOO_WORLD_SIZE})", "use torchrun + the pytest plugin for larger worlds")
        try:
            check_backend(args.backend, world_sizes[-1])
        except (BackendUnavailable, ValueError) as e:
            raise UsageError(f"--backend {args.backend}: {e}", "use --backend gloo on CPU runners") from None
        props = csv(args.properties) if args.properties else list(PROPERTIES)
        unknown = [p for p in props if p not in PROPERTIES]
        if unknown:
            raise UsageError(f"unknown property {', '.join(unknown)}", f"choose from {', '.join(PROPERTIES)}")
        models = reductions = None
        if args.models is not None:
            models = tuple(csv(args.models))
            bad = [m for m in models if m not in MODEL_NAMES]
            if bad or not models:
                raise UsageError(f"unknown model {', '.join(bad) or '(none)'}",
                                 f"choose from {', '.join(MODEL_NAMES)}")
        if args.loss_reductions is not None:
            reductions = tuple(csv(args.loss_reductions))
            if not reductions or any(r not in REDUCTIONS for r in reductions):
                raise UsageError(f"--loss-reductions {args.loss_reductions!r}: choose from {','.join(REDUCTIONS)}",
                                 "e.g. --loss-reductions mean")
        dtypes = None
        if args.dtypes is not None:
            from .properties.compare import TOLERANCES

            dtypes = tuple(csv(args.dtypes))
            if not dtypes or any(d not in TOLERANCES for d in dtypes):
                raise UsageError(f"--dtypes {args.dtypes!r}: choose from {','.join(TOLERANCES)}",
                                 "e.g. --dtypes float64,float32")
        if args.timeout <= 0:
            raise UsageError(f"--timeout {args.timeout}: must be > 0 seconds", "e.g. --timeout 60")
        if args.fuzz < 0:
            raise UsageError(f"--fuzz {args.fuzz}: must be >= 0", "e.g. --fuzz 20")
        modes = parse_modes(args.mode_env)
        physical = getattr(args, "physical_batch_size", None)
        if physical is not None and physical < 1:
            raise UsageError(f"--physical-batch-size {physical}: must be an integer >= 1 (samples per physical pass)",
                             "e.g. --physical-batch-size 2")
        if args.properties:  # a property the user named explicitly must be able to run
            for p in props:
                problem = modes_problem(PROPERTIES[p], modes or modes_mod.DEFAULT_MODES)
                if problem:
                    raise UsageError(problem, modes_mod.TWO_MODES_EXAMPLE)
        info = load_target_info(args.target)
        for path in (args.json, args.junit, args.markdown):
            if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                raise UsageError(f"cannot write report {path!r}: its directory does not exist", "create it first")
        return cls(target=args.target, target_info=tuple(info.items()), grad_sample_mode=args.grad_sample_mode,
                   modes=modes, world_sizes=tuple(world_sizes), backend=args.backend, properties=tuple(props),
                   models=models, reductions=reductions, timeout=float(args.timeout), fuzz=args.fuzz,
                   dtypes=dtypes, physical_batch_size=physical)


def parse_modes(items: List[str]) -> Tuple[Mode, ...]:
    """``--mode-env`` values as modes; ``UsageError`` if malformed."""
    try:
        return modes_mod.parse_all(items or ())
    except ModeSyntaxError as e:
        raise UsageError(str(e), e.hint) from None


def load_target_info(ref: str) -> Dict[str, str]:
    """``{"name", "version"}`` of the target; ``UsageError`` if it cannot be loaded."""
    from .targets import TargetLoadError, target_info

    try:
        return target_info(ref)
    except TargetLoadError as e:
        raise UsageError(f"--target {ref}: {e}", "give 'opacus' or an importable MODULE:ATTR") from None


def positive_world_size(text: str) -> int:
    """``--world-size`` of ``replay``: one integer >= 1; ``UsageError`` otherwise."""
    try:
        ws = int(text)
    except ValueError:
        ws = 0
    if ws < 1:
        raise UsageError(f"--world-size {text!r}: must be an integer >= 1", "e.g. --world-size 2")
    return ws


__all__ = ["RunPlan", "UsageError", "parse_modes", "load_target_info", "positive_world_size", "csv",
           "MAX_GLOO_WORLD_SIZE"]

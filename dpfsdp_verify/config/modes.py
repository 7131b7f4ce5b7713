"""Mode env sets: a labelled set of environment variables the ranks are started with.

A fork's switches (``OPACUS_USE_DEFERRED_NORM=1``...) are process environment, so a *mode* is
``LABEL:VAR=VAL[,VAR=VAL]`` on the command line and ``Mode(label, env)`` in code. This module is
the one place that parses, validates and formats them (CLI, run plan, repro lines, fuzz replay).

A mode may instead (or as well) change the ``RunSpec`` (``Mode.spec``): a comparing property's
built-in pair needs no environment at all (the mode comparison compares a logical step computed
unsplit with the same step in physical batches -- gradient accumulation -- when no
``--mode-env`` is given). Such modes have no command-line form: the default run makes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..errors import HintedError

Env = Dict[str, str]


class ModeSyntaxError(HintedError):
    """A malformed ``--mode-env``; ``hint`` shows the right form."""

    def __init__(self, message: str, hint: str = "e.g. --mode-env deferred:OPACUS_USE_DEFERRED_NORM=1"):
        super().__init__(message, hint)


@dataclass(frozen=True)
class Mode:
    """A labelled environment (sorted ``(VAR, value)`` pairs: hashable, order-free), and the
    ``RunSpec`` fields the mode sets (sorted ``(field, value)`` pairs; ``()`` for env modes)."""

    label: str = "default"
    env: Tuple[Tuple[str, str], ...] = ()
    spec: Tuple[Tuple[str, Any], ...] = ()

    def apply(self, run_spec):
        """``run_spec`` as this mode runs it (its ``spec`` fields set)."""
        return run_spec.with_(**dict(self.spec)) if self.spec else run_spec

    @classmethod
    def of(cls, label: str, env: Optional[Mapping[str, str]] = None) -> "Mode":
        return cls(label, tuple(sorted((str(k), str(v)) for k, v in (env or {}).items())))

    @property
    def env_dict(self) -> Env:
        return dict(self.env)

    def describe_env(self) -> str:
        """``A=1,B=2``, the spec fields it sets, or ``no env``."""
        return ",".join([f"{k}={v}" for k, v in self.env] + [f"RunSpec.{k}={v}" for k, v in self.spec]) or "no env"

    def to_arg(self) -> str:
        """The ``--mode-env`` value that gives back this mode."""
        return f"{self.label}:" + ",".join(f"{k}={v}" for k, v in self.env)


DEFAULT_MODES: Tuple[Mode, ...] = (Mode(),)
#: how to give two modes, for messages that ask for them
TWO_MODES_EXAMPLE = ("e.g. --mode-env immediate:OPACUS_USE_DEFERRED_NORM=0 "
                     "--mode-env deferred:OPACUS_USE_DEFERRED_NORM=1")


def parse(item: str) -> Mode:
    """``"deferred:A=1,B=2"`` -> ``Mode("deferred", (("A", "1"), ("B", "2")))``; raises ``ModeSyntaxError``."""
    label, sep, assigns = item.partition(":")
    if not sep or not label.strip():
        raise ModeSyntaxError(f"--mode-env {item!r}: expected LABEL:VAR=VAL[,VAR=VAL]")
    env = {}
    for a in (t.strip() for t in assigns.split(",")):
        if not a:
            continue
        var, eq, val = a.partition("=")
        if not eq or not var.strip():
            raise ModeSyntaxError(f"--mode-env {item!r}: {a!r} is not VAR=VAL", "e.g. OPACUS_USE_DEFERRED_NORM=1")
        env[var.strip()] = val
    return Mode.of(label.strip(), env)


def parse_all(items: Iterable[str]) -> Tuple[Mode, ...]:
    """Every ``--mode-env`` given, in order; a label given twice is a ``ModeSyntaxError``.
    No item at all is ``()`` (callers decide what that means: usually ``DEFAULT_MODES``)."""
    out: List[Mode] = []
    for item in items:
        mode = parse(item)
        if any(m.label == mode.label for m in out):
            raise ModeSyntaxError(f"--mode-env label {mode.label!r} given twice", "use one label per environment")
        out.append(mode)
    return tuple(out)


def from_mapping(modes: "Optional[Mapping[str, Mapping[str, str]] | Sequence[Mode]]") -> Tuple[Mode, ...]:
    """The Python API's ``{label: {VAR: value}}`` (or already ``Mode``s) as modes; ``None`` or empty
    is the one unlabelled ``default`` mode."""
    if not modes:
        return DEFAULT_MODES
    if isinstance(modes, Mapping):
        return tuple(Mode.of(label, env) for label, env in modes.items())
    return tuple(modes)


def cli_args(modes: Sequence[Mode], always: bool = False) -> List[str]:
    """``--mode-env`` arguments that re-create ``modes`` for a repro line: modes without any
    environment are left out (the default run has them) unless ``always``."""
    args: List[str] = []
    for m in modes:
        if m.env or always:
            args += ["--mode-env", m.to_arg()]
    return args


__all__ = ["Mode", "Env", "ModeSyntaxError", "DEFAULT_MODES", "TWO_MODES_EXAMPLE", "parse", "parse_all",
           "from_mapping", "cli_args"]

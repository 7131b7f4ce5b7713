"""The interface every pool of rank groups offers, declared once: ``JobPool``.

Two pools implement it and share no base class: ``Pool`` (``pool.py``: warm spawned/forked groups
in this process) and ``TorchrunPool`` (``torchrun_pool.py``: a torchrun job's own ranks). The
property runner, the gate and the fuzzer take a ``JobPool``, so either can carry a run; mypy checks
that both still satisfy it (the way pytest-xdist declares its schedulers' interface in
``scheduler/protocol.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Protocol

if TYPE_CHECKING:  # types only: this module stays import-free at run time
    from .group import GroupResult, WorkerGroup


class JobPool(Protocol):
    """Runs jobs on groups of ranks: what the runner, the gate and the fuzzer need of a pool."""

    def run(self, fn: Callable, *args: Any, world_size: int = 2, backend: str = "gloo",
            env: Optional[Dict[str, str]] = None, timeout: float = ..., **kwargs: Any) -> GroupResult:
        """Run ``fn(*args, **kwargs)`` on every rank of a ``world_size`` group and collect the
        outcome (``NotRunHere`` when this pool cannot run at that size or backend)."""
        ...

    def fresh_group(self, world_size: int, backend: str = "gloo",
                    env: Optional[Dict[str, str]] = None) -> WorkerGroup:
        """A new group of fresh rank processes that the caller closes (``NotRunHere`` where the
        pool cannot start one)."""
        ...

    def close(self) -> None:
        """Stop what the pool started."""
        ...


__all__ = ["JobPool"]

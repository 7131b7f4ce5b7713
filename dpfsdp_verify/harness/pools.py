"""The interface every pool of rank groups offers, declared once: ``JobPool``.

Two pools implement it and share no base class: ``Pool`` (``pool.py``: warm spawned/forked groups
in this process) and ``TorchrunPool`` (``torchrun_pool.py``: a torchrun job's own ranks). The
property runner, the gate and the fuzzer take a ``JobPool``, so either can carry a run; mypy checks
that both still satisfy it (the way pytest-xdist declares its schedulers' interface in
``scheduler/protocol.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Protocol, Sequence

if TYPE_CHECKING:  # types only: this module stays import-free at run time
    from concurrent.futures import Executor

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

    # what a pool can do beyond running jobs, declared rather than probed for: a pool that cannot
    # answers ``None`` / ``False`` (the gate's scheduler and session ask, ``gate/scheduler.py``)
    def side_lane(self, name: str = "side") -> Optional[Executor]:
        """A thread of the pool's own, by name, for jobs that run beside the caller's on other groups
        (the gate's 1-rank jobs, its explorations), or ``None`` where its ranks cannot run two jobs
        at once."""
        ...

    def prestart(self, world_size: int, backend: str = "gloo", env: Optional[Dict[str, str]] = None,
                 preload: Sequence[str] = ()) -> bool:
        """Start a group for ``world_size`` in the background, not waited for; whether one was
        started (``False`` for a pool whose groups cannot be started ahead)."""
        ...


__all__ = ["JobPool"]

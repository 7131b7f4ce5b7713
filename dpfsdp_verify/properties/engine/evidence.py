"""Where the runs every property's cases make go as evidence beyond their own verdict: the sink in
force (the whole-run release judge's ledger, ``properties/releases/judge.py``), fed by the runner
(``runner.judge_case``) with every case whose runs passed the prechecks. The engine knows only this
narrow contract, so it never imports the topic that judges the evidence."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional, Protocol


class RunSink(Protocol):
    """What takes a judged case's runs as evidence (``releases.judge.Ledger``)."""

    def add(self, case, outputs) -> None: ...


_CURRENT: "contextvars.ContextVar[Optional[RunSink]]" = contextvars.ContextVar("dpfsdp_release_ledger",
                                                                               default=None)


def current() -> Optional[RunSink]:
    """The sink cases are fed to now (``None``: none)."""
    return _CURRENT.get()


@contextlib.contextmanager
def collecting(sink: Optional[RunSink]) -> Iterator[Optional[RunSink]]:
    """Every case judged inside feeds ``sink`` (``None``: none)."""
    token = _CURRENT.set(sink)
    try:
        yield sink
    finally:
        _CURRENT.reset(token)


__all__ = ["RunSink", "current", "collecting"]

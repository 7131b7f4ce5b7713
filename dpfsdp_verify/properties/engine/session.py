"""What one run's judging reads beyond a case's own outputs, held by one object handed down, never
found in a context variable: ``Session``.

The runner (``runner.judge_cases`` / ``runner.settle``) takes a ``Session`` (or ``None``: nothing
beyond the verdicts) and

* feeds every case whose runs passed the prechecks to ``session.ledger`` -- the whole-run release
  judge's ledger (``properties/releases/judge.py``), a ``RunSink`` -- so that every noisy run of any
  property, fuzz run or explored draw is evidence for the noise at every step;
* tells ``session.listener(case, verdict)`` each case as soon as the job that settles it has ended
  (a torchrun job's rank 0 keeps them on disk, ``gate/journal.py``); without a listener the cases
  of a property are judged once all of its jobs have run, in case order. The verdicts are the same.

The gate's session (``gate/session.py``) is this object with the rest of a run's state -- its
plan, pool, progress, exploration budget and scheduling policy -- as further fields, so the gate,
a torchrun job, the fuzzer and the pytest plugin each build one and hand it down.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from .evidence import RunSink

if TYPE_CHECKING:  # types only
    from ...verdict import Verdict
    from .contract import Case, Outputs

#: ``listener(case, verdict)``: told each case as soon as it is judged
Listener = Callable[["Case", "Verdict"], None]


@dataclass
class Session:
    """One run's evidence sink and verdict listener (module docstring)."""

    #: where every judged case's runs go as evidence (``None``: nowhere)
    ledger: Optional[RunSink] = None
    #: told each case as soon as it is judged (``None``: a property's cases are judged together)
    listener: Optional[Listener] = None
    #: set when the run stops early (an interrupt): an exploration under way runs no further draw
    stopping: threading.Event = field(default_factory=threading.Event)
    #: cases are judged in more than one thread at once (the gate's judge thread and its exploration)
    _feeding: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def feed(self, case: "Case", outputs: "Outputs") -> None:
        """``case``'s runs, which passed the prechecks, as evidence to the ledger (if any), one case
        at a time whichever thread judged it."""
        if self.ledger is not None:
            with self._feeding:
                self.ledger.add(case, outputs)


def listener_of(session: Optional[Session]) -> Optional[Listener]:
    """``session``'s listener (``None`` without a session)."""
    return session.listener if session is not None else None


def stopping(session: Optional[Session]) -> bool:
    """Whether ``session`` is stopping early (never without a session)."""
    return session is not None and session.stopping.is_set()


__all__ = ["Session", "Listener", "listener_of", "stopping"]

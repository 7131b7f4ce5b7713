"""Where the runs every property's cases make go as evidence beyond their own verdict: a ``RunSink``
(the whole-run release judge's ledger, ``properties/releases/judge.py``), held by the run's
``session.Session`` and fed by the runner (``runner.judge_case``) with every case whose runs passed
the prechecks. The engine knows only this narrow contract, so it never imports the topic that
judges the evidence."""

from __future__ import annotations

from typing import Protocol


class RunSink(Protocol):
    """What takes a judged case's runs as evidence (``releases.judge.Ledger``)."""

    def add(self, case, outputs) -> None: ...


__all__ = ["RunSink"]

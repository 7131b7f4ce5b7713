"""Where each rank is in its training loop, readable by the parent after a hang.

A hung rank cannot return its step count, so targets leave a trail instead: the job that runs a
target on a rank (``targets.run_many_on_rank``) opens a small per-rank file in a directory the
parent chose; ``step_begun(k, local_batch_size)`` and ``step_finished(k)`` append one line each
(flushed, so the parent sees it even when the rank is later killed); ``run_ended()`` marks the
end of a run. Outside such a job the calls do nothing, so a target can always call them.

The parent (``properties.runner``) reads every rank's file after a hang with ``read`` and tells
the hang in DP terms: "rank 0 ended its run after 3 steps; rank 1 began step 4 (local batch 1)
and never finished it".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional

_sink = None  # the open file of the current job on this rank, or None


def open_sink(directory: Optional[str], rank: int) -> None:
    """Start a trail for this rank in ``directory`` (``None``: no trail)."""
    global _sink
    close_sink()
    if directory:
        _sink = open(os.path.join(directory, f"rank{rank}.progress"), "a", buffering=1)


def close_sink() -> None:
    global _sink
    if _sink is not None:
        _sink.close()
        _sink = None


def _write(line: str) -> None:
    if _sink is not None:
        _sink.write(line + "\n")
        _sink.flush()


def run_begun(label: str = "") -> None:
    _write(f"run {label}")


def step_begun(step: int, local_batch_size: int) -> None:
    _write(f"begin {step} {local_batch_size}")


def step_finished(step: int) -> None:
    _write(f"end {step}")


def run_ended() -> None:
    _write("done")


@dataclass
class Trail:
    """One rank's progress in its last run: steps begun / finished, local batch sizes, whether
    the run ended."""

    begun: int = 0
    finished: int = 0
    sizes: List[int] = field(default_factory=list)
    ended: bool = False
    runs: int = 0
    #: wall-clock time (``time.time()``) of the trail's last line (``None``: unknown)
    updated: Optional[float] = None
    #: the trail's last line ("begin 3 1", "end 3", "run ...", "done")
    last_line: str = ""

    def describe(self, rank: int, proven: bool = True) -> str:
        """``proven=False`` (a deadline passed, nothing proven): a step begun and not finished is
        told as not finished *yet* -- it may still finish."""
        if self.ended:
            return f"rank {rank} ended its run after {self.finished} step(s) (local batches {self.sizes})"
        if self.begun > self.finished:
            never = "and never finished it" if proven else "and had not finished it when the deadline passed"
            return (f"rank {rank} began step {self.begun} (local batch {self.sizes[-1]}) after {self.finished} "
                    f"finished step(s) {never} (local batches {self.sizes})")
        return f"rank {rank} finished {self.finished} step(s) and did not end its run (local batches {self.sizes})"


def read(directory: str, world_size: int) -> List[Optional[Trail]]:
    """Each rank's ``Trail`` of its *last* run in ``directory`` (``None`` where no file exists)."""
    out: List[Optional[Trail]] = []
    for r in range(world_size):
        path = os.path.join(directory, f"rank{r}.progress")
        if not os.path.exists(path):
            out.append(None)
            continue
        t = Trail()
        updated = os.path.getmtime(path)
        with open(path) as f:
            for line in f:
                parts = line.split()
                if not parts:
                    continue
                t.last_line = line.strip()
                if parts[0] == "run":
                    t = Trail(runs=t.runs + 1)
                elif parts[0] == "begin" and len(parts) == 3:
                    t.begun += 1
                    t.sizes.append(int(parts[2]))
                elif parts[0] == "end":
                    t.finished += 1
                elif parts[0] == "done":
                    t.ended = True
        t.updated = updated
        out.append(t)
    return out


def diverged(trails: List[Optional[Trail]]) -> bool:
    """True when the trails prove the ranks' step counts differ (all trails known): some rank
    *ended* its run after ``n`` steps -- a final count -- while another began more than ``n``.
    Counts that merely differ at some moment prove nothing: a rank may be one step behind."""
    if any(t is None for t in trails) or len(trails) < 2:
        return False
    return any(t.ended and any(u.begun > t.begun for u in trails) for t in trails)


def describe(trails: List[Optional[Trail]], proven: bool = True) -> str:
    return "; ".join(t.describe(r, proven) if t is not None else f"rank {r} left no progress"
                     for r, t in enumerate(trails))


def last_progress(trails: List[Optional[Trail]], ranks: List[int], at: Optional[float]) -> str:
    """For ``ranks``: each one's last progress line and how long before ``at`` (wall clock) it was
    written -- e.g. "rank 1's last progress: 'begin 3 1', 2.4 s before the deadline"."""
    out = []
    for r in ranks:
        t = trails[r] if r < len(trails) else None
        if t is None or not t.last_line:
            continue
        ago = f", {max(0.0, at - t.updated):.1f} s before the deadline" if at and t.updated else ""
        out.append(f"rank {r}'s last progress: {_said(t.last_line)}{ago}")
    return "; ".join(out)


def _said(line: str) -> str:
    """A trail line in words (steps counted from 1, as ``Trail.describe`` does)."""
    parts = line.split()
    if parts[0] == "begin" and len(parts) == 3:
        return f"began step {int(parts[1]) + 1} (local batch {parts[2]})"
    if parts[0] == "end" and len(parts) == 2:
        return f"finished step {int(parts[1]) + 1}"
    return {"run": "began its run", "done": "ended its run"}.get(parts[0], repr(line))

"""Where each rank is in its training loop, readable by the parent after a hang.

A hung rank cannot return its step count, so targets leave a trail instead: the job that runs a
target on a rank (``targets.run_many_on_rank``) opens a small per-rank file in a directory the
parent chose; ``step_begun(k, local_batch_size)``, ``pass_begun(k, j, size)`` (physical pass j of
logical step k, under gradient accumulation) and ``step_finished(k)`` append one line each
(flushed, so the parent sees it even when the rank is later killed); ``run_ended()`` marks the
end of a run. A target that learns a step's local batch size only from its passes (opacus'
``BatchMemoryManager`` yields physical batches) gives ``local_batch_size=None``: the trail then
counts the step's size as the sum of its passes. Outside such a job the calls do nothing, so a target can always call
them.

The parent (``properties.engine.runner``) reads every rank's file after a hang with ``read`` and tells
the hang in DP terms: "rank 0 ended its run after 3 steps; rank 1 began step 4 (local batch 1)
and never finished it", and, under accumulation, "physical passes per step [2, 1, 3]".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, cast

from ..harness.rank_groups import by_state, grouped, span

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


def step_begun(step: int, local_batch_size: Optional[int] = None) -> None:
    _write(f"begin {step} {-1 if local_batch_size is None else int(local_batch_size)}")


def pass_begun(step: int, index: int, size: int) -> None:
    """Physical pass ``index`` (0-based) of logical step ``step``, of ``size`` samples."""
    _write(f"pass {step} {index} {int(size)}")


def step_finished(step: int) -> None:
    _write(f"end {step}")


def run_ended() -> None:
    _write("done")


@dataclass
class Trail:
    """One rank's progress in its last run: steps begun / finished, local batch sizes, physical
    passes of each step (sizes; empty list: the target reported none), whether the run ended."""

    begun: int = 0
    finished: int = 0
    given: List[int] = field(default_factory=list)  # local batch size per step as given (-1: unknown)
    passes: List[List[int]] = field(default_factory=list)
    ended: bool = False
    runs: int = 0
    #: wall-clock time (``time.time()``) of the trail's last line (``None``: unknown)
    updated: Optional[float] = None
    #: the trail's last line ("begin 3 1", "pass 3 0 1", "end 3", "run ...", "done")
    last_line: str = ""
    #: the index (0-based) of the last step begun, as the target numbered it (-1: none): a resumed run or
    #: a skipped step numbers steps beyond the count begun, and a hang names the step it was in
    step: int = -1

    @property
    def current(self) -> int:
        """The step (counted from 1) the rank began last: its own index + 1, else the count begun."""
        return self.step + 1 if self.step >= 0 else self.begun

    @property
    def sizes(self) -> List[int]:
        """Local batch size of each step begun (the sum of its passes where the target did not say)."""
        return [g if g >= 0 else sum(p) for g, p in zip(self.given, self.passes)]

    @property
    def pass_counts(self) -> List[int]:
        """Physical passes begun in each step begun (all 0 when the target reports no passes)."""
        return [len(p) for p in self.passes]

    @property
    def accumulating(self) -> bool:
        return any(self.passes)

    def _passes(self) -> str:
        return f"; physical passes per step {self.pass_counts}" if self.accumulating else ""

    def state(self, proven: bool = True) -> str:
        """Where the rank is, without its own sizes: what ranks in the same place share ("began step
        1 after 0 finished step(s) and never finished it, during physical pass 2")."""
        if self.ended:
            return f"ended the run after {self.finished} step(s)"
        if self.begun > self.finished:
            during = f", during physical pass {self.pass_counts[-1]}" if self.passes and self.passes[-1] else ""
            never = "and never finished it" if proven else "and had not finished it when the deadline passed"
            return f"began step {self.current} after {self.finished} finished step(s) {never}{during}"
        return f"finished {self.finished} step(s) and did not end the run"

    def evidence(self) -> dict:
        """The trail as plain data, for a verdict's evidence."""
        return {"steps_begun": self.begun, "steps_finished": self.finished, "ended": self.ended,
                "local_batch_sizes": self.sizes, "physical_passes_per_step": self.pass_counts}

    def describe(self, rank: int, proven: bool = True) -> str:
        """``proven=False`` (a deadline passed, nothing proven): a step begun and not finished is
        told as not finished *yet* -- it may still finish."""
        if self.ended:
            return f"rank {rank} ended its run after {self.finished} step(s){self._batches()}"
        if self.begun > self.finished:
            during = (f", during physical pass {self.pass_counts[-1]} of size {self.passes[-1][-1]}"
                      if self.passes and self.passes[-1] else "")
            size = self.sizes[-1] if self.given[-1] >= 0 else f">= {self.sizes[-1]}"  # passes so far
            never = "and never finished it" if proven else "and had not finished it when the deadline passed"
            return (f"rank {rank} began step {self.current} (local batch {size}) after {self.finished} "
                    f"finished step(s) {never}{during}{self._batches()}")
        return f"rank {rank} finished {self.finished} step(s) and did not end its run{self._batches()}"

    def _batches(self) -> str:
        """`` (local batches [...]; passes)``, or what a rank that drew none says (never an empty list)."""
        return f" (local batches {self.sizes}{self._passes()})" if self.sizes else " (no local batch drawn)"


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
                if not line.endswith("\n"):
                    break  # a line being written (read while the rank runs): not there yet
                parts = line.split()
                if not parts:
                    continue
                t.last_line = line.strip()
                if parts[0] == "run":
                    t = Trail(runs=t.runs + 1)
                elif parts[0] == "begin" and len(parts) == 3:
                    t.begun += 1
                    t.step = int(parts[1])
                    t.given.append(int(parts[2]))
                    t.passes.append([])
                elif parts[0] == "pass" and len(parts) == 4 and t.passes:
                    t.passes[-1].append(int(parts[3]))
                elif parts[0] == "end":
                    t.finished += 1
                elif parts[0] == "done":
                    t.ended = True
        t.updated = updated
        out.append(t)
    return out


def hung_run_index(trails: Optional[List[Optional[Trail]]]) -> Optional[int]:
    """After a hang of a job that ran several runs in order (``targets.run_many_on_rank``): the
    index of the first run some rank had not ended -- the one the job hung in (every run before it
    ended on every rank). ``None`` when a rank left no trail (nothing can be told)."""
    if not trails or any(t is None for t in trails):
        return None
    known = [t for t in trails if t is not None]  # every trail, after the check above
    # a rank that ended its last run is between runs: the next one (index ``runs``) is where it is
    return min(max(0, t.runs - (0 if t.ended else 1)) for t in known)


def diverged(trails: List[Optional[Trail]]) -> bool:
    """True when the trails prove the ranks' step or pass counts differ (all trails known): some
    rank *ended* its run after ``n`` steps -- a final count -- while another began more than ``n``,
    or ``passes_diverged``. Step counts that merely differ at some moment prove nothing: a rank
    may be one step behind."""
    if any(t is None for t in trails) or len(trails) < 2:
        return False
    known = [t for t in trails if t is not None]  # every trail, after the check above
    return any(t.ended and any(u.begun > t.begun for u in known) for t in known) or passes_diverged(trails)


def passes_diverged(trails: List[Optional[Trail]]) -> bool:
    """True when some step's physical passes differ between ranks: ranks that finished the step
    ran different numbers, or a rank still in the step has begun more passes than a rank that
    finished it ran (a rank still in a step may simply not have reached its last pass yet)."""
    known = [t for t in trails if t is not None]
    if len(known) < len(trails) or len(trails) < 2 or not any(t.accumulating for t in known):
        return False
    for k in range(max(t.begun for t in known)):
        done = {t.pass_counts[k] for t in known if t.finished > k}
        running = [t.pass_counts[k] for t in known if t.finished <= k < t.begun]
        if len(done) > 1 or (done and any(n > max(done) for n in running)):
            return True
    return False


def divergence(trails: List[Optional[Trail]]) -> Optional[str]:
    """The sentence that ``diverged`` is true, told from counts that are final, or ``None``: what
    the harness' watchdog may decide a job on while it runs (``watch``). Only trails of the same
    run on every rank are compared (a job runs several runs in order; a rank's trail is its
    latest run's)."""
    if any(t is None for t in trails):
        return None
    known = cast(List[Trail], trails)  # none is None (checked above)
    if len(known) < 2 or len({t.runs for t in known}) != 1 or not diverged(trails):
        return None
    if passes_diverged(trails):
        for k in range(max(t.begun for t in known)):
            done = {r: t.pass_counts[k] for r, t in enumerate(known) if t.finished > k}
            running = {r: t.pass_counts[k] for r, t in enumerate(known) if t.finished <= k < t.begun}
            most = max(done.values(), default=0)
            ahead = {r: n for r, n in running.items() if n > most}
            if len(set(done.values())) > 1 or (done and ahead):
                said = {r: f"finished it after {n} physical pass(es)" for r, n in done.items()}
                said.update({r: f"had begun {n} physical passes in it" for r, n in ahead.items()})
                return f"in logical step {k + 1}, {grouped(said)}"
    ended = [r for r, t in enumerate(known) if t.ended]
    for r in ended:
        more = {q: f"began step {u.current}" for q, u in enumerate(known) if u.begun > known[r].begun}
        if more:
            return f"rank {r} ended its run after {known[r].finished} step(s), while {grouped(more)}"
    return None  # unreachable while ``diverged`` holds


def watch(directory: str, world_size: int):
    """For the harness' watchdog (``WorkerGroup.run(..., evidence=)``): a function that reads every
    rank's trail in ``directory`` and returns ``(state, proof)``: ``state`` changes whenever some
    rank's trail does (a rank writing its trail is progressing), ``proof`` is ``divergence``'s
    sentence (``None``: nothing proven). Counts only grow and a finished step's or an ended run's
    are final, so a trail read while its rank writes it can be behind, never wrong the other way:
    a divergence read once is one."""
    def evidence():
        trails = read(directory, world_size)
        state = tuple(None if t is None else (t.runs, t.begun, t.finished, tuple(t.pass_counts), t.ended)
                      for t in trails)
        return state, divergence(trails)
    return evidence


def describe(trails: List[Optional[Trail]], proven: bool = True) -> str:
    """Every rank's progress, each state once with its ranks ("ranks 0-6 began step 1 ... and never
    finished it; rank 7 finished 1 step(s) and did not end its run"); a rank alone in its state
    is told with its own local batches. Bounded by the states named, not by the world size
    (``rank_groups``); ``describe_each`` tells every rank."""
    states = {r: t.state(proven) if t is not None else "left no progress" for r, t in enumerate(trails)}
    return grouped(states, alone=lambda r: _one(trails, r, proven))


def describe_each(trails: List[Optional[Trail]], proven: bool = True) -> str:
    """One line per rank with its local batches and passes: a verdict's details."""
    return "\n".join(_one(trails, r, proven) for r in range(len(trails)))


def evidence(trails: List[Optional[Trail]]) -> List[Optional[dict]]:
    """Every rank's trail as plain data (``Trail.evidence``; ``None``: no trail)."""
    return [t.evidence() if t is not None else None for t in trails]


def _one(trails: List[Optional[Trail]], rank: int, proven: bool) -> str:
    t = trails[rank]
    return t.describe(rank, proven) if t is not None else f"rank {rank} left no progress"


def last_progress(trails: List[Optional[Trail]], ranks: List[int], at: Optional[float]) -> str:
    """For ``ranks``: each one's last progress line in words and how long before ``at`` (wall
    clock) it was written, ranks alike told once -- e.g. "last progress of rank 1: began step 4
    (local batch 1), 2.4 s before the deadline; ranks 2-7: finished step 3, 0.1-0.3 s before the deadline"."""
    said, ago = {}, {}
    for r in ranks:
        t = trails[r] if r < len(trails) else None
        if t is None or not t.last_line:
            continue
        said[r] = _said(t.last_line)
        if at and t.updated:
            ago[r] = max(0.0, at - t.updated)
    states = {}  # ranks that wrote the same last line are told once, their seconds as a range
    for ranks_alike, line in by_state(said):
        secs = [ago[r] for r in ranks_alike if r in ago]
        for r in ranks_alike:
            states[r] = f"{line}, {span(secs)} s before the deadline" if secs else line
    return f"last progress of {grouped(states, between=': ')}" if states else ""


def _said(line: str) -> str:
    """A trail line in words (steps and passes counted from 1, as ``Trail.describe`` does)."""
    parts = line.split()
    if parts[0] == "begin" and len(parts) == 3:
        size = f" (local batch {parts[2]})" if int(parts[2]) >= 0 else ""
        return f"began step {int(parts[1]) + 1}{size}"
    if parts[0] == "pass" and len(parts) == 4:
        return f"began physical pass {int(parts[2]) + 1} (size {parts[3]}) of step {int(parts[1]) + 1}"
    if parts[0] == "end" and len(parts) == 2:
        return f"finished step {int(parts[1]) + 1}"
    return {"run": "began its run", "done": "ended its run"}.get(parts[0], repr(line))


__all__ = ["step_begun", "step_finished", "run_begun", "run_ended"]

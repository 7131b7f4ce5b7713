"""Proving a deadlock before the deadline, from the ranks' probes (parent side).

While a job runs, the parent polls every rank with a cheap ``ProbeRequest``; each answer
(``protocol.Probe``) says whether the rank is still in the job and which collectives it issued
last, per process group (the flight recorder's ``collective_seq_id`` and op/sizes). A gloo
collective completes only once *every* member of its group has issued it, and with gloo the
recorder leaves entries ``scheduled`` after they complete, so nothing here reads ``state``:
the proof is about sequence ids and ops only.

In the default process group (whose members are all ranks) the pending collectives can never
complete when, and the watch only then says so:

* **a finished peer**: rank ``r`` is in the job and issued collective ``#s``, while a rank ``p``
  has finished the job (its result is sent) having issued only up to ``#s' < s``: ``p`` will
  never issue ``#s``, so ``r`` waits forever;
* **mismatched collectives**: two ranks still in the job issued different ops under the same
  sequence id, the newest of at least one of them (or the same op with different sizes, for ops
  whose sizes must agree on every rank: all_reduce, all_gather, reduce_scatter, broadcast,
  barrier -- not gather/scatter/all_to_all, whose sizes legitimately differ): it waits for a
  partner that will never come (the other rank used that sequence id for something else).

and, in both cases, no rank's probe has changed for ``QUIET_S``. A rank that is merely slow
(computing, sleeping, in a long Python loop between collectives) makes none of these true: its
peers wait in a collective *it has not issued yet* while it is still in the job -- that is
never a proof, and such a job runs to its deadline if it really never comes back.

**Diverged progress** (a second kind of proof, of a narrower claim): the job's caller may give
``evidence``, a function reading where each rank is in its own program -- the gate passes the ranks'
progress trails (``targets.progress.watch``: logical steps begun and finished, physical passes per
step, run ended). When it returns a sentence, the ranks' counts have diverged in a way that cannot
un-happen: counts only grow, and the count of a step a rank finished or of a run it ended is
final, so "rank 2 finished step 1 after 1 pass while ranks 0, 1 had begun 2" stays true whatever
the ranks do next (a trail read while its rank writes it can only be behind). The watch decides
the job on it once neither the evidence nor any rank's probe changed for ``QUIET_S`` -- the
ranks are stalled -- and ``proof_kind`` is then ``"step_divergence"``. What it claims is that
the counts diverged and the ranks stopped progressing, not that a collective can never complete:
the flight recorder may see none of the ranks' collectives (a target's own process groups, a
recorder that records nothing). It is sound for the verdict because no outcome of the job could
change it: run on, such a job ends in gloo's abort on a mismatched collective (the same
divergence, ``error``), a wait forever, or outputs whose pass counts differ, which the runner's
own check fails as the same ``step_divergence``. Ranks that are merely at different points of a
correct run (one still in pass 1 of a step another finished after 2 passes) never satisfy it:
only final counts are compared with counts begun, and only when nothing moves. A deadlock
proof, when there is one, is preferred (it says more).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Hashable, Optional, Set, Tuple

from .protocol import Probe

#: Start probing once a job has run this long (most jobs finish before: they pay nothing). A
#: proof costs this plus ``QUIET_S`` after the divergence: a target that hangs in every job (a
#: collective on one rank only) pays it in each of the gate's ~25 jobs at 2 ranks.
PROBE_AFTER_S = 0.25
#: Between probe rounds.
PROBE_EVERY_S = 0.25
#: A proof must hold, with no rank's probe changing, for this long before it is a verdict. Both
#: proofs are facts that cannot un-happen (a peer finished; a sequence id used for two ops): the
#: wait only makes sure the probes it reads are all of one moment; 2 probe rounds and more.
QUIET_S = 0.5
#: The process group the proof is about: torch names the default (world) group "0".
DEFAULT_PG = "0"
#: Ops whose input sizes are the same on every rank of a correct program (the part after
#: "gloo:"/"nccl:" in the recorder's profiling name).
SIZE_MATCHED_OPS = frozenset({"all_reduce", "allreduce", "allreduce_coalesced", "all_gather", "allgather",
                              "_allgather_base", "all_gather_into_tensor", "allgather_into_tensor_coalesced",
                              "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor", "broadcast",
                              "barrier"})


def same_collective(a: Tuple[str, str], b: Tuple[str, str]) -> bool:
    """Whether two ranks' entries ``(op, sizes)`` under one sequence id can be the same collective."""
    if a[0] != b[0]:
        return False
    return a[1] == b[1] or a[0].split(":")[-1] not in SIZE_MATCHED_OPS


def _text(entry: Tuple[str, str]) -> str:
    return f"{entry[0]} {entry[1]}"


#: ``evidence()`` of a job's caller: ``(state, proof)``, ``state`` any value that changes when a rank
#: progresses, ``proof`` the sentence that the ranks' counts diverged (``None``: nothing proven)
Evidence = Callable[[], Tuple[Hashable, Optional[str]]]


class DeadlockWatch:
    """Collects one job's probes; ``check`` returns the proof sentence once one holds steadily
    (``proof_kind`` then says which: ``"deadlock"`` or ``"step_divergence"``)."""

    def __init__(self, world_size: int, job_id: int, quiet_s: float = QUIET_S):
        self.world_size, self.job_id, self.quiet_s = world_size, job_id, quiet_s
        self.latest: Dict[int, Probe] = {}
        self._state: Optional[tuple] = None
        self._since = 0.0
        self.proof_kind: Optional[str] = None
        #: per rank, when its probe last showed something new (a collective issued, the job
        #: finished): what a timeout's message reports as "since its last progress"
        self.changed_at: Dict[int, float] = {}
        self.first_seen: Dict[int, float] = {}

    def update(self, probe: Probe, now: Optional[float] = None) -> None:
        """Record a rank's answer (answers to another job's request are ignored)."""
        if probe.job_id != self.job_id:
            return
        before = self.latest.get(probe.rank)
        now = time.monotonic() if now is None else now
        if before is None:
            self.first_seen[probe.rank] = now
        if before is None or _progress_of(before) != _progress_of(probe):
            self.changed_at[probe.rank] = now
        self.latest[probe.rank] = probe

    def idle_for(self, now: float) -> Dict[int, Tuple[float, bool]]:
        """Per rank, ``(seconds, seen)``: seconds since its probe last changed, ``seen`` False when
        it never changed while watched (then it made no progress for *at least* that long).
        Ranks never probed are absent."""
        return {r: (now - t, t > self.first_seen[r]) for r, t in self.changed_at.items()}

    def candidate(self, finished: Set[int]) -> Optional[str]:
        """The proof sentence the latest probes would give if they stayed unchanged for
        ``quiet_s`` (``None`` if they give none): at a deadline, a deadlock suspected but not
        confirmed -- never a verdict by itself."""
        if len(self.latest) < self.world_size or any(p.error for p in self.latest.values()):
            return None
        done = set(finished) | {r for r, p in self.latest.items() if p.done >= self.job_id}
        return stuck_reason(self.latest, done)

    def check(self, finished: Set[int], now: float, evidence: Optional[Evidence] = None) -> Optional[str]:
        """The proof (one sentence) if the ranks' pending collectives can never complete, or the
        caller's ``evidence`` proves their counts diverged, and the ranks' state (probes and
        evidence alike) has not changed for ``quiet_s``; else ``None``. ``finished``: ranks whose
        result the parent already holds. Probes without a trace (recorder off) leave only the
        evidence to prove anything."""
        if len(self.latest) < self.world_size:
            return None
        traced = not any(p.error for p in self.latest.values())
        if not traced and evidence is None:
            return None
        done = set(finished) | {r for r, p in self.latest.items() if p.done >= self.job_id}
        seen, proof = evidence() if evidence is not None else (None, None)
        state = (tuple((r, r in done, tuple(sorted(p.recent.get(DEFAULT_PG, {}).items())))
                       for r, p in sorted(self.latest.items())), seen)
        if state != self._state:
            self._state, self._since = state, now
            return None
        if now - self._since < self.quiet_s:
            return None
        reason = stuck_reason(self.latest, done) if traced else None
        if reason:
            self.proof_kind = "deadlock"
            return reason
        if proof:
            self.proof_kind = "step_divergence"
        return proof


def _progress_of(probe: Probe):
    return (probe.done, tuple(sorted((g, tuple(sorted(e))) for g, e in probe.recent.items())))


def stuck_reason(probes: Dict[int, Probe], done: Set[int]) -> Optional[str]:
    """Why the default group's pending collectives can never complete, or ``None`` if they might
    (see the module docstring for the two cases)."""
    running = sorted(r for r in probes if r not in done)
    if not running:
        return None
    # Optional[int] each (None: the rank issued no collective), checked before every comparison
    last: Dict[int, Any] = {r: probes[r].last(DEFAULT_PG) for r in probes}
    for r in running:
        if last[r] is None:
            continue
        for p in sorted(done):
            if last[p] is None or last[p] < last[r]:
                seen = f"after #{last[p]}" if last[p] is not None else "without issuing any collective"
                op = _text(probes[r].recent[DEFAULT_PG][last[r]])
                return (f"rank {r} waits in collective #{last[r]} ({op}), which rank {p} can never issue: "
                        f"rank {p} finished the job {seen}")
    for i, r in enumerate(running):
        for q in running[i + 1:]:
            mine, theirs = probes[r].recent.get(DEFAULT_PG, {}), probes[q].recent.get(DEFAULT_PG, {})
            # only at a rank's newest entry: that is where it waits (an older mismatch that both
            # ranks got past proves nothing about now)
            for seq in sorted({last[r], last[q]} & set(mine) & set(theirs)):
                if not same_collective(mine[seq], theirs[seq]):
                    return (f"ranks {r} and {q} issued different collectives as #{seq} "
                            f"(rank {r}: {_text(mine[seq])}; rank {q}: {_text(theirs[seq])}): neither can complete")
    return None


__all__ = ["PROBE_AFTER_S", "PROBE_EVERY_S", "QUIET_S", "DEFAULT_PG", "SIZE_MATCHED_OPS", "same_collective",
           "Evidence", "DeadlockWatch", "stuck_reason"]

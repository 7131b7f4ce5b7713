"""What a verdict says when a case's run hung or crashed (``engine.runner.failure_verdict``): the
sentences of a ``FailureFinding``. Pure functions of the finding and the ranks' progress trails
(``targets.progress`` words them); nothing is detected here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List

from ...targets import progress


@dataclass(frozen=True)
class FailureFinding:
    """A hung or crashed run: the verdict's ``status`` and ``diagnosis``, and the ``kind`` of failure
    its sentence names -- ``timeout`` (unproven hang), ``step_divergence`` (ranks took different step
    counts), ``pass_divergence`` (different logical steps or physical passes under accumulation;
    ``outcome``: ``crashed`` / ``stalled`` / ``hangs``), ``deadlock`` (any other hang),
    ``placement_mismatch`` (``placement_rank`` refused an in-place op across DTensor placements) or
    ``rank_crash`` (any other error). ``harness_message``: the harness's one-line account; ``trails``:
    each rank's progress trail (``[]`` if none was read); ``busy_ranks`` / ``fired_at``: the watchdog's;
    ``site``: where a crash was raised (``at fork/x.py:12 in wrap``)."""
    status: str
    diagnosis: str
    kind: str
    harness_message: str
    trails: List[Any] = field(default_factory=list)
    busy_ranks: List[int] = field(default_factory=list)
    fired_at: Any = None
    outcome: str = ""
    placement_rank: int = -1
    #: where the first rank that raised did (``targets.crash_site.CrashSite.phrase``), "" if unknown
    site: str = ""


def failure_lead(doing: str, attributed: bool, others_in_job: int) -> str:
    """What the case was doing, and the job it shared, before the failure's account."""
    if attributed:  # the ranks' trails put the job's hang on this case
        together = (f" (run in one job with {others_in_job} other configuration(s): the ranks' progress "
                    "trails show the job hung in this one; the others were run again without it)")
    elif others_in_job:
        together = f" (ran as one job with {others_in_job} other configuration(s))"
    else:
        together = ""
    return f"{doing}{together}: " if doing or together else ""


def _complete(trails: List[Any]) -> bool:
    return bool(trails) and all(t is not None for t in trails)


def _timeout(f: FailureFinding) -> str:
    # unproven: step counts that differ now may be a rank mid-step, never a divergence claim
    msg = f"the target did not finish under the watchdog, and no deadlock was proven ({f.harness_message})."
    if _complete(f.trails):
        msg += f" Progress: {progress.describe(f.trails, proven=False)}."
        last = progress.last_progress(f.trails, f.busy_ranks, f.fired_at)
        if last:
            msg += f" {last[0].upper()}{last[1:]}."
    return msg


def _step_divergence(f: FailureFinding) -> str:
    return (f"the ranks took different numbers of steps and the run hangs: {progress.describe(f.trails)}. "
            f"The rank with more steps waits forever in FSDP's next collective ({f.harness_message}). Poisson "
            "sampling draws each rank's batches from its own random stream; a sampler that skips empty "
            "local batches (or ranks whose streams differ) gives the ranks different step counts.")


#: how a pass divergence ended, by ``FailureFinding.outcome``
OUTCOMES = {"crashed": "a rank crashed in a mismatched collective", "stalled": "the ranks stalled",
            "hangs": "the run hangs"}


def _pass_divergence(f: FailureFinding) -> str:
    return (f"the ranks ran different numbers of logical steps or physical passes and {OUTCOMES[f.outcome]}: "
            f"{progress.describe(f.trails)}. Every physical pass is a full FSDP forward/backward, so passes that "
            "differ pair their collectives across logical steps until one rank ends and the other waits "
            f"forever ({f.harness_message}). Gradient accumulation that splits each rank's own local batch "
            "(opacus' BatchMemoryManager) gives ranks with more local samples more passes; the ranks must "
            "agree on the pass count (e.g. the maximum, padding with empty passes).")


def _deadlock(f: FailureFinding) -> str:
    msg = (f"the run deadlocked ({f.harness_message}). A collective issued by only some ranks, or in "
           "rank-/data-dependent control flow, leaves the others waiting forever.")
    if _complete(f.trails):
        msg += f" Progress: {progress.describe(f.trails)}."
    return msg


def _placement(f: FailureFinding) -> str:
    # a named cause, not a bare crash: which tensors disagree is in the rank's error (one line here)
    return (f"rank {f.placement_rank} was refused an in-place update across DTensor placements "
            f"({' '.join(f.harness_message.split())}). FSDP2 shards every parameter on dim 0 (Shard(0)); a gradient "
            "released in another placement (e.g. Replicate, as DTensor's propagation gives an op mixing a "
            "parameter with fewer rows than ranks and a full-shape tensor) cannot be applied in place by the "
            "optimizer. The released gradient must have its parameter's placement (redistribute it).")


def failure_message(f: FailureFinding, lead: str) -> str:
    """The verdict's message: ``lead`` (``failure_lead``), then the failure in words."""
    words = {"timeout": _timeout, "step_divergence": _step_divergence, "pass_divergence": _pass_divergence,
             "deadlock": _deadlock, "placement_mismatch": _placement}
    if f.kind in words:
        return lead + words[f.kind](f)
    if f.site:  # where first: a fork's crash is one line of the fork, and the message says which
        return f"{lead}a rank failed {f.site}: {f.harness_message}."
    return f"{lead}a rank failed ({f.harness_message})."


def failure_details(f: FailureFinding, details: str) -> str:
    """The verdict's details: every rank's own progress trail (the message groups the ranks by state),
    then the harness's details."""
    if not f.trails:
        return details
    return (f"--- progress of every rank ---\n{progress.describe_each(f.trails, proven=f.diagnosis != 'timeout')}"
            + (f"\n{details}" if details else ""))


def in_mode(label: str, env: str, message: str) -> str:
    """A failure's message when the case runs in several modes and mode ``label`` failed."""
    return f"mode {label!r} ({env}) did not complete: {message}"


__all__ = ["FailureFinding", "OUTCOMES", "failure_lead", "failure_message", "failure_details", "in_mode"]

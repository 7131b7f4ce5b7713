"""What a worker group's verdicts say: the ``message`` and ``details`` of a ``GroupResult``.

Pure functions of plain data -- exit codes, the ranks' errors, their dumps (stacks and
flight-recorder traces, ``diagnose.py`` reads them), the deadlock proof's sentence and the
seconds measured -- returning strings. ``group.py`` decides *what* happened (which ranks finished,
crashed, raised or were stuck, whether a deadlock was proven) and calls these to say it; nothing
here starts, waits for or ends a process, so each sentence can be read and tested on its own.
Like the rest of the harness, it knows nothing of DP: a job is any function run on every rank.
"""

from __future__ import annotations

import signal
from typing import Dict, List, Mapping, Optional, Tuple

from . import diagnose
from .frames import format_frames, user_frames
from .rank_groups import grouped, ranks_phrase, were
from .proof import QUIET_S
from .protocol import JobError, RankDump

#: how long a divergence must hold with nothing moving (``proof.QUIET_S``), in words
QUIET_TEXT = f"{QUIET_S:g} s"
#: appended to a recovered deadlock's details
RECOVERED = "\n(the ranks' process group was aborted and renewed; the warm ranks were kept for the next job)"


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def exit_text(code: Optional[int]) -> str:
    """How a rank process ended: its exit code, the signal that killed it, or still running."""
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {_signal_name(code)}"
    return f"exit code {code}"


def raised(errors: Dict[int, JobError]) -> Tuple[str, str]:
    """``(message, details)`` for ranks whose job raised (``errors``: rank -> its error): the first
    rank's exception in one line, every rank's traceback in the details."""
    bad = sorted(errors)
    first = errors[bad[0]]
    message = (f"rank {bad[0]} raised {first.type}: {first.message}"
               + (f" ({ranks_phrase(bad)} all raised)" if len(bad) > 1 else ""))
    details = "\n".join(f"--- rank {r} traceback ---\n{readable_traceback(errors[r])}" for r in bad)
    return message, details


def readable_traceback(error: JobError) -> str:
    """A rank's traceback as a user reads it: without the harness's frames (``frames.user_frames``);
    the text the rank formatted where it sent no frames."""
    if not error.frames:
        return error.traceback
    return ("Traceback (most recent call last):\n" + format_frames(user_frames(error.frames))
            + f"{error.type}: {error.message}\n")


def left_waiting(running: List[int], grace_s: float) -> str:
    """Appended to ``raised``'s message when other ranks were still in the job after ``grace_s``."""
    return f"; {ranks_phrase(running)} {were(running)} left waiting (ended after {grace_s:.1f} s grace)"


def where_others_were(dumps: Dict[int, RankDump], running: List[int], unresponsive: List[int]) -> str:
    """Appended to a crash's or an error's details: where the ranks still in the job were."""
    return "\n--- where the other ranks were ---\n" + diagnose.hang_report(dumps, running, unresponsive)


def crashed(codes: Mapping[int, Optional[int]], running: List[int]) -> str:
    """The message of rank processes that died (``codes``: rank -> exit code or -signal), ranks
    that ended alike told once ("ranks 0-6 died (killed by SIGKILL)")."""
    what = grouped({r: f"died ({exit_text(code)})" for r, code in codes.items()})
    return what + (f"; {ranks_phrase(running)} {were(running)} still running and {were(running)} ended"
                   if running else "")


def deadlock(dumps: Dict[int, RankDump], running: List[int], proven: str, after: float,
             timeout: float) -> Tuple[str, str]:
    """``(message, head of the report)`` for a deadlock the probes proved ``after`` seconds into a
    job with deadline ``timeout``: the ``proven`` sentence, where the collective sequences diverge
    and each stuck rank's call site."""
    div = diagnose.find_divergence(dumps)
    message = (f"deadlock proven after {after:.1f} s, before the {timeout:g} s deadline: {ranks_phrase(running)} "
               f"can never finish ({proven})")
    message += f"; {diagnose.describe_divergence(div)}" if div else ""
    sites = grouped({r: f"at {diagnose.call_site(dumps[r])}" for r in running if r in dumps})
    if sites:
        message += f" ({sites})"
    return message, f"deadlock proven after {after:.1f} s: {proven}.\n"


def diverged(dumps: Dict[int, RankDump], running: List[int], proven: str, after: float,
             timeout: float) -> Tuple[str, str]:
    """``(message, head of the report)`` for a job the caller's evidence proved diverged (``proven``:
    its sentence, e.g. where the ranks' pass counts part) ``after`` seconds into a job with deadline
    ``timeout``, with no rank progressing: each rank's call site, and what the flight recorder
    saw of the default group (it may have seen nothing of the divergence: not needed)."""
    message = (f"step divergence proven after {after:.1f} s, before the {timeout:g} s deadline, from the ranks' "
               f"progress ({proven}); no rank progressed for {QUIET_TEXT}")
    sites = grouped({r: f"at {diagnose.call_site(dumps[r])}" for r in running if r in dumps})
    if sites:
        message += f" ({sites})"
    return message, f"step divergence proven after {after:.1f} s from the ranks' progress: {proven}.\n"


def hang_details(report: str, analysis: Optional[str], dumps: Dict[int, RankDump]) -> str:
    """A hang's details: the report, torch's analyser's finding (if any), every rank's stacks."""
    if analysis:
        report += "\n--- torch flight_recorder analyser (fr_trace) ---\n" + analysis
    return report + "\n" + diagnose.format_stacks(dumps)


__all__ = ["RECOVERED", "QUIET_TEXT", "exit_text", "raised", "readable_traceback",
           "left_waiting", "where_others_were", "crashed", "deadlock",
           "diverged", "hang_details"]

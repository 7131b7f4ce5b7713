"""Turn per-rank dumps (stacks + flight-recorder traces) into a diagnosis a human can act on.

The flight recorder (``TORCH_FR_BUFFER_SIZE``, set by the harness before the process group is
created) records every collective a rank *issued*, with ``collective_seq_id``, ``profiling_name``
(``gloo:all_reduce``…) and ``input_sizes``. With gloo, entries stay ``scheduled`` even after they
complete, so this module never trusts ``state``: it compares, per process group, which collectives
each rank issued, and reports the first sequence id where the ranks disagree — a different op or
sizes (mismatched collectives), or a rank that never issued it (skipped / stuck elsewhere).

``write_fr_dumps`` also saves the raw per-rank traces in the layout torch's own analyser reads
(``python -m torch.distributed.flight_recorder.fr_trace -p rank_ DIR``), and ``torch_analysis``
runs that analyser in-process on every hang: its verdict is attached to the report.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .frames import is_harness_frame
from .protocol import RankDump
from .rank_groups import grouped, ranks_phrase, span

_HARNESS_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Divergence:
    """The first collective on which the ranks disagree."""

    seq_id: int
    process_group: str
    issued: Dict[int, str] = field(default_factory=dict)   # rank -> "gloo:all_reduce [[5]]"
    missing: List[int] = field(default_factory=list)       # ranks that never issued seq_id
    last_seq: Dict[int, int] = field(default_factory=dict)  # rank -> its last seq id in that group


def describe_entry(entry: dict) -> str:
    """One flight-recorder entry as the reports name it: ``gloo:all_reduce [[5]]``."""
    sizes = entry.get("input_sizes")
    return f"{entry.get('profiling_name', '?')} {sizes}" if sizes is not None else entry.get("profiling_name", "?")


def entries_by_group(fr: Optional[dict]) -> Dict[str, Dict[int, dict]]:
    """A flight-recorder trace's collectives (point-to-point left out) as ``{process group:
    {sequence id: entry}}``."""
    out: Dict[str, Dict[int, dict]] = {}
    for e in (fr or {}).get("entries", []):
        seq = e.get("collective_seq_id")
        if seq is None or seq < 0 or e.get("is_p2p", False) is not False:
            continue
        pg = e.get("process_group")
        key = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(pg)
        out.setdefault(key, {})[seq] = e
    return out


def find_divergence(dumps: Dict[int, RankDump]) -> Optional[Divergence]:
    """The first sequence id where ranks issued different collectives, or where some rank
    issued none. ``None`` when every rank issued the same collectives (or no traces exist)."""
    per_rank = {r: entries_by_group(d.flight_recorder) for r, d in dumps.items() if d.flight_recorder is not None}
    if len(per_rank) < 2:
        return None
    groups = sorted({g for by_group in per_rank.values() for g in by_group})
    best: Optional[Divergence] = None
    for g in groups:
        seqs = {r: by_group.get(g, {}) for r, by_group in per_rank.items()}
        # entries older than the smallest ring buffer window cannot be compared
        lo = max((min(s) for s in seqs.values() if s), default=0)
        hi = max((max(s) for s in seqs.values() if s), default=-1)
        for seq in range(lo, hi + 1):
            issued = {r: describe_entry(s[seq]) for r, s in seqs.items() if seq in s}
            missing = [r for r, s in seqs.items() if seq not in s]
            if missing or len(set(issued.values())) > 1:
                d = Divergence(seq, g, issued, missing, {r: max(s) if s else -1 for r, s in seqs.items()})
                if best is None or seq < best.seq_id:
                    best = d
                break
    return best


def call_site(dump: RankDump) -> str:
    """The innermost frame of the main thread that is neither torch nor this harness."""
    return user_call_site(dump.main_frames)


def user_call_site(frames: List[tuple]) -> str:
    """The innermost of ``frames`` (``(file, line, function)``, innermost last) that is neither
    torch nor this harness: where a rank was, in the target's terms."""
    for filename, line, func in reversed(frames):
        if (os.sep + "torch" + os.sep) in filename or filename.startswith(_HARNESS_DIR):
            continue
        if "multiprocessing" in filename or filename.startswith("<"):
            continue
        return f"{filename}:{line} in {func}"
    return "(no user frame on the main thread)"


def describe_divergence(div: Divergence, proven: bool = True) -> str:
    """One sentence: where the ranks' collective sequences part. ``proven=False`` (a deadline
    passed without a proof): a collective some rank has not issued *yet* -- it may still come."""
    if div.missing:
        ops = sorted(set(div.issued.values()))
        who = ranks_phrase(div.issued)
        missing = grouped({r: f"(last issued #{div.last_seq[r]})" if div.last_seq.get(r, -1) >= 0
                           else "(issued none in this group)" for r in div.missing}, sep=", ")
        if not proven:
            return (f"collective #{div.seq_id} ({' / '.join(ops)}) was issued by {who} but not yet by "
                    f"{missing} when the deadline passed")
        return (f"collective #{div.seq_id} ({' / '.join(ops)}) was issued by {who} but never by "
                f"{missing}: the ranks' collective sequences diverge there")
    return f"mismatched collectives at #{div.seq_id}: {grouped(div.issued, between=': ')}"


def hang_report(dumps: Dict[int, RankDump], running: List[int], unresponsive: List[int],
                proven: bool = True) -> str:
    """The multi-line diagnosis attached to a ``hang`` verdict (and to a crash's survivors);
    ``proven=False`` for a deadline that passed without a proof (``describe_divergence``)."""
    lines = []
    div = find_divergence(dumps)
    if div is not None:
        lines.append(describe_divergence(div, proven) + ".")
    elif any(d.flight_recorder is not None for d in dumps.values()):
        lines.append("every rank issued the same collectives; the stuck rank(s) are outside any collective.")
    else:
        errs = {d.flight_recorder_error for d in dumps.values() if d.flight_recorder_error}
        lines.append("no flight-recorder trace available (" + "; ".join(sorted(errs)) + "): stacks only.")
    for r in sorted(dumps):
        d = dumps[r]
        state = "still running the job" if r in running else "finished the job"
        last = _last_entry(d)
        lines.append(f"rank {r} ({state}): at {call_site(d)}" + (f"; last collective {last}" if last else ""))
    for r in unresponsive:
        lines.append(f"rank {r}: did not answer the dump request (stuck holding the GIL, or dead)")
    return "\n".join(lines)


#: the process group whose sequence ids tell waiting ranks from busy ones: the default (world)
#: group, as in ``proof.py`` (its members are every rank)
DEFAULT_PG = "0"


@dataclass
class Busy:
    """Who held a job up when its deadline passed without a proof (``busy_ranks``)."""

    #: ranks still in the job that had not issued the newest collective some rank issued (or,
    #: when every rank issued the same ones, every rank still in the job): computing, sleeping or
    #: looping outside the default group's collectives
    busy: List[int]
    #: rank -> the collective it waits in (a sequence id some busy rank has not issued yet)
    waiting: Dict[int, int] = field(default_factory=dict)
    #: rank -> its newest sequence id in the default group (absent: no trace)
    last: Dict[int, int] = field(default_factory=dict)


def _default_group(d: RankDump) -> Dict[int, dict]:
    return entries_by_group(d.flight_recorder).get(DEFAULT_PG, {})


def busy_ranks(dumps: Dict[int, RankDump], running: List[int]) -> Busy:
    """Tell the ranks that hold the job up from those that wait for them, from the collectives
    each rank issued (a gloo collective completes only once every rank issued it): a rank that
    issued collective ``#s`` waits there while a rank still in the job has issued only up to
    ``#s' < s``. Facts about the moment of the dumps, not a proof that anyone is stuck."""
    last = {r: max(e) for r, d in dumps.items() for e in (_default_group(d),) if e}
    traced = [r for r in running if r in last]
    if not last or len(traced) < len(running):
        return Busy(busy=list(running), last=last)  # no trace for some rank: nothing to compare
    top = max(last.values())
    behind = [r for r in running if last[r] < top]
    if not behind:
        return Busy(busy=list(running), last=last)
    first_missing = min(last[r] for r in behind) + 1
    waiting = {r: first_missing for r in running if r not in behind}
    return Busy(busy=behind, waiting=waiting, last=last)


def timeout_message(dumps: Dict[int, RankDump], running: List[int], unresponsive: List[int], timeout: float,
                    idle_for: Optional[Dict[int, tuple]] = None, suspected: Optional[str] = None) -> str:
    """The message of a deadline that passed with no deadlock proven (diagnosis ``timeout``): which
    rank(s) were busy outside collectives, where (their innermost user frame), for how long
    since their last progress (``idle_for``: ``proof.DeadlockWatch.idle_for``), and which
    collective the others waited in. It claims no divergence: a busy rank may be slow."""
    idle_for = idle_for or {}
    b = busy_ranks(dumps, running)
    # each busy rank's state without its own seconds; ranks in the same state are told once, their
    # seconds since the last progress as a range
    keys: Dict[int, tuple] = {}
    for r in b.busy:
        site = f"at {call_site(dumps[r])}" if r in dumps else "did not answer the dump request"
        seen = idle_for[r][1] if r in idle_for else None
        if r in b.last:
            coll = f"last collective #{b.last[r]} {describe_entry(_default_group(dumps[r])[b.last[r]])}"
        elif r in dumps and dumps[r].flight_recorder is not None:
            coll = "no collective issued yet"
        else:
            coll = None
        keys[r] = (site, seen, coll)
    idle_by_key: Dict[tuple, List[float]] = {}
    for r, key in keys.items():
        if key[1] is not None:
            idle_by_key.setdefault(key, []).append(idle_for[r][0])
    states = {}
    for r, (site, seen, coll) in keys.items():
        bits = [site]
        if seen is not None:
            secs = span(idle_by_key[keys[r]])
            bits.append(f"last progress {secs} s before the deadline" if seen else f"no progress for at least {secs} s")
        if coll:
            bits.append(coll)
        states[r] = f"({'; '.join(bits)})"
    parts = [grouped(states, sep=", ")] if states else []
    where = "outside any collective" if b.waiting or all(r in b.last for r in running) else "somewhere"
    msg = (f"no deadlock proven: the job did not finish within {timeout:g} s; busy {where}, still in the job: "
           + ", ".join(parts))
    if b.waiting:
        by_seq: Dict[int, List[int]] = {}
        for r, seq in sorted(b.waiting.items()):
            by_seq.setdefault(seq, []).append(r)
        waits = []
        for seq, ranks in sorted(by_seq.items()):
            entry = _default_group(dumps[ranks[0]]).get(seq)
            op = f" ({describe_entry(entry)})" if entry else ""
            waits.append(f"{ranks_phrase(ranks)} waited in collective #{seq}{op}")
        msg += f"; {'; '.join(waits)}, which {ranks_phrase(b.busy)} had not issued yet"
    finished = [r for r in sorted(dumps) if r not in running]
    if finished:
        msg += f"; {ranks_phrase(finished)} had finished the job"
    if unresponsive:
        msg += f"; {ranks_phrase(unresponsive)} did not answer the dump request"
    if suspected:
        msg += f". A deadlock was suspected but not confirmed before the deadline ({suspected})"
    return msg + (". Nothing proves the busy rank(s) stuck for good: a slow target needs a longer timeout")


def _last_entry(d: RankDump) -> Optional[str]:
    entries = [e for e in (d.flight_recorder or {}).get("entries", []) if e.get("collective_seq_id", -1) >= 0]
    if not entries:
        return None
    e = max(entries, key=lambda e: (e.get("record_id", 0)))
    return f"#{e.get('collective_seq_id')} {describe_entry(e)}"


#: the rank's own thread that answers the parent's probes (``rank._serve_dumps``): never the target's
DIAGNOSIS_THREAD = "dpfsdp-diagnosis"
_FRAME_FILE = re.compile(r'^\s*File "([^"]+)", line')


def format_stacks(dumps: Dict[int, RankDump], full: bool = False) -> str:
    """Every rank's threads, for the report: without the harness's own frames (rank loop, zygote,
    runpy: ``frames.is_harness_frame``) and its diagnosis thread, unless ``full``."""
    out = []
    for r in sorted(dumps):
        for thread, frames in dumps[r].stacks.items():
            if thread == DIAGNOSIS_THREAD and not full:
                continue
            kept = [f for f in frames if full or not _harness_entry(f)]
            out.append(f"--- rank {r} (pid {dumps[r].pid}), thread {thread} ---"
                       + ("" if full or len(kept) == len(frames) else
                          f" ({len(frames) - len(kept)} harness frame(s) left out)"))
            out.append("".join(kept).rstrip())
    return "\n".join(out)


def _harness_entry(entry: str) -> bool:
    m = _FRAME_FILE.match(entry)
    return m is not None and is_harness_frame(m.group(1))


def _analyser_layout(fr: dict, rank: int, world_size: Optional[int] = None) -> dict:
    """A rank's trace as torch's analyser expects it. gloo traces of torch 2.13 (prototype) key
    ``pg_config`` by an empty name while their entries name the group (``('0', 'default_pg')``),
    and carry no ``rank``; the analyser then fails with ``KeyError: ('0', 0)``. Re-key the config
    by the names the entries use."""
    fr = dict(fr)
    fr["rank"] = rank
    first_pg: Dict[str, Any] = next(iter(fr.get("pg_config", {}).values()), {})
    ranks = first_pg.get("ranks")
    if ranks in (None, "[]", []) and world_size:
        # a process group created after an aborted one (``Renew``) is recorded with no ranks;
        # its entries are all in the default group, whose members are every rank
        ranks = str(list(range(world_size)))
    names = {tuple(e["process_group"]) for e in fr.get("entries", []) if e.get("process_group")}
    if ranks is not None and names:
        fr["pg_config"] = {name: {"name": name, "desc": desc, "ranks": ranks} for name, desc in names}
    return fr


def write_fr_dumps(dumps: Dict[int, RankDump], directory: str, prefix: str = "rank_",
                   world_size: Optional[int] = None) -> List[str]:
    """Save each rank's flight-recorder trace as ``DIR/<prefix><rank>`` (pickle), in the layout
    ``python -m torch.distributed.flight_recorder.fr_trace -p rank_ DIR`` reads. Returns the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for r, d in dumps.items():
        if d.flight_recorder is None:
            continue
        path = os.path.join(directory, f"{prefix}{r}")
        with open(path, "wb") as f:
            pickle.dump(_analyser_layout(d.flight_recorder, r, world_size), f)
        paths.append(path)
    return paths


def torch_analysis(dumps: Dict[int, RankDump], world_size: Optional[int] = None) -> Optional[str]:
    """What torch's own flight-recorder analyser (``fr_trace``) says about these traces, or
    ``None`` when it is unavailable or has nothing to compare (fewer than two traces)."""
    if sum(d.flight_recorder is not None for d in dumps.values()) < 2:
        return None
    buf = io.StringIO()
    try:
        from torch.distributed.flight_recorder.components.fr_logger import FlightRecorderLogger
    except ImportError:
        return None
    # The analyser talks through the "Flight Recorder" logger (INFO lines such as "Not all ranks
    # joining collective ...", a "tabulate is not installed" warning at import) and print(). Its
    # finding belongs in the hang report, not on the gate's or pytest's terminal: while it runs,
    # the logger writes only to ``buf`` (its own stderr handler swapped out, no propagation to the
    # root logger, where pytest's log capture would show it again), and so do stdout and stderr.
    logger = FlightRecorderLogger().logger  # creating it installs its own stderr handler
    saved = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [logging.StreamHandler(buf)], False
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                from torch.distributed.flight_recorder.fr_trace import main as fr_trace  # logs at import
            except ImportError:
                return None
            with tempfile.TemporaryDirectory(prefix="dpfsdp-fr-") as tmp:
                write_fr_dumps(dumps, tmp, world_size=world_size)
                fr_trace([tmp, "-p", "rank_", "--allow-incomplete-ranks"])
    except BaseException as e:  # an analyser failure must never cost the verdict
        buf.write(f"(torch's analyser failed: {type(e).__name__}: {e})")
    finally:
        logger.handlers, logger.propagate = saved
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip() and "tabulate is not installed" not in ln]
    return "\n".join(lines) if lines else None


__all__ = ["Divergence", "describe_entry", "entries_by_group", "find_divergence", "call_site", "user_call_site",
           "describe_divergence", "hang_report", "DEFAULT_PG", "Busy", "busy_ranks", "timeout_message", "format_stacks",
           "write_fr_dumps", "torch_analysis"]

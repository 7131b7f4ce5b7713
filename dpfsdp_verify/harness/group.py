"""The parent side of a worker group: launch N ranks, ship jobs, watch deadlines, tear down.

A ``WorkerGroup`` starts ``world_size`` rank processes (``rank.py``; forked from a pool's zygote
or spawned: ``launch.py``), each in its own session
(so SIGTERM/SIGKILL of its process group reaches any grandchildren), rendezvousing through a
``torch.distributed.FileStore`` in a private temp dir: no port to collide on under ``pytest -n``.
``run()`` ships one job to every rank and waits on the ranks' result channels *and* their process
sentinels, so:

* every rank returns      -> ``ok`` (or ``error`` when some rank raised; the group stays warm);
* a rank raises and others are still running after ``ERROR_GRACE_S`` -> ``error`` / ``rank_crash``,
  the survivors' stacks are attached, the group is ended at once (they would wait forever);
* a rank process dies     -> ``error`` / ``rank_crash`` with exit code or signal and stderr tail;
* the ranks' probes prove a deadlock (``proof.py``: a rank waits in a collective a finished
  peer never issued, or ranks issued different collectives under one sequence id, and nothing
  changed for ``proof.QUIET_S``) -> the same as a passed deadline, at once: ``hang`` /
  ``deadlock``, "deadlock proven after X s";
* the caller's ``evidence`` (the gate: the ranks' progress trails) proves the ranks' step or pass
  counts diverged, and nothing changed for ``proof.QUIET_S`` -> ``hang`` / ``step_divergence``,
  "step divergence proven after X s" (``proof.py``: what that claims, and why it is sound
  although the flight recorder may show none of the ranks' collectives);
* the deadline passes with nothing proven -> dump every rank (stacks + flight recorder), end the
  group: ``hang`` / ``timeout``, naming the rank(s) busy outside collectives, their call site, the
  time since their last progress and the collective the others waited in
  (``diagnose.timeout_message``). No proof means no claim of a deadlock: a slow rank looks the
  same until it comes back. After a *proven* deadlock the group
  is kept instead when it can be freed: every rank aborts its process group (the blocked
  collectives raise), creates a fresh one and is ready again within ``RECOVER_TIMEOUT_S``
  (``GroupResult.recovered``); otherwise it is ended as after a deadline.
* the wait is interrupted (KeyboardInterrupt, pytest-timeout...) -> the group is ended and the
  exception propagates.

Ending a group is SIGTERM to each rank's process group, ``KILL_GRACE_S`` later SIGKILL, then
``waitpid``; the temp dir (store file, logs) is removed. ``close()`` is idempotent.

This module decides what happened; the sentences that say it (a verdict's ``message`` and
``details``) are pure functions in ``wording.py`` and ``diagnose.py``.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

from . import diagnose, wording
from .backends import get_backend
from .launch import Forker, RankProcess, local_world_size, node_env, rank_env, rank_threads, start_rank  # noqa: F401 (re-exported)
from .proof import PROBE_AFTER_S, PROBE_EVERY_S, DeadlockWatch, Evidence
from .protocol import (Abort, Dump, DumpRequest, Job, JobError, JobResult, Probe, ProbeRequest, RankConfig,
                       RankDump, Ready, Renew, Result, Stop, recv, send)

#: After a rank raises, how long the others get to finish before the group is ended.
ERROR_GRACE_S = 1.0
#: How long ranks get to answer a dump request.
DUMP_TIMEOUT_S = 2.0
#: Between SIGTERM and SIGKILL ("SIGTERM is not aggressive enough to terminate processes
#: hanging in collectives" -- Lightning; we try it first so ranks can flush stderr).
KILL_GRACE_S = 0.5
#: After a proven deadlock, how long the ranks get to abort their process group, leave the job and
#: create a fresh group before the group is ended instead.
RECOVER_TIMEOUT_S = 3.0
#: The process-group timeout inside ranks: far beyond any deadline, the watchdog decides.
PG_TIMEOUT_S = 3600.0


class BackendUnavailable(RuntimeError):
    """The backend cannot give this many ranks here (e.g. NCCL without enough GPUs).
    Callers turn it into a *skip* with this message as the reason."""


class NotRunHere(BackendUnavailable):
    """This launcher cannot run the job at all (e.g. a torchrun job asked for another world size,
    or for fresh rank processes). Its text is the whole reason ("not run at this size: ..."), so
    callers show it as is instead of prefixing "backend unavailable"."""


class GroupStartError(RuntimeError):
    """Ranks could not be started (import error in a rank, rendezvous failure...)."""


class JobPicklingError(TypeError):
    """The job function or its arguments cannot be sent to the ranks (a config mistake)."""


@dataclass
class GroupResult:
    """The outcome of one job on one group.

    ``status``: ``ok`` | ``error`` | ``hang``; ``diagnosis``: ``None`` | ``rank_crash`` |
    ``deadlock`` (proven, ``proof.py``) | ``step_divergence`` (the caller's evidence proved the
    ranks' counts diverged while they were stalled, ``proof.py``) | ``timeout`` (the deadline
    passed unproven); ``message``: one paragraph naming the rank(s) and what happened; ``details``:
    the multi-line report (stacks, collective trace comparison) for a full log.
    """

    status: str
    world_size: int
    backend: str
    results: Dict[int, JobResult] = field(default_factory=dict)
    diagnosis: Optional[str] = None
    message: str = ""
    details: str = ""
    seconds: float = 0.0
    fr_dump_paths: List[str] = field(default_factory=list)
    #: a proven deadlock whose ranks were freed (process group aborted and renewed): the group
    #: stays warm instead of being restarted
    recovered: bool = False
    #: a hang's wall-clock time (``time.time()``) when the watchdog gave up: what the progress
    #: trails' times are told against
    fired_at: Optional[float] = None
    #: a ``timeout``'s ranks busy outside collectives (``diagnose.busy_ranks``)
    busy_ranks: List[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def values(self) -> List[Any]:
        """Each rank's return value, by rank. Raises ``JobFailed`` unless ``ok``."""
        if not self.ok:
            raise JobFailed(self)
        return [self.results[r].value for r in range(self.world_size)]

    def failed_ranks(self) -> List[int]:
        return sorted(r for r, res in self.results.items() if not res.ok)


class JobFailed(RuntimeError):
    def __init__(self, result: GroupResult):
        super().__init__(f"[{result.status}] {result.message}")
        self.result = result


@dataclass
class _JobWait:
    """Where the wait for one job stands (``WorkerGroup._run``'s steps share it)."""

    job_id: int
    t0: float
    deadline: float
    #: when the next probe round is due
    next_probe: float
    sentinels: Dict[int, int]                 # pidfd -> rank
    diag_rank: Dict[Connection, int]          # diagnosis channel -> rank
    watch: Optional[DeadlockWatch]            # None at one rank: nothing to prove
    results: Dict[int, JobResult] = field(default_factory=dict)
    crashed: Dict[int, int] = field(default_factory=dict)  # rank -> exit code or -signal
    #: when the first rank's job raised (the others then get ``ERROR_GRACE_S``)
    first_error: Optional[float] = None
    #: the proof's sentence once a deadlock is proven
    proven: Optional[str] = None
    #: ranks whose answer to the current probe round is outstanding
    probing: set = field(default_factory=set)
    #: the caller's evidence of the ranks' progress (``proof.Evidence``), read with each probe round
    evidence: Optional[Evidence] = None


def check_backend(backend: str, world_size: int) -> None:
    """Return if ``backend`` can give ``world_size`` ranks here (see ``backends.BACKENDS``); raise
    ``BackendUnavailable`` (a skip, with the reason) or ``ValueError`` (a config mistake) before
    any process is started."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    reason = get_backend(backend).unavailable(world_size)
    if reason:
        raise BackendUnavailable(reason)


class WorkerGroup:
    """``world_size`` initialised ranks that run jobs one at a time (see module docstring)."""

    def __init__(self, world_size: int, backend: str = "gloo", env: Optional[Dict[str, str]] = None,
                 start_timeout: float = 120.0, preload: Sequence[str] = (), wait_ready: bool = True,
                 zygotes: Optional[Forker] = None, rank_threads: int = 1):
        """Start the ranks. ``preload``: modules each rank imports before it is ready (what the
        jobs of a group this one replaces had imported, so its first job does not pay for them).
        ``wait_ready=False`` returns once the processes are started; the first ``run`` (or
        ``ensure_ready``) waits for them. ``zygotes``: fork the ranks from these (a pool's,
        ``zygote.py``) unless the group has an ``env`` of its own; else (or when they cannot)
        each rank is a new interpreter. Raises ``BackendUnavailable`` / ``ValueError`` before
        anything starts, ``GroupStartError`` when the ranks cannot start. ``rank_threads``: each
        rank's intra-op threads unless ``OMP_NUM_THREADS`` is set (``launch.rank_threads``)."""
        check_backend(backend, world_size)
        self.world_size, self.backend = world_size, backend
        self.rank_threads = rank_threads
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        self.zygotes = None if self.env else zygotes
        self.procs: List[RankProcess] = []
        self.pidfds: List[int] = []
        self.job_conns: List[Connection] = []
        self.diag_conns: List[Connection] = []
        self.tmpdir: Optional[str] = None
        self.closed = False
        self.preload = list(preload)
        #: modules the jobs imported on the ranks (from their probes and results): a
        #: replacement group preloads them
        self.job_modules: List[str] = []
        self._ready = False
        self._job_id = 0
        self._start()
        if wait_ready:
            self.ensure_ready()

    def ensure_ready(self) -> None:
        """Wait until every rank is ready (no-op when it already is). Raises ``GroupStartError``
        (the group is then closed)."""
        if self._ready:
            return
        try:
            self._await_ready()
        except BaseException:
            self.close(polite=False)
            raise
        self._ready = True

    # -- launch ------------------------------------------------------------------------
    def _start(self) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="dpfsdp-group-")
        store = os.path.join(self.tmpdir, "store")
        env = rank_env(self.env)
        threads = rank_threads(self.env, self.rank_threads)
        try:
            for r in range(self.world_size):
                env.update(node_env(r, self.world_size))
                parent_job, child_job = socket.socketpair()
                parent_diag, child_diag = socket.socketpair()
                cfg = RankConfig(rank=r, world_size=self.world_size, backend=self.backend, store_path=store,
                                 job_fd=child_job.fileno(), diag_fd=child_diag.fileno(), parent_pid=os.getpid(),
                                 pg_timeout_s=PG_TIMEOUT_S, preload=self.preload, threads=threads)
                with open(os.path.join(self.tmpdir, f"rank{r}.log"), "wb") as log:
                    proc = start_rank(cfg, env, log.fileno(), self.zygotes)
                child_job.close()
                child_diag.close()
                self.procs.append(proc)
                # a pidfd becomes readable when the process exits: waitable next to the channels
                self.pidfds.append(proc.pidfd)
                self.job_conns.append(Connection(parent_job.detach()))
                self.diag_conns.append(Connection(parent_diag.detach()))
        except BaseException:
            self.close()
            raise

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        waiting = set(range(self.world_size))
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise GroupStartError(f"ranks {sorted(waiting)} not ready after {self.start_timeout:.0f} s\n"
                                      + self._logs_tail())
            sentinels = {fd: r for r, fd in enumerate(self.pidfds)}
            ready = wait([self.job_conns[r] for r in waiting] + list(sentinels), timeout=left)
            for obj in ready:
                if obj in sentinels:
                    r = sentinels[obj]
                    raise GroupStartError(f"rank {r} exited during start-up "
                                          f"({wording.exit_text(self.procs[r].poll())})\n" + self._logs_tail())
                r = self.job_conns.index(cast(Connection, obj))  # not a sentinel: a job connection
                msg = recv(obj)
                if not isinstance(msg, Ready):
                    raise GroupStartError(f"rank {r} sent {msg!r} instead of Ready")
                waiting.discard(r)

    # -- jobs --------------------------------------------------------------------------
    def run(self, fn: Callable, args: tuple = (), kwargs: Optional[dict] = None, timeout: float = 60.0,
            evidence: Optional[Evidence] = None) -> GroupResult:
        """Run ``fn(*args, **kwargs)`` on every rank; returns a ``GroupResult``. Never blocks past
        ``timeout`` + ~3 s; a deadlock the ranks' probes prove (see ``proof.py``) ends it sooner,
        and so does a divergence ``evidence`` proves (``proof.Evidence``: read in this process
        with each probe round, e.g. ``targets.progress.watch`` over the job's trail directory).

        Raises ``JobPicklingError`` if the job cannot be sent (nothing is run then). Anything that
        interrupts the wait (KeyboardInterrupt, pytest-timeout's exception, any BaseException)
        ends the group before it propagates: the ranks may still be in the job, and a group
        left so would hand its stale result to the next job.
        """
        if self.closed:
            raise RuntimeError("worker group is closed")
        self.ensure_ready()
        try:
            payload = pickle.dumps((fn, args, kwargs or {}))
        except Exception as e:
            raise JobPicklingError(f"cannot send job {getattr(fn, '__qualname__', fn)!r} to the ranks: {e}. "
                                   "Job functions must be importable module-level functions with picklable "
                                   "arguments.") from e
        self._job_id += 1
        try:
            return self._run(payload, timeout, evidence)
        except BaseException:
            self.close(polite=False)
            raise

    def _run(self, payload: bytes, timeout: float, evidence: Optional[Evidence] = None) -> GroupResult:
        """Ship the job, wait round by round until every rank answered, one crashed, a deadlock
        (or a divergence) is proven or the deadline (or an error's grace) passes; then conclude."""
        w = self._send_job(payload, timeout)
        w.evidence = evidence
        while len(w.results) < self.world_size and not w.crashed:
            if not self._wait_round(w):
                break
        self._drain_probes(w.probing)
        return self._conclude(w, timeout)

    def _send_job(self, payload: bytes, timeout: float) -> "_JobWait":
        t0 = time.monotonic()
        for c in self.job_conns:
            try:
                send(c, Job(self._job_id, payload))
            except OSError:
                pass  # a rank that died since its last job: its sentinel says how
        return _JobWait(job_id=self._job_id, t0=t0, deadline=t0 + timeout, next_probe=t0 + PROBE_AFTER_S,
                        sentinels={fd: r for r, fd in enumerate(self.pidfds)},
                        diag_rank={c: r for r, c in enumerate(self.diag_conns)},
                        watch=DeadlockWatch(self.world_size, self._job_id) if self.world_size > 1 else None)

    def _wait_round(self, w: "_JobWait") -> bool:
        """One wait on the ranks' channels and sentinels (probing when due); False when the wait
        is over: the deadline (or an error's grace) passed, or a deadlock is proven."""
        now = time.monotonic()
        until = w.deadline if w.first_error is None else min(w.deadline, w.first_error + ERROR_GRACE_S)
        if until - now <= 0:
            return False
        if w.watch is not None and w.first_error is None and not w.probing and now >= w.next_probe:
            w.probing = self._send_probes(w.job_id)
            w.next_probe = now + PROBE_EVERY_S
        wake = until if w.probing or w.watch is None else min(until, w.next_probe)
        pending = [self.job_conns[r] for r in range(self.world_size) if r not in w.results]
        probes = [self.diag_conns[r] for r in w.probing]
        for obj in wait(pending + list(w.sentinels) + probes, timeout=max(0.0, wake - now)):
            self._take(w, obj)
        if w.watch is not None and not w.probing and w.first_error is None and not w.crashed:
            w.proven = w.watch.check(set(w.results), time.monotonic(), w.evidence)
            if w.proven:
                return False
        return True

    def _take(self, w: "_JobWait", obj) -> None:
        """Read what one ready channel or sentinel says into ``w``."""
        if obj in w.sentinels:
            r = w.sentinels[obj]
            if r not in w.results:
                w.crashed[r] = self.procs[r].wait()
            return
        if obj in w.diag_rank:
            r = w.diag_rank[obj]
            w.probing.discard(r)
            try:
                msg = recv(obj)
            except (EOFError, OSError):
                return  # the rank is dying: its sentinel says how
            if isinstance(msg, Probe):
                cast(DeadlockWatch, w.watch).update(msg, time.monotonic())  # probes are asked only with a watch
                self._note_modules(msg.modules)
            return
        r = self.job_conns.index(obj)
        try:
            msg = recv(obj)
        except (EOFError, OSError):
            w.crashed[r] = self.procs[r].wait()
            return
        if not isinstance(msg, Result) or msg.job_id != w.job_id:
            return  # never another job's result
        w.results[r] = msg.result
        self._note_modules(msg.result.modules)
        if not msg.result.ok and w.first_error is None:
            w.first_error = time.monotonic()

    def _conclude(self, w: "_JobWait", timeout: float) -> GroupResult:
        """The verdict of a finished wait: a crash, an error with ranks left waiting, a hang, an
        error, or ok."""
        running = [r for r in range(self.world_size) if r not in w.results and r not in w.crashed]
        out = GroupResult(status="ok", world_size=self.world_size, backend=self.backend, results=w.results)
        if w.crashed:
            self._finish_crash(out, w.crashed, running)
        elif running and w.first_error is not None:
            self._finish_error_with_stuck(out, running)
        elif running:
            now = time.monotonic()
            unproven: Dict[str, Any] = {} if w.proven or w.watch is None else dict(idle_for=w.watch.idle_for(now),
                                                                    suspected=w.watch.candidate(set(w.results)))
            kind = w.watch.proof_kind if w.proven and w.watch is not None else None
            self._finish_hang(out, running, timeout, proven=w.proven, after=now - w.t0, kind=kind, **unproven)
        elif any(not res.ok for res in w.results.values()):
            self._finish_raised(out)
        if any(res.dirty for res in w.results.values()):
            self.close()
        out.seconds = time.monotonic() - w.t0
        return out

    def _recover(self, running: List[int]) -> bool:
        """Abort every rank's process group (``Abort``), collect the stuck ranks' results of the
        aborted job, have every rank create a fresh group (``Renew``) and wait for ``Ready``.
        Returns True when every rank is ready within ``RECOVER_TIMEOUT_S``; False otherwise (the
        caller then ends the group)."""
        self._generation = getattr(self, "_generation", 0) + 1
        try:
            for c in self.diag_conns:
                send(c, Abort())
            for c in self.job_conns:
                send(c, Renew(self._generation))
        except OSError:
            return False
        waiting = set(range(self.world_size))
        sentinels = set(self.pidfds)
        deadline = time.monotonic() + RECOVER_TIMEOUT_S
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for obj in wait([self.job_conns[r] for r in waiting] + list(sentinels), timeout=left):
                if obj in sentinels:
                    return False  # a rank died: nothing to keep
                try:
                    msg = recv(obj)
                except (EOFError, OSError):
                    return False
                if isinstance(msg, Ready):
                    waiting.discard(self.job_conns.index(cast(Connection, obj)))
                # a Result here is the aborted job's: its error is the abort's, not news
        return True

    def _note_modules(self, names: List[str]) -> None:
        if names and len(names) > len(self.job_modules):
            self.job_modules = list(names)

    def _send_probes(self, job_id: int) -> set:
        """Ask every rank for a ``Probe``; returns the ranks asked."""
        asked = set()
        for r, c in enumerate(self.diag_conns):
            try:
                send(c, ProbeRequest(job_id))
                asked.add(r)
            except OSError:
                pass
        return asked

    def _drain_probes(self, probing: set) -> None:
        """Read the answers to a probe round still in flight, so that the next message on a
        diagnosis channel is the answer to the next request (ranks answer within milliseconds;
        one that does not is in trouble, and its group is being ended anyway)."""
        conns = {self.diag_conns[r]: r for r in probing}
        deadline = time.monotonic() + DUMP_TIMEOUT_S
        while conns and time.monotonic() < deadline:
            for c in wait(list(conns), timeout=max(0.0, deadline - time.monotonic())):
                conns.pop(c)
                try:
                    recv(c)
                except (EOFError, OSError):
                    pass

    # -- verdicts ----------------------------------------------------------------------
    def _finish_raised(self, out: GroupResult) -> None:
        out.status, out.diagnosis = "error", "rank_crash"
        # a failed rank's result carries its error
        out.message, out.details = wording.raised({r: cast(JobError, out.results[r].error) for r in out.failed_ranks()})

    def _finish_error_with_stuck(self, out: GroupResult, running: List[int]) -> None:
        self._finish_raised(out)
        dumps, unresponsive = self.dump(running)
        out.message += wording.left_waiting(running, ERROR_GRACE_S)
        out.details += wording.where_others_were(dumps, running, unresponsive)
        self.close(polite=False)

    def _finish_crash(self, out: GroupResult, crashed: Dict[int, int], running: List[int]) -> None:
        dumps, unresponsive = self.dump(running) if running else ({}, [])
        logs = self._logs_tail(sorted(crashed))
        out.status, out.diagnosis = "error", "rank_crash"
        out.message = wording.crashed(crashed, running)
        out.details = logs + (wording.where_others_were(dumps, running, unresponsive) if dumps else "")
        self.close(polite=False)

    def _finish_hang(self, out: GroupResult, running: List[int], timeout: float, proven: Optional[str] = None,
                     after: float = 0.0, idle_for: Optional[Dict[int, Tuple[float, bool]]] = None,
                     suspected: Optional[str] = None, kind: Optional[str] = None) -> None:
        out.fired_at = time.time()
        dumps, unresponsive = self.dump(list(range(self.world_size)))
        report = diagnose.hang_report(dumps, running, unresponsive, proven=kind == "deadlock")
        out.status = "hang"
        if proven and kind == "step_divergence":
            out.diagnosis = "step_divergence"
            out.message, head = wording.diverged(dumps, running, proven, after, timeout)
            report = head + report
        elif proven:
            out.diagnosis = "deadlock"
            out.message, head = wording.deadlock(dumps, running, proven, after, timeout)
            report = head + report
        else:
            out.diagnosis = "timeout"
            out.busy_ranks = diagnose.busy_ranks(dumps, running).busy
            out.message = diagnose.timeout_message(dumps, running, unresponsive, timeout, idle_for, suspected)
        out.details = wording.hang_details(report, diagnose.torch_analysis(dumps, self.world_size), dumps)
        keep = os.environ.get("DPFSDP_VERIFY_FR_DIR")
        if keep:
            out.fr_dump_paths = diagnose.write_fr_dumps(dumps, os.path.join(keep, f"job{self._job_id}-{os.getpid()}"),
                                                        world_size=self.world_size)
        # a proven deadlock has every stuck rank blocked in a collective: aborting the process
        # group frees them, and the warm ranks are kept (no restart). A deadline hang may have a
        # rank stuck anywhere: end the group.
        if proven and self._recover(running):
            out.recovered = True
            out.details += wording.RECOVERED
        else:
            self.close(polite=False)

    # -- diagnosis ---------------------------------------------------------------------
    def dump(self, ranks: List[int]):
        """``({rank: RankDump}, [unresponsive ranks])`` within ``DUMP_TIMEOUT_S``."""
        asked = {}
        for r in ranks:
            try:
                send(self.diag_conns[r], DumpRequest())
                asked[self.diag_conns[r]] = r
            except OSError:
                pass
        dumps: Dict[int, RankDump] = {}
        deadline = time.monotonic() + DUMP_TIMEOUT_S
        while asked and time.monotonic() < deadline:
            for c in cast(List[Connection], wait(list(asked), timeout=max(0.0, deadline - time.monotonic()))):
                try:
                    msg = recv(c)
                except (EOFError, OSError):
                    asked.pop(c)
                    continue
                if isinstance(msg, Dump):  # a late Probe answer is skipped; keep waiting
                    dumps[asked.pop(c)] = msg.dump
        return dumps, sorted(set(ranks) - set(dumps))

    def _logs_tail(self, ranks: Optional[List[int]] = None, limit: int = 2000) -> str:
        out = []
        for r in ranks if ranks is not None else range(len(self.procs)):
            path = os.path.join(self.tmpdir or "", f"rank{r}.log")
            try:
                with open(path, "rb") as f:
                    text = f.read()[-limit:].decode(errors="replace").strip()
            except OSError:
                continue
            if text:
                out.append(f"--- rank {r} output (tail) ---\n{text}")
        return "\n".join(out)

    # -- teardown ----------------------------------------------------------------------
    def pids(self) -> List[int]:
        return [p.pid for p in self.procs]

    def close(self, polite: bool = True) -> None:
        """Stop politely if healthy, else SIGTERM -> SIGKILL each rank's process group; reap; clean."""
        if self.closed:
            return
        self.closed = True
        if polite:
            for c in self.job_conns:
                try:
                    send(c, Stop())
                except OSError:
                    pass
            _wait_all(self.procs, 2.0)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in self.procs if p.poll() is None]
            if not alive:
                break
            for p in alive:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            _wait_all(alive, KILL_GRACE_S if sig == signal.SIGTERM else 5.0)
        for p in self.procs:
            # grandchildren a job left in the rank's session
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for c in self.job_conns + self.diag_conns:
            c.close()
        for fd in self.pidfds:
            os.close(fd)
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _wait_all(procs: List[RankProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


__all__ = ["ERROR_GRACE_S", "DUMP_TIMEOUT_S", "KILL_GRACE_S", "RECOVER_TIMEOUT_S", "PG_TIMEOUT_S",
           "BackendUnavailable", "NotRunHere", "GroupStartError", "JobPicklingError", "GroupResult", "JobFailed",
           "check_backend", "WorkerGroup"]

"""A torchrun job's own ranks as a pool: ``TorchrunPool`` has ``Pool``'s interface (``run``,
``fresh_group``, ``close``), so the gate's runner drives it as it drives spawned worker groups
(``gate/torchrun_job.py`` is the gate's side: rank 0 runs the gate on this pool).

A job (``run_many_on_rank`` and the specs of a case) is not shipped to a spawned ``WorkerGroup``
but posted in the job's key-value store (the TCPStore torchrun's rendezvous made) and run by
*every* rank of the job, rank 0 included, on the job's process group (``TorchrunSession``,
``torchrun.py``). The other ranks only serve jobs (``serve``). So the properties, their judges
and the reports are the spawned gate's, and the DP checks run on the real group at the job's
world size (16 or 64 ranks across nodes, where a release is trained).

What keeps a bad case from hanging the job (as in the pytest plugin's torchrun mode, ``torchrun.py``):

* Outcomes travel through the store, never a collective: a rank posts its ``JobResult`` (and its
  progress trail) under a per-job key; rank 0 waits for every rank's with a bound.
* The process group's timeout is the case's deadline (``_set_pg_timeout`` per job): a rank left
  waiting in a collective its peers never issue raises at the deadline, not after torch's 30 min.
* A deadline watchdog on every rank: at the deadline a rank still in the job has an exception
  raised in its main thread (``PyThreadState_SetAsyncExc``), which ends a Python loop outside any
  collective; its call site is kept for the verdict.
* After a failed job every rank creates a fresh process group on a new store prefix
  (``TorchrunSession.renew_group``): a rank whose collective timed out consumed a sequence number
  its peers did not.
* The verdict is the spawned gate's: ``hang`` / ``deadlock`` when proven (a rank finished the job
  while the others waited in a collective: it will never issue theirs), ``hang`` / ``timeout``
  otherwise (naming the ranks busy outside collectives and where), ``error`` / ``rank_crash`` when
  a rank raised. A rank that never reports (stuck where the watchdog cannot reach, e.g. one long
  ``time.sleep``) ends its case as ``hang`` / ``timeout``; the group cannot be renewed without it,
  so later cases are reported as not run, naming it, and it exits with the job when rank 0 ends it.
* Rank 0 posts the exit code at the end (also on a usage error or a crash); every rank exits with
  it.

What a torchrun job cannot run is reported, one line each, never dropped: a case at another world
size ("not run at this size") and a case that needs fresh rank processes (``Case.fresh_groups``).
"""

from __future__ import annotations

import ctypes
import io
import os
import pickle
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, cast

from . import diagnose
from .frames import frames_of
from .group import GroupResult, NotRunHere, WorkerGroup
from .protocol import JobError, JobResult
from .rank import current_entries, dump_state, forget_aborted_entries
from .torchrun import REPORT_GRACE_S, TorchrunSession, is_pg_timeout
from .rank_groups import grouped, ranks_phrase, were

#: the store keys of the gate's protocol start so (the plugin's torchrun mode uses dpfsdp/outcome/, dpfsdp/pg<n>)
PREFIX = "dpfsdp/gate/"
#: how often a waiting rank wakes up (a short store wait, so a watchdog thread may use the store)
POLL_S = 2.0
#: how long rank 0 waits, at the end, for the other ranks to take the exit code
BYE_S = 10.0
#: how long rank 0 waits for every rank to prepare (load the target) before the first job
PREPARE_S = 600.0
#: after the last bye, how long rank 0 waits before it exits (the ranks' own exits)
BYE_EXIT_S = 1.0


class JobDeadline(Exception):
    """Raised in a rank's main thread by its watchdog when the job ran past its deadline."""


# -- rank 0: the pool the gate's runner drives ------------------------------------------------
class TorchrunPool:
    """``Pool``'s interface (``run``, ``fresh_group``, ``close``) on the job's own ranks."""

    def __init__(self, session: TorchrunSession, on_job: Optional[Callable] = None):
        """``on_job(job, args, trail_dir)``: called on rank 0 just before it runs its share of each
        job (``args``: the job function's positional arguments; ``trail_dir``: where rank 0's own
        progress trail of the job is written, ``None`` without one), then ``on_job(None, None,
        None)`` once the job's outcome is in: the gate keeps its report on disk as it would be if
        the job ended the torchrun job (``gate/journal.py``)."""
        self.session = session
        self.world_size = session.world_size
        self.job = 0
        self.renew_next = False
        #: set once a rank never reported: no further job can run (see module docstring)
        self.broken: Optional[str] = None
        self.on_job = on_job

    def run(self, fn: Callable, *args, world_size: int = 2, backend: str = "gloo",
            env: Optional[Dict[str, str]] = None, timeout: float = 60.0, evidence=None, **kwargs) -> GroupResult:
        """``Pool.run`` on the job's ranks. ``evidence`` is not read: there are no probes while a job
        runs here (its trails come to rank 0 with the outcomes, and are judged after the job)."""
        if world_size != self.world_size:
            raise NotRunHere(f"not run at this size: needs world_size={world_size}; this torchrun job has "
                             f"{self.world_size} ranks")
        if backend != self.session.backend:
            raise NotRunHere(f"not run: needs backend {backend!r}; this torchrun job's process group is "
                             f"{self.session.backend!r}")
        if self.broken:
            raise NotRunHere(f"not run: {self.broken}")
        self.job += 1
        msg = {"kind": "job", "payload": pickle.dumps((fn, args, kwargs)), "deadline": float(timeout),
               "env": dict(env or {}), "renew": self.renew_next}
        t0 = time.monotonic()
        self.session.store.set(f"{PREFIX}job/{self.job}", pickle.dumps(msg))  # type: ignore[arg-type]  # torch's stub says str; the store takes bytes
        if self.renew_next:  # after the message: creating the group waits for every rank to join
            self.renew_next = False
            _renew(self.session)
        trail_dir = tempfile.mkdtemp(prefix="dpfsdp-progress-") if kwargs.get("progress_dir") else None
        if self.on_job is not None:
            self.on_job(self.job, args, trail_dir)
        try:
            mine = _execute(self.session, self.job, msg, trail_dir)
            # a rank's collective that began just before the deadline times out one deadline later
            outcomes = self._collect(self.job, t0 + 2 * timeout + REPORT_GRACE_S, mine)
        finally:
            if self.on_job is not None:
                self.on_job(None, None, None)
        res = _group_result(outcomes, self.world_size, self.session.backend, timeout)
        res.seconds = time.monotonic() - t0
        progress_dir = kwargs.get("progress_dir")
        if progress_dir:  # the trails as the runner reads them from a spawned group
            for r, o in outcomes.items():
                if o is not None and o.get("trail") is not None:
                    with open(os.path.join(progress_dir, f"rank{r}.progress"), "w") as f:
                        f.write(o["trail"])
        silent = sorted(r for r, o in outcomes.items() if o is None)
        if silent:
            self.broken = (f"{ranks_phrase(silent)} of this torchrun job never reported the outcome of an earlier job "
                           "(died, or stuck outside any collective); its process group cannot be renewed without "
                           "them")
        elif not res.ok or any(cast(dict, o)["result"].dirty for o in outcomes.values()):  # none silent
            self.renew_next = True  # every rank renews its group on the next job's message
        return res

    def _collect(self, job: int, until: float, mine: dict) -> Dict[int, Optional[dict]]:
        store = self.session.store
        out: Dict[int, Optional[dict]] = {0: mine}
        for r in range(1, self.world_size):
            key = f"{PREFIX}res/{job}/{r}"
            out[r] = None
            while True:
                left = until - time.monotonic()
                try:
                    store.wait([key], timedelta(seconds=max(0.1, min(POLL_S, left))))
                    out[r] = pickle.loads(store.get(key))
                    store.delete_key(key)
                    break
                except Exception:  # the store's timeout
                    if left <= POLL_S:
                        break
        return out

    def prepare(self, load: Callable, *args, timeout: float = PREPARE_S) -> None:
        """Every rank runs ``load(*args)`` (e.g. ``targets.load_target``: imports opacus, the
        adapter...) and FSDP's lazy imports before the first job, outside any deadline: a spawned
        group's ranks import torch before they are ready, and a case's deadline is for the case,
        not for a rank's first import on a loaded node."""
        self.job += 1
        payload = pickle.dumps((load, args))
        self.session.store.set(f"{PREFIX}job/{self.job}", pickle.dumps({"kind": "prepare", "payload": payload}))  # type: ignore[arg-type]  # torch's stub says str; the store takes bytes
        _prepare(payload)
        until = time.monotonic() + timeout
        for r in range(1, self.world_size):
            key = f"{PREFIX}res/{self.job}/{r}"
            try:
                self.session.store.wait([key], timedelta(seconds=max(0.1, until - time.monotonic())))
                self.session.store.delete_key(key)
            except Exception:  # a rank that is not ready: its first job names it
                pass

    def fresh_group(self, world_size: int, backend: str = "gloo", env: Optional[Dict[str, str]] = None
                    ) -> WorkerGroup:
        raise NotRunHere("not run in a torchrun job: needs fresh rank processes (each run the first thing its "
                         "processes do), which only the spawning launcher starts; run this property without "
                         "--launcher torchrun")

    def side_lane(self, name: str = "side") -> None:
        """None: the job's ranks run one job at a time (``JobPool.side_lane``)."""
        return None

    def prestart(self, world_size: int, backend: str = "gloo", env: Optional[Dict[str, str]] = None,
                 preload: Sequence[str] = ()) -> bool:
        """False: the job's ranks are the torchrun job's own, started by torchrun (``JobPool.prestart``)."""
        return False

    def stop(self, code: int) -> None:
        """Tell every rank the run is over and its exit code; wait (briefly) until they took it."""
        store = self.session.store
        self.job += 1
        try:
            store.set(f"{PREFIX}job/{self.job}", pickle.dumps({"kind": "stop", "code": int(code)}))  # type: ignore[arg-type]  # torch's stub says str; the store takes bytes
            store.set(f"{PREFIX}stop", str(int(code)))
            deadline = time.monotonic() + BYE_S
            for r in range(1, self.world_size):
                store.wait([f"{PREFIX}bye/{r}"], timedelta(seconds=max(0.1, deadline - time.monotonic())))
            time.sleep(BYE_EXIT_S)  # a rank exits just after its bye
        except Exception:  # a rank that never takes it is stuck: it exits with the job
            pass

    def close(self) -> None:
        pass


# -- every rank: run one job -----------------------------------------------------------------
def serve(session: TorchrunSession) -> int:
    """A rank other than 0: run rank 0's jobs until it posts the exit code; return that."""
    store = session.store
    job = 0
    while True:
        job += 1
        key = f"{PREFIX}job/{job}"
        while True:
            try:
                store.wait([key], timedelta(seconds=POLL_S))
                break
            except Exception:  # the store's timeout: keep waiting (rank 0 is planning or judging)
                continue
        msg = pickle.loads(store.get(key))
        if msg["kind"] == "stop":
            return int(msg["code"])
        if msg["kind"] == "prepare":
            _prepare(msg["payload"])
            store.set(f"{PREFIX}res/{job}/{session.rank}", b"ready")  # type: ignore[arg-type]  # torch's stub says str; the store takes bytes
            continue
        if msg.get("renew"):
            _renew(session)
        out = _execute(session, job, msg)
        store.set(f"{PREFIX}res/{job}/{session.rank}", pickle.dumps(out))  # type: ignore[arg-type]  # torch's stub says str; the store takes bytes


#: what a target's first FSDP step imports lazily (seconds on a loaded node): imported before the
#: first deadline
WARM_MODULES = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp")


def _prepare(payload: bytes) -> None:
    """Import what the jobs will (FSDP's lazy imports, then ``TorchrunPool.prepare``'s ``load``:
    the target); a failure is left to the first job, which reports it on every rank."""
    import importlib

    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    try:
        load, args = pickle.loads(payload)
        load(*args)
    except Exception:
        pass


def leave(session: TorchrunSession, code: int) -> None:
    """A serving rank's end: close its process group, say it took the exit code, exit with it.
    The bye is said only now: rank 0 exits once every rank has, so the launcher sees one exit code."""
    session.close()
    session.store.set(f"{PREFIX}bye/{session.rank}", "1")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Running:
    """The job this rank's main thread is in (``None`` between jobs), under a lock shared with
    the watchdog, so the watchdog never raises into the main thread outside a job."""

    def __init__(self):
        self.lock = threading.Lock()
        self.job: Optional[int] = None
        self.site: Optional[str] = None  # where the main thread was when the deadline passed
        self.in_collective = False
        self.dump = None  # the rank's RankDump at the deadline


def _execute(session: TorchrunSession, job: int, msg: dict, trail_dir: Optional[str] = None) -> dict:
    """Run the job on this rank under its deadline; ``{"result": JobResult, "trail", "overran",
    "site", "in_collective"}``. ``trail_dir``: the directory for this rank's progress trail, when
    the job keeps one (made here if not given; removed here). The rank's process-wide state
    (environment, RNGs, default dtype, grad mode) is as before afterwards: on rank 0 the gate's own
    code runs between jobs."""
    import torch
    import torch.distributed as dist

    deadline = msg["deadline"]
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=deadline), None)
    saved = _save_state()
    os.environ.update(msg["env"])
    random.seed(0)  # every job starts from the spawned ranks' seeds (harness.rank.JOB_SEED)
    torch.manual_seed(0)
    fn, args, kwargs = pickle.loads(msg["payload"])
    if kwargs.get("progress_dir"):
        trail_dir = trail_dir or tempfile.mkdtemp(prefix="dpfsdp-progress-")
        kwargs = dict(kwargs, progress_dir=trail_dir)
    running = _Running()
    watchdog = threading.Thread(target=_watch, args=(session, running, job, deadline), daemon=True,
                                name="dpfsdp-deadline")
    out_buf, err_buf = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    try:
        with running.lock:
            running.job = job
        watchdog.start()
        stdout, stderr = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = out_buf, err_buf
        try:
            try:
                value = fn(*args, **kwargs)
            finally:
                with running.lock:
                    running.job = None
            pickle.dumps(value)
            result = JobResult(rank=session.rank, value=value)
        finally:
            sys.stdout, sys.stderr = stdout, stderr
    except BaseException as e:  # noqa: B902 - a job's failure, incl. the watchdog's JobDeadline
        with running.lock:
            running.job = None
        if isinstance(e, KeyboardInterrupt):
            raise
        result = JobResult(rank=session.rank, error=JobError(type(e).__name__, str(e), traceback.format_exc(),
                                                                     frames_of(e.__traceback__)))
    result.seconds = time.perf_counter() - t0
    result.stdout, result.stderr = out_buf.getvalue()[-65536:], err_buf.getvalue()[-65536:]
    result.dirty = not dist.is_initialized()
    trail = None
    if trail_dir:
        try:
            with open(os.path.join(trail_dir, f"rank{session.rank}.progress")) as f:
                trail = f.read()
        except OSError:
            pass
        shutil.rmtree(trail_dir, ignore_errors=True)
    _restore_state(saved)
    newest = _newest_collectives() if result.ok else {}
    return {"result": result, "newest": newest, "trail": trail, "overran": running.site is not None,
            "site": running.site,
            "in_collective": running.in_collective, "dump": running.dump,
            "pg_timeout": result.error is not None and is_pg_timeout(Exception(result.error.message))}


def _renew(session: TorchrunSession) -> None:
    """A fresh process group (``TorchrunSession.renew_group``); flight-recorder entries of the
    old one are left out of later dumps (the new group restarts its sequence ids)."""
    session.renew_group()
    forget_aborted_entries()


def _watch(session: TorchrunSession, running: _Running, job: int, deadline: float) -> None:
    """At the deadline, end the job on this rank if it is still in it (see module docstring);
    a rank the exception cannot reach (blocked in C code that never returns) exits when rank 0
    posts the exit code."""
    t_end = time.monotonic() + deadline
    while time.monotonic() < t_end:
        time.sleep(min(0.2, max(0.0, t_end - time.monotonic())))
        if running.job != job:
            return
    main = cast(int, threading.main_thread().ident)  # a started thread has an ident
    while True:
        with running.lock:
            if running.job != job:
                return
            frame = sys._current_frames().get(main)
            stack = traceback.extract_stack(frame) if frame is not None else []
            # never interrupt an import: a module left half-initialised breaks every later job
            if not any("importlib._bootstrap" in fs.filename for fs in stack):
                break
        time.sleep(0.05)
    with running.lock:
        if running.job != job:
            return
        innermost = stack[-1] if stack else None
        running.in_collective = bool(innermost and "torch/distributed" in innermost.filename.replace(os.sep, "/"))
        running.site = diagnose.user_call_site([(fs.filename, fs.lineno, fs.name) for fs in stack])
        try:
            running.dump = dump_state(session.rank)  # stacks + the flight recorder's collectives
        except Exception:
            running.dump = None
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main), ctypes.py_object(JobDeadline))
    # a collective the main thread waits in raises within one more deadline (the process-group
    # timeout); past that, only the end of the run frees this rank
    while running.job == job:
        time.sleep(1.0)
        if session.rank == 0:
            if time.monotonic() > t_end + deadline + 2 * REPORT_GRACE_S:
                sys.stderr.write(f"dpfsdp-verify: rank 0 is stuck outside any collective at {running.site} and "
                                 "cannot be freed; ending the torchrun job without reports\n")
                sys.stderr.flush()
                try:
                    session.store.set(f"{PREFIX}stop", "1")
                except Exception:
                    pass
                os._exit(1)
            continue
        try:
            if session.store.check([f"{PREFIX}stop"]):
                os._exit(int(session.store.get(f"{PREFIX}stop")))
        except Exception:
            pass


def _proof(outcomes: Dict[int, Optional[dict]], finished: List[int]) -> Optional[str]:
    """Why the job can never finish, from the flight-recorder traces the ranks took at the
    deadline -- the spawning gate's two proofs (``harness.proof``) -- or ``None``. A rank that
    is merely slow (computing, sleeping) proves nothing: its peers wait in a collective it has not
    issued *yet*."""
    dumps = {r: o["dump"] for r, o in outcomes.items() if o is not None and o.get("dump") is not None}
    div = diagnose.find_divergence(dumps) if len(dumps) >= 2 else None
    if div is not None and len({d.split(" ")[0] for d in div.issued.values()}) > 1:
        # two ranks issued different collectives under one sequence id: neither can complete
        return diagnose.describe_divergence(div)
    for r, d in sorted(dumps.items()):
        mine = diagnose.entries_by_group(d.flight_recorder)
        for p in finished:
            theirs = cast(dict, outcomes[p]).get("newest") or {}  # a finished rank reported
            for group, seqs in mine.items():
                if seqs and group in theirs and max(seqs) > theirs[group]:
                    entry = diagnose.describe_entry(seqs[max(seqs)])
                    return (f"rank {r} waits in collective #{max(seqs)} ({entry}) of process group {group}, which "
                            f"rank {p} never issues: it finished the job after #{theirs[group]}")
    return None


def _newest_collectives() -> Dict[str, int]:
    """This rank's newest collective sequence id per process group (the flight recorder's),
    recorded when it finishes a job: what a peer stuck at the deadline is compared with."""
    try:
        import torch

        fr = current_entries(pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False)))  # type: ignore[attr-defined]  # private, absent from torch's stubs
        return {g: max(seqs) for g, seqs in diagnose.entries_by_group(fr).items() if seqs}
    except Exception:
        return {}


def _save_state() -> tuple:
    import torch

    np_state = sys.modules["numpy"].random.get_state() if "numpy" in sys.modules else None
    return (dict(os.environ), random.getstate(), torch.get_rng_state(), np_state, torch.get_default_dtype(),
            torch.is_grad_enabled())


def _restore_state(saved: tuple) -> None:
    import torch

    env, py_state, torch_state, np_state, dtype, grad = saved
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    random.setstate(py_state)
    torch.set_rng_state(torch_state)
    if np_state is not None:
        sys.modules["numpy"].random.set_state(np_state)
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)


# -- rank 0: the outcomes as the spawned group's GroupResult ----------------------------------
def _group_result(outcomes: Dict[int, Optional[dict]], world_size: int, backend: str,
                  deadline: float) -> GroupResult:
    """Every rank's outcome of one job as a ``GroupResult`` (the runner turns it into the case's
    verdict exactly as for a spawned group)."""
    results = {r: o["result"] for r, o in outcomes.items() if o is not None}
    out = GroupResult(status="ok", world_size=world_size, backend=backend, results=results)
    silent = sorted(r for r, o in outcomes.items() if o is None)
    if not silent and all(res.ok for res in results.values()):
        return out
    finished = sorted(r for r, res in results.items() if res.ok)
    waited = sorted(r for r, o in outcomes.items() if o is not None and not o["result"].ok
                    and (o["pg_timeout"] or (o["overran"] and o["in_collective"])))
    busy = sorted(r for r, o in outcomes.items() if o is not None and not o["result"].ok and o["overran"]
                  and not o["in_collective"] and r not in waited)
    raised = sorted(r for r, o in outcomes.items() if o is not None and not o["result"].ok
                    and r not in waited and r not in busy)
    out.details = "\n".join(f"--- rank {r} traceback ---\n{results[r].error.traceback}"
                            for r in sorted(results) if not results[r].ok)
    wait_text = (f"{ranks_phrase(waited)} {were(waited)} left waiting in a collective until the {deadline:g} s "
                 "process-group timeout" if waited else "")
    silent_text = (f"{ranks_phrase(silent)} never reported within {2 * deadline + REPORT_GRACE_S:g} s (the process "
                   "died -- "
                   "e.g. gloo aborted it -- or is stuck where the deadline cannot reach, e.g. a long sleep)"
                   if silent else "")
    if raised:  # a rank raised on its own: the others waited for it
        first = results[raised[0]].error
        out.status, out.diagnosis = "error", "rank_crash"
        out.message = "; ".join(p for p in (
            f"rank {raised[0]} raised {first.type}: {first.message}"
            + (f" ({ranks_phrase(raised)} all raised)" if len(raised) > 1 else ""), silent_text, wait_text) if p)
        return out
    out.status = "hang"
    out.fired_at = time.time()
    proof = _proof(outcomes, finished)
    if proof is not None:
        stuck = sorted(r for r, o in outcomes.items() if o is not None and not o["result"].ok)
        out.diagnosis = "deadlock"
        out.message = (f"deadlock proven at the {deadline:g} s deadline: {ranks_phrase(stuck)} can never finish "
                       f"({proof})")
        sites = grouped({r: f"at {cast(dict, outcomes[r])['site']}" for r in stuck if cast(dict, outcomes[r])["site"]})
        if sites:
            out.message += f" ({sites})"
        dumps = {r: o["dump"] for r, o in outcomes.items() if o is not None and o.get("dump") is not None}
        out.details = diagnose.format_stacks(dumps) + "\n" + out.details
        return out
    out.diagnosis = "timeout"
    out.busy_ranks = busy + silent
    busy_at = grouped({r: f"at {cast(dict, outcomes[r])['site']}" for r in busy},
                      between=lambda ranks: f" {were(ranks)} busy outside any collective at the {deadline:g} s "
                                            "deadline, ")
    parts = [busy_at] if busy else []
    if silent:
        parts.append(silent_text)
    if wait_text:
        parts.append(wait_text)
    if finished:
        parts.append(f"{ranks_phrase(finished)} finished the job")
    out.message = "; ".join(parts) or f"the job did not finish within its {deadline:g} s deadline"
    return out


__all__ = ["TorchrunPool", "serve", "leave", "JobDeadline", "PREFIX"]

"""The rank side of a worker group: bootstrap, run jobs one at a time, answer dump requests.

Started by ``group.WorkerGroup`` as ``python -m dpfsdp_verify.harness.rank '<RankConfig JSON>'``, or
forked by a zygote that runs this module as ``__main__`` with the same argument (``zygote.py``).
See ``protocol.py`` for the messages. Between jobs the rank restores what a job may have changed
(environment variables, RNG seeds, default dtype, grad mode) so that state does not leak from one
job to the next on a warm group.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import io
import os
import pickle
import random
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Union

from .backends import get_backend, simulate_accelerator_from_env
from .frames import frames_of
from .protocol import (Abort, Dump, DumpRequest, Job, JobError, JobResult, Probe, ProbeRequest, RankConfig,
                       RankDump, Ready, Renew, Result, Stop, recv, send)

#: Every job starts from these seeds on every rank.
JOB_SEED = 0
#: Most output a job's result carries back per stream (the tail is kept).
CAPTURE_LIMIT = 64 * 1024

#: The job the main thread is running (``None`` between jobs). Set before a job starts, cleared
#: only after its ``Result`` is sent, so a probe that reads ``None`` proves the result is on its
#: way to the parent. Written by the main thread, read by the diagnosis thread (a plain
#: attribute read/write is atomic under the GIL).
_current_job = None
#: The newest job whose ``Result`` was sent (0: none yet).
_last_done = 0
#: Whether dumps carry the recorder's per-entry C++/Python stack traces. The first such dump in a
#: process costs ~1.8 s of CPU (symbolizer start-up; measured on torch 2.13 + gloo, 2 cores) --
#: paid at every group start, or at every verdict -- while the report's call sites come from the
#: ranks' own Python stacks. Kept only when the raw traces are kept for a human
#: (DPFSDP_VERIFY_FR_DIR).
_FR_STACKS = bool(os.environ.get("DPFSDP_VERIFY_FR_DIR"))
#: A folder where each job's CPU profile is written (cProfile, ``process_time``; one
#: ``PID-NS.prof`` per job): ``benchmarks/gate_profile.py`` sets it to say where the ranks' CPU goes.
PROFILE_DIR_ENV = "DPFSDP_VERIFY_PROFILE_DIR"
#: Flight-recorder entries up to this ``record_id`` belong to a process group that was aborted
#: and renewed (the new group reuses its name and restarts its sequence ids): probes and dumps
#: leave them out.
_fr_floor = -1
#: Flight-recorder entries per process group a probe carries (the newest).
PROBE_ENTRIES = 16
#: Modules loaded when the rank became ready; see ``installed_modules``.
_startup_modules: frozenset = frozenset()
_installed_cache: tuple = (0, [])


def installed_modules() -> list:
    """Modules of installed packages (site-packages) imported since the rank became ready, by
    name: what a replacement group preloads so that its first job does not import them again.
    Test modules and the project's own sources are left out (they are imported by the job, e.g.
    with pytest's assertion rewriting)."""
    global _installed_cache
    n = len(sys.modules)
    if n == _installed_cache[0]:
        return _installed_cache[1]
    out = []
    for name, mod in list(sys.modules.items()):
        if name in _startup_modules:
            continue
        path = getattr(mod, "__file__", None) or ""
        if ("site-packages" + os.sep) in path or ("dist-packages" + os.sep) in path:
            out.append(name)
    _installed_cache = (n, out)
    return out


def _preload(names) -> None:
    """Import ``names`` (a failing one is skipped: the job will meet the error itself)."""
    for name in names:
        try:
            importlib.import_module(name)
        except (Exception, SystemExit):
            pass


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL us when the parent dies (Linux); exit now if it already has."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the channel-EOF check below still ends us
    if os.getppid() != parent_pid:
        os._exit(0)


def _frames_of(frame) -> list:
    out = []
    for fs in traceback.extract_stack(frame):
        out.append((fs.filename, fs.lineno, fs.name))
    return out


def current_entries(fr: dict) -> dict:
    """The trace without the entries of process groups aborted before (see ``_fr_floor``)."""
    if _fr_floor >= 0 and fr.get("entries"):
        fr = dict(fr)
        fr["entries"] = [e for e in fr["entries"] if e.get("record_id", 0) > _fr_floor]
    return fr


def forget_aborted_entries() -> None:
    """Leave every flight-recorder entry recorded so far out of later probes and dumps (see
    ``_fr_floor``): called when a process group is aborted and renewed."""
    global _fr_floor
    try:
        import torch

        entries = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False)).get("entries", [])  # type: ignore[attr-defined]  # private, absent from torch's stubs
        _fr_floor = max((e.get("record_id", 0) for e in entries), default=_fr_floor)
    except Exception:
        pass


def dump_state(rank: int) -> RankDump:
    """Stacks of every thread and the flight-recorder trace of this process."""
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks, main_frames = {}, []
    me = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        stacks[names.get(ident, str(ident))] = traceback.format_stack(frame)
        if ident == threading.main_thread().ident:
            main_frames = _frames_of(frame)
    dump = RankDump(rank=rank, pid=os.getpid(), stacks=stacks, main_frames=main_frames)
    try:
        import torch

        raw = torch._C._distributed_c10d._dump_fr_trace(True, _FR_STACKS)  # type: ignore[attr-defined]  # private, absent from torch's stubs
        dump.flight_recorder = current_entries(pickle.loads(raw))
    except Exception as e:  # older torch, or recorder off: degrade to stacks only
        dump.flight_recorder_error = f"{type(e).__name__}: {e}"
    return dump


def probe_state(rank: int, job_id: int) -> Probe:
    """The cheap answer to ``ProbeRequest``: job state and the newest flight-recorder entries per
    process group. No stacks: the recorder is dumped without its per-entry stack traces."""
    # read the job state BEFORE the trace: a rank seen "done" cannot have issued anything after
    probe = Probe(rank=rank, job_id=job_id, running=_current_job, done=_last_done, modules=installed_modules())
    try:
        import torch

        fr = current_entries(pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False)))  # type: ignore[attr-defined]  # private, absent from torch's stubs
    except Exception as err:  # recorder off or older torch: the parent then waits for the deadline
        probe.error = f"{type(err).__name__}: {err}"
        return probe
    for e in fr.get("entries", []):
        seq = e.get("collective_seq_id", -1)
        if seq is None or seq < 0 or e.get("is_p2p", False):
            continue
        pg = e.get("process_group")
        key = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(pg)
        probe.recent.setdefault(key, {})[seq] = (str(e.get("profiling_name", "?")), str(e.get("input_sizes")))
    for key, seqs in probe.recent.items():  # keep the message small: the newest few per group
        if len(seqs) > PROBE_ENTRIES:
            probe.recent[key] = {s: seqs[s] for s in sorted(seqs)[-PROBE_ENTRIES:]}
    return probe


def _serve_dumps(conn: Connection, rank: int, backend: str) -> None:
    reply: Union[Probe, Dump]
    while True:
        try:
            msg = recv(conn)
        except (EOFError, OSError):
            os._exit(0)  # parent gone
        if isinstance(msg, ProbeRequest):
            try:
                reply = probe_state(rank, msg.job_id)
            except Exception:
                reply = Probe(rank=rank, job_id=msg.job_id, running=_current_job, done=_last_done,
                              error=traceback.format_exc())
        elif isinstance(msg, Abort):
            try:
                get_backend(backend).free_blocked()
            except Exception:  # the parent's timeout then ends the group
                pass
            continue
        elif isinstance(msg, DumpRequest):
            try:
                reply = Dump(dump_state(rank))
            except Exception:  # never leave the parent waiting: say what went wrong
                reply = Dump(RankDump(rank=rank, pid=os.getpid(),
                                      flight_recorder_error=f"dump failed: {traceback.format_exc()}"))
        else:
            continue
        try:
            send(conn, reply)
        except Exception:
            os._exit(0)


def own_groups() -> int:
    """How many process groups besides the default one this rank holds (a job's ``new_group``, a
    ``DeviceMesh`` of its own); -1 where this torch does not say."""
    from torch.distributed import distributed_c10d as c10d

    names = getattr(getattr(c10d, "_world", None), "pg_names", None)
    return -1 if names is None else max(0, len(names) - 1)


def _renew_group(cfg: RankConfig, store, generation: int) -> None:
    """A fresh default process group after an abort, on its own store prefix (the aborted
    group's keys must not be read by the new one's rendezvous); its flight-recorder entries are
    told apart from the aborted group's by ``_fr_floor``.

    Not where the aborted job made process groups of its own: torch keeps meshes on them in caches
    keyed by a mesh's layout, not its groups (DTensor's sharding propagation hands a later job's
    gradients the cached mesh), so a renewed rank fails its next FSDP job with "Could not resolve
    the process group registered under the name 1" (measured: torch 2.13, a specimen sharding on a
    group of its own, then upstream at the same world size). Such a rank exits: its parent sees
    it die and ends the group, and the pool starts a fresh one (tests/harness/test_blind_divergence.py)."""
    import torch.distributed as dist

    if dist.is_initialized() and own_groups() != 0:
        os._exit(0)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    forget_aborted_entries()
    dist.init_process_group(cfg.backend, store=dist.PrefixStore(f"renew{generation}/", store), rank=cfg.rank,
                            world_size=cfg.world_size, timeout=timedelta(seconds=cfg.pg_timeout_s))
    dist.barrier()


def _reset_job_state(env_snapshot: dict, cpu_only: bool) -> None:
    import torch

    if os.environ != env_snapshot:
        os.environ.clear()
        os.environ.update(env_snapshot)
    random.seed(JOB_SEED)
    if cpu_only:  # a gloo rank computes on the CPU: its generator is all a job draws from
        torch.default_generator.manual_seed(JOB_SEED)  # torch.manual_seed: + a formatted stack per device
    else:
        torch.manual_seed(JOB_SEED)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(JOB_SEED)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    # a target's setup may ask for deterministic algorithms (fixtures.release_specimens:
    # CorrectDeterministicAlgorithms): the next job starts with torch's default again (the setter
    # costs ~0.5 ms, the queries ~0.1 us: set only when changed)
    if torch.are_deterministic_algorithms_enabled() or torch.is_deterministic_algorithms_warn_only_enabled():
        torch.use_deterministic_algorithms(False)


class _Tee(io.TextIOBase):
    """Writes go to the rank's log (the crash-report tail reads it) and to a per-job buffer
    (returned with the job's result, shown beside a failing test)."""

    def __init__(self, stream):
        self.stream, self.buffer_ = stream, io.StringIO()

    def write(self, text):
        self.buffer_.write(text)
        try:
            return self.stream.write(text)
        except (OSError, ValueError):
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def isatty(self):
        return False

    def fileno(self):  # code that writes to the fd directly still reaches the log
        return self.stream.fileno()

    def captured(self) -> str:
        text = self.buffer_.getvalue()
        return text[-CAPTURE_LIMIT:]


def _run_job(rank: int, payload: bytes) -> JobResult:
    """Run one job; returns its ``JobResult`` (value or error, seconds, captured stdout/stderr)."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    out, err = _Tee(sys.stdout), _Tee(sys.stderr)
    sys.stdout, sys.stderr = out, err
    try:
        fn, args, kwargs = pickle.loads(payload)
        value = _call(fn, args, kwargs)
        pickle.dumps(value)  # fail here, with a traceback, rather than in conn.send
        result = JobResult(rank=rank, value=value)
    except BaseException as e:  # a job's SystemExit/KeyboardInterrupt is a job failure too
        result = JobResult(rank=rank, error=JobError(type(e).__name__, str(e), traceback.format_exc(),
                                                     frames_of(e.__traceback__)))
    finally:
        sys.stdout, sys.stderr = out.stream, err.stream
        out.flush()
        err.flush()
    result.stdout, result.stderr = out.captured(), err.captured()
    result.modules = installed_modules()
    result.seconds = time.perf_counter() - t0
    result.dirty = not dist.is_initialized()
    return result


def _call(fn, args, kwargs):
    """``fn(*args, **kwargs)``, profiled into ``PROFILE_DIR_ENV``'s folder where it is set."""
    folder = os.environ.get(PROFILE_DIR_ENV)
    if not folder:
        return fn(*args, **kwargs)
    import cProfile

    prof = cProfile.Profile(time.process_time)
    try:
        return prof.runcall(fn, *args, **kwargs)
    finally:
        prof.dump_stats(os.path.join(folder, f"{os.getpid()}-{time.time_ns()}.prof"))


def main(argv=None) -> None:
    cfg = RankConfig.from_argv((argv or sys.argv)[1])
    _die_with_parent(cfg.parent_pid)
    job_conn = Connection(cfg.job_fd)
    diag_conn = Connection(cfg.diag_fd)
    threading.Thread(target=_serve_dumps, args=(diag_conn, cfg.rank, cfg.backend), name="dpfsdp-diagnosis",
                     daemon=True).start()

    import torch
    import torch.distributed as dist

    if cfg.threads:  # the pool's share of the cores (cores.py), set after a zygote's fork
        torch.set_num_threads(cfg.threads)
    simulate_accelerator_from_env()  # tests only (backends.SIMULATED_ACCELERATOR_ENV)
    store, env_snapshot = _join_group(cfg)
    send(job_conn, Ready(cfg.rank, os.getpid()))
    _serve_jobs(cfg, job_conn, store, env_snapshot)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(0)


def _join_group(cfg: RankConfig):
    """Create the process group, warm up and preload; returns ``(store, environment snapshot)``."""
    import torch.distributed as dist

    get_backend(cfg.backend).setup_rank(cfg.rank)
    store = dist.FileStore(cfg.store_path, cfg.world_size)
    dist.init_process_group(cfg.backend, store=store, rank=cfg.rank, world_size=cfg.world_size,
                            timeout=timedelta(seconds=cfg.pg_timeout_s))
    dist.barrier()
    if _FR_STACKS:
        # warm the dump path so a dump during a hang answers at once (see _FR_STACKS)
        dump_state(cfg.rank)
    global _startup_modules
    _startup_modules = frozenset(sys.modules)
    _preload(cfg.preload)
    env_snapshot = dict(os.environ)
    gc.collect()
    gc.freeze()
    return store, env_snapshot


def _serve_jobs(cfg: RankConfig, job_conn: Connection, store, env_snapshot: dict) -> None:
    """Run jobs (and renew the process group when asked) until ``Stop``; exit at once when the
    parent's channel closes."""
    global _current_job, _last_done
    cpu_only = get_backend(cfg.backend).device_type == "cpu"
    while True:
        try:
            msg = recv(job_conn)
        except (EOFError, OSError):
            os._exit(0)
        if isinstance(msg, Stop):
            break
        if isinstance(msg, Renew):
            try:
                _renew_group(cfg, store, msg.generation)
            except Exception:  # the parent times out waiting for Ready and ends the group
                traceback.print_exc()
                continue
            send(job_conn, Ready(cfg.rank, os.getpid()))
            continue
        if not isinstance(msg, Job):
            continue
        _reset_job_state(env_snapshot, cpu_only)
        _current_job = msg.job_id
        result = _run_job(cfg.rank, msg.payload)
        try:
            send(job_conn, Result(msg.job_id, result))
        except Exception as e:  # e.g. an unpicklable exception object
            send(job_conn, Result(msg.job_id, JobResult(
                rank=cfg.rank, error=JobError(type(e).__name__, f"could not send result: {e}", ""),
                seconds=result.seconds, dirty=True)))
        _last_done = msg.job_id  # before clearing _current_job: a probe never sees neither
        _current_job = None
        # Free the job's cycles (FSDP modules, hooks) off the critical path, then freeze what
        # survives (modules the job imported, e.g. opacus): a full collect over them took
        # 100-200 ms per job; frozen, the next collect scans only the next job's objects.
        gc.collect()
        gc.freeze()


if __name__ == "__main__":
    main()


__all__ = ["JOB_SEED", "CAPTURE_LIMIT", "PROFILE_DIR_ENV", "own_groups", "PROBE_ENTRIES", "installed_modules",
           "current_entries", "forget_aborted_entries", "dump_state", "probe_state", "main"]

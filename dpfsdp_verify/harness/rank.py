"""The rank side of a worker group: bootstrap, run jobs one at a time, answer dump requests.

Started by ``group.WorkerGroup`` as ``python -m dpfsdp_verify.harness.rank '<RankConfig JSON>'``.
See ``protocol.py`` for the messages. Between jobs the rank restores what a job may have changed
(environment variables, RNG seeds, default dtype, grad mode) so that state does not leak from one
job to the next on a warm group.
"""

from __future__ import annotations

import ctypes
import gc
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

from .protocol import JobError, JobResult, RankConfig, RankDump, recv, send

#: Every job starts from these seeds on every rank.
JOB_SEED = 0


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

        raw = torch._C._distributed_c10d._dump_fr_trace()
        dump.flight_recorder = pickle.loads(raw)
    except Exception as e:  # older torch, or recorder off: degrade to stacks only
        dump.flight_recorder_error = f"{type(e).__name__}: {e}"
    return dump


def _serve_dumps(conn: Connection, rank: int) -> None:
    while True:
        try:
            msg = recv(conn)
        except (EOFError, OSError):
            os._exit(0)  # parent gone
        if msg[0] == "dump":
            try:
                dump = dump_state(rank)
            except Exception:  # never leave the parent waiting: say what went wrong
                dump = RankDump(rank=rank, pid=os.getpid(), flight_recorder_error=f"dump failed: {traceback.format_exc()}")
            try:
                send(conn, ("dump", dump))
            except Exception:
                os._exit(0)


def _reset_job_state(env_snapshot: dict) -> None:
    import torch

    if os.environ != env_snapshot:
        os.environ.clear()
        os.environ.update(env_snapshot)
    random.seed(JOB_SEED)
    torch.manual_seed(JOB_SEED)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(JOB_SEED)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)


def _run_job(rank: int, payload: bytes) -> JobResult:
    import torch.distributed as dist

    t0 = time.perf_counter()
    try:
        fn, args, kwargs = pickle.loads(payload)
        value = fn(*args, **kwargs)
        pickle.dumps(value)  # fail here, with a traceback, rather than in conn.send
        result = JobResult(rank=rank, value=value)
    except BaseException as e:  # a job's SystemExit/KeyboardInterrupt is a job failure too
        result = JobResult(rank=rank, error=JobError(type(e).__name__, str(e), traceback.format_exc()))
    result.seconds = time.perf_counter() - t0
    result.dirty = not dist.is_initialized()
    return result


def main(argv=None) -> None:
    cfg = RankConfig.from_argv((argv or sys.argv)[1])
    _die_with_parent(cfg.parent_pid)
    job_conn = Connection(cfg.job_fd)
    diag_conn = Connection(cfg.diag_fd)
    threading.Thread(target=_serve_dumps, args=(diag_conn, cfg.rank), name="dpfsdp-diagnosis",
                     daemon=True).start()

    import torch
    import torch.distributed as dist

    if cfg.backend == "nccl":
        torch.cuda.set_device(cfg.rank % torch.cuda.device_count())
    store = dist.FileStore(cfg.store_path, cfg.world_size)
    dist.init_process_group(cfg.backend, store=store, rank=cfg.rank, world_size=cfg.world_size,
                            timeout=timedelta(seconds=cfg.pg_timeout_s))
    # Warm the dump path so a dump during a hang answers at once: the recorder's first dump
    # after a recorded collective costs ~1 s (one-time init), measured on torch 2.13 + gloo.
    dist.barrier()
    dump_state(cfg.rank)
    env_snapshot = dict(os.environ)
    gc.collect()
    gc.freeze()
    send(job_conn, ("ready", cfg.rank, os.getpid()))
    while True:
        try:
            msg = recv(job_conn)
        except (EOFError, OSError):
            os._exit(0)
        if msg[0] == "stop":
            break
        _, job_id, payload = msg
        _reset_job_state(env_snapshot)
        result = _run_job(cfg.rank, payload)
        try:
            send(job_conn, ("result", job_id, result))
        except Exception as e:  # e.g. an unpicklable exception object
            send(job_conn, ("result", job_id, JobResult(
                rank=cfg.rank, error=JobError(type(e).__name__, f"could not send result: {e}", ""),
                seconds=result.seconds, dirty=True)))
        # Free the job's cycles (FSDP modules, hooks) off the critical path, then freeze what
        # survives (modules the job imported, e.g. opacus): a full collect over them took
        # 100-200 ms per job; frozen, the next collect scans only the next job's objects.
        gc.collect()
        gc.freeze()
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()

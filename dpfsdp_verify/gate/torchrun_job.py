"""The gate inside a torchrun job: ``torchrun ... -m dpfsdp_verify run --launcher torchrun ...``.

Every process of the job is a rank of one process group (the job's: gloo or NCCL, any number of
nodes). Rank 0 is the gate exactly as when it spawns its own ranks -- it plans, runs every
property through ``run.execute``, computes the float64 reference, judges and writes every report --
except that its pool is the harness' ``TorchrunPool`` (``harness/torchrun_pool.py``: how a job
reaches every rank, its deadline, and how a hang becomes a verdict); the other ranks only serve
its jobs and stay quiet. Every rank parses the same arguments (``RunPlan.parse``, torch-free): a
usage error there ends each rank alike (exit 2, rank 0 saying it) before any process group exists.
Past that, rank 0 posts the exit code at the end (also on a usage error in loading the target, or a
crash); every rank exits with it.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Tuple, cast

from ..errors import HintedError
from ..harness.torchrun import TorchrunSession, torchrun_env
from ..harness.torchrun_pool import TorchrunPool, leave, serve
from .plan import RunPlan, UsageError
from .report import EXIT_INTERNAL, EXIT_USAGE

#: a rank's output when it is not rank 0: kept only with this variable set (debugging a target)
RANK_OUTPUT_ENV = "DPFSDP_VERIFY_RANK_OUTPUT"


def torchrun_rank() -> Tuple[int, int]:
    """``(rank, world size)`` of this torchrun rank, made ready before its plan is parsed: the
    flight recorder on, its output silenced unless it is rank 0; ``UsageError`` when this process
    is not a torchrun rank."""
    env = torchrun_env()
    if env is None:
        raise UsageError("--launcher torchrun: this process is not a torchrun rank (RANK, WORLD_SIZE and LOCAL_RANK "
                         "are not set)", "launch it as 'torchrun --nproc-per-node N -m dpfsdp_verify run --launcher "
                         "torchrun ...', or drop --launcher torchrun to let the gate start its own ranks")
    rank, world_size = env
    # the flight recorder must be on before the process group exists (as in spawned ranks): a
    # rank's trace at the deadline shows which collective it waits in
    from ..harness.launch import FR_BUFFER_SIZE

    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FR_BUFFER_SIZE))
    if rank != 0 and not os.environ.get(RANK_OUTPUT_ENV):
        _silence()
    return rank, world_size


def run_torchrun(plan: RunPlan, rank: int) -> int:
    """``dpfsdp-verify run --launcher torchrun`` of a plan ``RunPlan.parse`` checked at the job's
    world size (every rank parses the same arguments; a usage error ends each rank alike, rank 0
    saying it): rank 0 runs the gate, the others serve its jobs; every rank returns rank 0's exit
    code."""
    world_size = cast(int, plan.job_world_size)
    session = TorchrunSession(rank, world_size, timeout=plan.options.timeout, backend=plan.options.backend)
    try:
        if rank != 0:
            leave(session, serve(session))
        pool = TorchrunPool(session)
        code = EXIT_INTERNAL
        # everything rank 0 says is said before the exit code is posted: once a rank exits non-zero,
        # torchrun's agent may end the other ranks of its node, rank 0 included
        try:
            # rank 0: the spawned gate's ``execute`` on ``pool``, every rank having loaded the target
            from ..targets import load_target
            from .journal import Journal
            from .run import execute

            loaded = plan.loaded()
            # the reports on disk as they must read should a rank process die (gloo's abort ends it
            # without a word, and torchrun's agent then ends rank 0 too): rewritten before every job,
            # with every case judged so far (the session's listener: a later job's crash loses none)
            journal = Journal(loaded, target={"name": loaded.options.target})
            pool.on_job = journal.on_job
            pool.prepare(load_target, loaded.options.target)
            try:
                code = execute(loaded, pool, where=f" -- in a torchrun job of {pool.world_size} ranks",
                               journal=journal)
            finally:
                pool.on_job = None
                journal.close()
        except HintedError as e:  # as cli.main says it, one line
            print(f"dpfsdp-verify: error: {e}" + (f" (hint: {e.hint})" if e.hint else ""), file=sys.stderr)
            code = EXIT_USAGE
        except Exception:
            traceback.print_exc()
            print("dpfsdp-verify: internal error (a bug in dpfsdp-verify, not a verdict on the target)",
                  file=sys.stderr)
            code = EXIT_INTERNAL
        finally:
            # torchrun itself exits 1 for any non-zero code of a rank: the gate's own is said here
            print(f"dpfsdp-verify: exit code {code} on every rank of this torchrun job", file=sys.stderr, flush=True)
            pool.stop(code)
        return code
    finally:
        session.close()


def _silence() -> None:
    """A rank other than 0 writes nothing (Python and C++ output alike): rank 0 reports."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


__all__ = ["torchrun_rank", "run_torchrun", "RANK_OUTPUT_ENV"]

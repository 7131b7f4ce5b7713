"""Distributed harness: worker groups of N ranks (gloo or NCCL), a watchdog that turns hangs and
crashes into verdicts with a diagnosis, and a warm pool.

Parent side: ``group.py`` (watchdog, teardown), ``launch.py`` and ``zygote.py`` (ranks forked
from warm zygotes, or spawned), ``proof.py`` (deadlocks proven from the
ranks' probes before the deadline), ``pool.py`` (warm groups; ``pools.py``: ``JobPool``, what every pool offers),
``diagnose.py`` (stacks +
flight-recorder comparison), ``wording.py`` (what a verdict says), ``rank_groups.py`` (ranks
told by state, as ranges). Rank side: ``rank.py``. The messages between them: ``protocol.py``. Both sides:
``backends.py`` (the backend table).

    from dpfsdp_verify.harness import run
    result = run(my_job, world_size=2, timeout=30)   # my_job runs on every rank
    result.status, result.diagnosis, result.message, result.values()
"""

from .group import (BackendUnavailable, GroupResult, GroupStartError, JobFailed, JobPicklingError,
                    NotRunHere, WorkerGroup, check_backend, local_world_size, node_env)
from .pool import DEFAULT_TIMEOUT_S, Pool, default_pool, pid_gone, wait_gone
from .pools import JobPool
from .protocol import JobError, JobResult


def run(fn, *args, world_size: int = 2, backend: str = "gloo", env=None, timeout: float = DEFAULT_TIMEOUT_S,
        **kwargs) -> GroupResult:
    """Run ``fn(*args, **kwargs)`` on every rank of a warm group from the default pool."""
    return default_pool().run(fn, *args, world_size=world_size, backend=backend, env=env, timeout=timeout, **kwargs)


__all__ = ["run", "Pool", "JobPool", "default_pool", "WorkerGroup", "GroupResult", "JobResult", "JobError", "JobFailed",
           "BackendUnavailable", "NotRunHere", "GroupStartError", "JobPicklingError", "check_backend",
           "DEFAULT_TIMEOUT_S", "pid_gone", "wait_gone", "local_world_size", "node_env"]

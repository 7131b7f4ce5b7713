"""How a worker group's rank processes are started: the environment every rank gets, and the two
ways to start one -- forked from a warm zygote (``zygote.py``: milliseconds) or spawned as
``python -m dpfsdp_verify.harness.rank`` (``subprocess.Popen``: an interpreter and ``import torch``,
~3 s of CPU per rank).

Either way the rank runs in its own session (SIGTERM/SIGKILL of its process group reaches any
grandchildren), writes its stdout and stderr to its log file, holds the two channel ends its
``RankConfig`` names and has the environment ``rank_env`` gives it. ``start_rank`` returns a
``RankProcess`` that ``group.WorkerGroup`` waits on and ends alike for both: ``pid``, a pidfd
(readable once the process has exited; waitable next to the channels), ``poll()`` and ``wait()``
with the exit code or ``-signal``, as ``subprocess.Popen`` gives them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, Optional, Protocol

from .protocol import RANK_MODULE, RankConfig

#: Flight-recorder ring buffer entries per rank (set before the process group is created). A
#: divergence is always among the newest entries; the buffer's size is what every probe pays to
#: dump it: ~1-7 ms at 256 entries vs ~90-130 ms at 2000 (torch 2.13, gloo, loaded 2-core box).
FR_BUFFER_SIZE = 256
#: Variables a harness group must not inherit from a torchrun job it runs inside.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def local_world_size(world_size: int) -> int:
    """Ranks per "node" of the layout a group of ``world_size`` ranks is given (``node_env``): one
    node at 1 and 2 ranks (a 2-GPU machine), nodes of 2 at an even world size >= 4, one rank per
    node at an odd world size >= 3 (torchrun gives every node the same number of ranks). From 3
    ranks on, ``LOCAL_RANK`` differs from ``RANK`` on some rank and repeats across nodes, so
    code that uses the local rank where the global one is meant (a noise or sampler seed) shows."""
    if world_size <= 2:
        return world_size
    return 2 if world_size % 2 == 0 else 1


def node_env(rank: int, world_size: int) -> Dict[str, str]:
    """The environment torchrun gives rank ``rank`` of ``world_size`` on the node layout of
    ``local_world_size``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``GROUP_RANK`` (the node's index), ``GROUP_WORLD_SIZE`` (nodes), ``ROLE_RANK``,
    ``ROLE_WORLD_SIZE``. The ranks still rendezvous through the group's store, not through these."""
    local = local_world_size(world_size)
    values = {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": rank % local, "LOCAL_WORLD_SIZE": local,
              "GROUP_RANK": rank // local, "GROUP_WORLD_SIZE": world_size // local, "ROLE_RANK": rank,
              "ROLE_WORLD_SIZE": world_size}
    return {k: str(v) for k, v in values.items()}


#: Every variable ``node_env`` sets: they differ from rank to rank, never between a zygote and its ranks.
NODE_VARS = tuple(node_env(0, 1))


def rank_env(group_env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of every rank of a group, before ``node_env``: this process's, the group's
    own variables, the flight recorder's buffer size and one OpenMP thread unless set, this
    process's ``sys.path`` as ``PYTHONPATH``, and no torchrun variables."""
    env = dict(os.environ)
    env.update(group_env or {})
    env.setdefault("TORCH_FR_BUFFER_SIZE", str(FR_BUFFER_SIZE))
    # as torchrun does: N ranks each spawning one thread per core oversubscribe a small
    # runner (measured ~5x slower per rank on 2 cores); a user's own setting wins
    env.setdefault("OMP_NUM_THREADS", "1")
    # ranks must import whatever the parent can (test modules, conftests, the target)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    for var in TORCHRUN_VARS:
        env.pop(var, None)  # a harness group inside a torchrun job must not pick those up
    return env


def rank_threads(group_env: Optional[Dict[str, str]], planned: int) -> int:
    """The torch intra-op threads a rank sets once it runs (``RankConfig.threads``): ``planned``
    (the pool's ``cores.CorePlan.rank_threads``) unless ``OMP_NUM_THREADS`` is the user's or the
    group's own (0: torch's from it). Not through ``OMP_NUM_THREADS``: with more than one thread,
    importing torch starts an OpenMP worker, and a zygote with a thread cannot fork ranks
    (``zygote._unsafe_to_fork``); a forked rank whose zygote never ran a parallel region starts its
    pool after the fork."""
    if "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in (group_env or {}):
        return 0
    return max(1, int(planned))


class RankProcess(Protocol):
    """What ``WorkerGroup`` needs of a started rank (``subprocess.Popen`` has it, but the pidfd)."""

    pid: int
    #: a pidfd of the process, owned by whoever holds this (``WorkerGroup.close`` closes it)
    pidfd: int

    def poll(self) -> Optional[int]: ...

    def wait(self, timeout: Optional[float] = None) -> int: ...


class SpawnedRank(subprocess.Popen):
    """A rank started as ``python -m dpfsdp_verify.harness.rank``."""

    pidfd: int


def spawn_rank(cfg: RankConfig, env: Dict[str, str], log_fd: int) -> SpawnedRank:
    """Start rank ``cfg.rank`` as a new interpreter (its channel ends: ``cfg.job_fd``, ``cfg.diag_fd``)."""
    proc = SpawnedRank([sys.executable, "-m", RANK_MODULE, cfg.to_argv()], env=env, stdin=subprocess.DEVNULL,
                       stdout=log_fd, stderr=subprocess.STDOUT, pass_fds=(cfg.job_fd, cfg.diag_fd),
                       start_new_session=True)
    proc.pidfd = os.pidfd_open(proc.pid)
    return proc


class Forker(Protocol):
    """What ``start_rank`` needs of a fork server (``zygote.Zygotes``; named here, not imported: the
    zygote module imports this one)."""

    def fork(self, cfg: RankConfig, env: Dict[str, str], log_fd: int) -> Optional[RankProcess]: ...


def start_rank(cfg: RankConfig, env: Dict[str, str], log_fd: int, zygotes: Optional[Forker]) -> RankProcess:
    """Rank ``cfg.rank``, forked by ``zygotes`` when they can fork it with exactly this environment
    (``Zygotes.fork`` says), else spawned. ``cfg.parent_pid`` is then the process the rank's
    parent-death signal follows (a forked rank's parent is its zygote)."""
    if zygotes is not None:
        forked = zygotes.fork(cfg, env, log_fd)
        if forked is not None:
            return forked
    return spawn_rank(cfg, env, log_fd)


__all__ = ["FR_BUFFER_SIZE", "TORCHRUN_VARS", "local_world_size", "node_env", "NODE_VARS", "rank_env", "RankProcess",
           "Forker", "SpawnedRank", "spawn_rank", "start_rank"]

"""A pool of warm worker groups, keyed by (world_size, backend, environment).

Starting a rank as a new interpreter costs seconds (``import torch`` + rendezvous); the pool forks
its ranks from zygotes instead (``zygote.py``: torch and opacus imported once per pool, a rank in
milliseconds + rendezvous); running a job on a warm group costs milliseconds. ``Pool.run`` ships a job to the group for
its key, starting one if
needed. A group that hung, crashed or was left dirty is ended by ``WorkerGroup.run`` itself; the
pool notices and starts a fresh one on the next job, so one bad job never skips the rest.
Jobs that need environment variables at process start (e.g. ``OPACUS_USE_DEFERRED_NORM``) get
their own group. At most ``max_groups`` groups are kept warm (least recently used is closed).
``reuse=False`` gives a fresh group per job (how ``mp.spawn``-style harnesses work; used by the
benchmark and for isolation); ``fresh_group`` gives one such group to a caller that runs it itself.

A proven deadlock usually keeps its group (``GroupResult.recovered``). A crash or a deadline hang
costs a group restart (seconds of ``import torch`` + rendezvous), so for a key that has already
lost a group the pool starts a replacement (``spares=True``) as soon as its next job starts: if
that job fails too, the next one finds its ranks (nearly) ready. A replacement preloads the
modules its predecessor's jobs had imported (opacus...).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

# the default deadline for a job, seconds (marker ``timeout=``, ini ``dpfsdp_timeout``, CLI ``--timeout``),
# is ``defaults.DEFAULT_TIMEOUT_S``: re-exported here, where the harness has always named it
from ..config.defaults import DEFAULT_TIMEOUT_S
from ..config.defaults import DEFAULT_WORLD_SIZES
from .cores import CorePlan, plan_cores, usable_cores
from .group import GroupResult, GroupStartError, WorkerGroup, check_backend
from .launch import rank_env
from .proof import Evidence
from .zygote import PRELOAD, Zygotes

Key = Tuple[int, str, Tuple[Tuple[str, str], ...]]



class Pool:
    def __init__(self, max_groups: int = 3, reuse: bool = True, start_timeout: float = 120.0, spares: bool = True,
                 zygote_preload: Optional[Sequence[str]] = PRELOAD, cores: Optional[CorePlan] = None):
        """``zygote_preload``: what the pool's zygotes import before they fork ranks (``zygote.py``;
        they learn more from the jobs); ``None``: no zygote, every rank is a new interpreter.
        ``cores``: how the cores are shared (``cores.plan_cores``: each rank's threads, whether a
        side lane runs beside the caller); default: the usable cores for the default world sizes."""
        #: how this pool shares the cores; the gate sets its run's (``gate/session.py``'s ``size_pool``)
        self.cores = cores if cores is not None else plan_cores(usable_cores(), DEFAULT_WORLD_SIZES)
        self.max_groups = max_groups
        self.reuse = reuse
        self.start_timeout = start_timeout
        self.spares_enabled = spares and reuse
        self.groups: "OrderedDict[Key, WorkerGroup]" = OrderedDict()
        #: replacement groups being started, by key (not counted in ``max_groups``)
        self.spares: Dict[Key, WorkerGroup] = {}
        #: keys whose group was ended by a failed job: their next job gets a spare at once
        self._lost: set = set()
        #: pid of every rank this pool ever started, including groups ended after a hang or crash:
        #: what a test checks to prove nothing was left behind
        self.started_pids: List[int] = []
        #: the fork servers of this pool's ranks (their pids join ``started_pids``)
        self.zygotes = (Zygotes(zygote_preload, start_timeout, self.started_pids) if zygote_preload is not None
                        else None)
        # guards the groups, spares and zygote bookkeeping; held while a group is looked up or started,
        # not while a job runs (``run``)
        self._lock = threading.RLock()
        self._free = threading.Condition(self._lock)
        #: keys whose group runs a job now: never closed to make room (``group``)
        self._busy: set = set()
        #: the pool's own threads for jobs beside the caller's, by name (``side_lane``)
        self._lanes: Dict[str, "ThreadPoolExecutor"] = {}

    @staticmethod
    def key(world_size: int, backend: str = "gloo", env: Optional[Dict[str, str]] = None) -> Key:
        return (world_size, backend, tuple(sorted((env or {}).items())))

    def group(self, world_size: int, backend: str = "gloo", env: Optional[Dict[str, str]] = None) -> WorkerGroup:
        """A live group for the key, starting one (and closing the least recently used) if needed;
        a spare started for the key is used first. Raises what ``WorkerGroup`` raises."""
        check_backend(backend, world_size)
        key = self.key(world_size, backend, env)
        g = self.groups.get(key)
        if g is not None and not g.closed:
            self.groups.move_to_end(key)
            return g
        # a replacement imports what the lost group's jobs had imported before it is ready, so that
        # its first job's deadline is not spent importing (opacus: seconds on loaded cores)
        preload = (g.job_modules or g.preload) if g is not None else ()
        if g is not None:
            self._lost.add(key)
        self.groups.pop(key, None)
        for old_key in [k for k in self.groups if k not in self._busy][:max(0, len(self.groups) - self.max_groups + 1)]:
            self.groups.pop(old_key).close()  # least recently used first; a group running a job stays
        g = self.spares.pop(key, None)
        if g is not None:
            try:
                g.ensure_ready()
            except GroupStartError:  # the spare failed to start: start one the plain way
                g = None
        if g is None or g.closed:
            g = WorkerGroup(world_size, backend, env, start_timeout=self.start_timeout, preload=preload,
                            zygotes=self.zygotes, rank_threads=self.cores.rank_threads)
            self.started_pids += g.pids()
        self.groups[key] = g
        return g

    def _start_spare(self, key: Key, preload) -> None:
        """Spawn (without waiting for it) a replacement group for ``key``, if none is pending."""
        spare = self.spares.get(key)
        if spare is not None and not spare.closed:
            return
        world_size, backend, env = key[0], key[1], dict(key[2])
        try:
            spare = WorkerGroup(world_size, backend, env, start_timeout=self.start_timeout, preload=preload,
                                wait_ready=False, zygotes=self.zygotes, rank_threads=self.cores.rank_threads)
        except Exception:  # no spare then: the next job starts its group as before
            return
        self.started_pids += spare.pids()
        self.spares[key] = spare

    def prestart(self, world_size: int, backend: str = "gloo", env: Optional[Dict[str, str]] = None,
                 preload: Sequence[str] = ()) -> bool:
        """Start a group for the key in the background (not waited for) if the pool has none, so that
        the first job there finds its ranks (nearly) ready instead of starting them: ``group`` takes it
        as it takes a spare. Its ranks import ``preload`` (e.g. the target's modules; one that fails
        is skipped) and what the zygotes have learned. Whether one was started: not while its
        zygotes still import (they are started, not waited for: a later call starts the group, so
        the caller never waits for imports here). Never raises: a group that cannot start here is
        started (and its error reported) by the first job that needs it."""
        try:
            check_backend(backend, world_size)
        except Exception:
            return False
        with self._lock:
            key = self.key(world_size, backend, env)
            g = self.groups.get(key)
            if (g is not None and not g.closed) or key in self.spares:
                return False
            learned = tuple(self.zygotes.learned) if self.zygotes is not None else ()
            preload = tuple(dict.fromkeys(tuple(preload) + learned))
            # the zygotes import torch and what they learned, never ``preload``: a zygote serves every
            # target of the pool, and a target's module may patch a library at import (a fork's)
            if self.zygotes is not None and not self.zygotes.start(rank_env(env), world_size):
                return False  # its zygotes import now; the group starts on a later call, or with its first job
            self._start_spare(key, preload)
            return key in self.spares

    def warm(self, world_size: int, env: Optional[Dict[str, str]] = None, preload: Sequence[str] = ()) -> None:
        """Start the zygotes that fork the ranks of groups up to ``world_size`` with ``env`` now (not
        waited for; ``Zygotes.start``), importing torch and ``preload`` (e.g. the target's modules)
        while the caller does its own imports: the first group then forks from a zygote already
        (nearly) ready. The zygotes the pool starts later (a wider group's) import ``preload``'s
        modules of the learned packages (opacus: ``Zygotes.learn``) at once too, instead of each
        rank they fork importing them in its first job (a pool that warms for a target runs that
        target: the gate's). Nothing without zygotes; never raises."""
        if self.zygotes is not None:
            self.zygotes.start(rank_env(env), world_size, preload)
            self.zygotes.learn(preload)

    def run(self, fn: Callable, *args, world_size: int = 2, backend: str = "gloo",
            env: Optional[Dict[str, str]] = None, timeout: float = DEFAULT_TIMEOUT_S,
            evidence: Optional[Evidence] = None, **kwargs) -> GroupResult:
        """Run ``fn(*args, **kwargs)`` on every rank of a ``world_size`` group; see ``WorkerGroup.run``
        (``evidence``: the caller's reading of the ranks' progress, ``proof.Evidence``)."""
        key = self.key(world_size, backend, env)
        with self._free:
            while key in self._busy:  # one job at a time per group (another thread's job on this key)
                self._free.wait()
            g = self.group(world_size, backend, env)
            if self.spares_enabled and key in self._lost:
                self._start_spare(key, g.job_modules or g.preload)
            self._busy.add(key)
        try:  # without the lock: a job on another group (another thread's: ``side_lane``) runs meanwhile
            res = g.run(fn, args, kwargs, timeout=timeout, evidence=evidence)
        finally:
            with self._free:
                self._busy.discard(key)
                if not self.reuse:
                    g.close()
                self._free.notify_all()
        with self._lock:
            if self.zygotes is not None:
                self.zygotes.learn(g.job_modules)
            if g.closed and self.reuse:
                self._lost.add(key)
        return res

    def side_lane(self, name: str = "side") -> Optional["ThreadPoolExecutor"]:
        """A thread of this pool's own named ``name`` (a one-worker ``concurrent.futures`` executor,
        started on first use, ended by ``close``) for jobs that run beside the caller's on other
        groups: the gate runs its 1-rank jobs on ``"side"`` while its larger groups run the rest, and
        its explorations on ``"explore"`` (``gate/scheduler.py``, ``gate/session.py``). Ranks a lane's
        job starts live as long as the pool (a spawned rank's parent-death signal follows the thread
        that started it: this one ends only when the pool closes). ``None`` where the cores do not
        hold two groups at once (one core: ``cores.CorePlan.side_lane``)."""
        if not self.cores.side_lane:
            return None
        with self._lock:
            if name not in self._lanes:
                from concurrent.futures import ThreadPoolExecutor

                self._lanes[name] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dpfsdp-{name}-lane")
            return self._lanes[name]

    def fresh_group(self, world_size: int, backend: str = "gloo", env: Optional[Dict[str, str]] = None) -> WorkerGroup:
        """A new group outside the warm set, for jobs that must be the first thing their rank
        processes run (two training jobs are two fresh sets of processes). Its ranks are spawned
        and not waited for (``run`` waits), so several can start at once; the caller closes it.
        Its pids join ``started_pids``."""
        check_backend(backend, world_size)
        g = WorkerGroup(world_size, backend, env, start_timeout=self.start_timeout, wait_ready=False,
                        zygotes=self.zygotes, rank_threads=self.cores.rank_threads)
        self.started_pids += g.pids()
        return g

    def close(self) -> None:
        lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:  # their jobs end first (a caller that closes a pool has nothing running on it)
            lane.shutdown(wait=True)
        with self._lock:
            while self.groups:
                self.groups.popitem()[1].close()
            while self.spares:
                self.spares.popitem()[1].close()
            if self.zygotes is not None:
                self.zygotes.close()  # after the groups: their ranks die with their zygote

    def pids(self):
        """pids of the live groups' and spares' ranks, and of the zygotes."""
        live = list(self.groups.values()) + list(self.spares.values())
        zygotes = self.zygotes.pids() if self.zygotes is not None else []
        return [pid for g in live if not g.closed for pid in g.pids()] + zygotes

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_default: Optional[Pool] = None
_default_pid: Optional[int] = None


def default_pool() -> Pool:
    """The process-wide pool (closed at exit). A forked child gets its own."""
    global _default, _default_pid
    if _default is None or _default_pid != os.getpid():
        _default, _default_pid = Pool(), os.getpid()
        atexit.register(_default.close)
    return _default


def pid_gone(pid: int) -> bool:
    """True once ``pid`` no longer exists (a zombie counts as gone: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: fall back to signal 0
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True


def wait_gone(pids, wait: float = 5.0) -> List[int]:
    """Wait up to ``wait`` s for every pid to be gone; returns the survivors (empty = none left)."""
    deadline = time.monotonic() + wait
    while not all(pid_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if not pid_gone(p)]


__all__ = ["Key", "DEFAULT_TIMEOUT_S", "Pool", "default_pool", "pid_gone", "wait_gone"]

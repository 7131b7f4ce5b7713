"""A fork server ("zygote") for rank processes: a rank in milliseconds instead of seconds.

A cold rank is an interpreter plus ``import torch`` and then, in its first job, FSDP and opacus:
~3 s of CPU each, most of the default gate's CPU time (it starts ~22 ranks). A zygote is a process
started once per ``Pool`` with torch, ``torch.distributed`` and the rank module imported and nothing
run -- no thread started, no CUDA initialised, no process group -- which forks a rank on request.
It learns: the modules of torch and opacus that the pool's jobs imported (``Zygotes.learn``, from
``WorkerGroup.job_modules``) it imports too between requests, so the ranks it forks later start
with FSDP and opacus loaded (a pool whose jobs never import opacus -- the plugin's, for a user's own
tests -- never loads it). The child becomes exactly the process ``python -m
dpfsdp_verify.harness.rank`` would have been, as far as the rank can tell:

* its own session (``setsid``), stdout and stderr on its log file, stdin ``/dev/null``, the job and
  diagnosis channel ends passed over the zygote's socket (``socket.send_fds``);
* ``os.environ`` the very mapping ``launch.rank_env`` + ``node_env`` gave a spawned rank, ``sys.path``
  what that interpreter would have computed from it (the working directory, ``PYTHONPATH``, then
  the interpreter's own entries, deduplicated as ``site`` does), the working directory, ``sys.argv``,
  and the rank module run as ``__main__``. Variables read when a library is *loaded*
  (``OMP_NUM_THREADS``: libgomp; ``OPACUS_USE_DEFERRED_NORM``; the tests' simulated accelerator)
  cannot be changed after the fork, so a zygote forks only ranks whose environment equals its own
  but for the per-rank node variables, ``PYTHONPATH`` (read into ``sys.path`` above) and a few
  read only when used (``UNCHECKED_VARS``); a rank with another environment (a variable set since,
  by a test say) is forked by zygotes started for it (``Zygotes``: up to 3 environments). Groups with variables of their
  own
  (``WorkerGroup(env=...)``: mode environments) are always spawned;
* the parent-death signal follows the zygote (the rank's parent): the harness dies -> the zygote
  reads EOF on its socket and exits -> its ranks get SIGKILL. A rank also exits on EOF of its
  channels, as a spawned one does;
* its exit code or signal: a forked rank is not the harness' child, so the zygote reaps it
  (``SIGCHLD``) and reports ``waitstatus_to_exitcode`` over the socket; the harness waits on a
  pidfd the zygote opened for the child (sent with the reply: no pid-reuse race).

Rank ``r`` of every group is forked from zygote ``r`` (``Zygotes``: one per rank index, started
when a group first needs it), so the ranks of one group come from different interpreters, as
torchrun's do: each has its own string-hash seed (set iteration order differs between ranks as it
does in a real job). When a zygote cannot start (or would fork unsafely: a thread or CUDA up after its
imports), the pool spawns its ranks as before and says so once (a ``RuntimeWarning``). What differs
from a spawned rank: ``/proc/<pid>/environ`` and ``cmdline`` show the zygote's (the rank's
``os.environ`` is its own), and modules the zygote had imported are not imported again.

Why not ``multiprocessing``'s ``forkserver`` with ``set_forkserver_preload``: it is one per
process and global, so under the pytest plugin our preload (torch, opacus) would leak into the
user's own ``multiprocessing`` use, and its children are not in their own session, do not take
their stdout, environment or working directory per request, and report no exit status to a
non-parent. This module is that idea in a few hundred lines: ``os.fork`` +
``socket.send_fds``/``recv_fds`` over a ``SOCK_SEQPACKET`` socket pair.

Run as ``python -m dpfsdp_verify.harness.zygote <socket fd> <preload JSON>`` (by ``Zygote``).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import importlib.util
import json
import os
import pickle
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union, cast

from . import wording
from .launch import NODE_VARS
from .protocol import RANK_MODULE, RankConfig

ZYGOTE_MODULE = "dpfsdp_verify.harness.zygote"
#: What every zygote imports before it forks: what a spawned rank imports before it is ready.
PRELOAD = ("torch", "torch.distributed", RANK_MODULE)
#: Packages whose modules the zygotes learn (``Zygotes.learn``): what the jobs of the pool's groups
#: imported from them (FSDP, opacus...) is imported by the zygotes too, so later ranks are forked
#: with it. Only packages known to read no per-rank state (``RANK``...) when imported: a zygote has none.
LEARNED_PACKAGES = ("torch", "opacus")
#: Variables that may differ between a zygote and the ranks it forks (module docstring): per rank,
#: read into ``sys.path`` at fork, pytest's per-test name, and the compile caches torch itself sets
#: in the harness when it first compiles (read when used, never at import).
UNCHECKED_VARS = frozenset(NODE_VARS + ("PYTHONPATH", "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR",
                                        "TRITON_CACHE_DIR"))
#: Largest message read from the socket, bytes (a request carries an environment).
MAX_MESSAGE = 1 << 20
#: How long the harness waits for a zygote's answer to a fork or for a reaped rank's exit status.
REPLY_TIMEOUT_S = 10.0


class ZygoteGone(RuntimeError):
    """The zygote exited or stopped answering."""


def _readable(fd, timeout: Optional[float]) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


# -- harness side -------------------------------------------------------------------------
class ForkedRank:
    """A rank forked by a zygote, with ``subprocess.Popen``'s ``pid``/``poll``/``wait`` (see
    ``launch.RankProcess``); its exit status comes from the zygote that reaped it."""

    def __init__(self, zygote: "Zygote", pid: int, pidfd: int):
        self.zygote, self.pid, self.pidfd = zygote, pid, pidfd
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None and _readable(self.pidfd, 0):
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            if not _readable(self.pidfd, timeout):
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", cast(float, timeout))  # None never times out
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode


class Zygote:
    """One zygote process, from the harness' side (started at construction, not waited for)."""

    def __init__(self, env: Dict[str, str], preload: Sequence[str]):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.output = tempfile.TemporaryFile()  # what it printed, for a start failure's message
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", ZYGOTE_MODULE, str(theirs.fileno()),
                                          json.dumps(list(preload))], env=env, stdin=subprocess.DEVNULL,
                                         stdout=self.output, stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),),
                                         start_new_session=True)
        finally:
            theirs.close()
        self.ctl = mine
        self.pid = self.proc.pid
        self.ready = False
        #: forked ranks not yet reported exited
        self.children: set = set()
        self._exits: Dict[int, int] = {}
        self._lock = threading.Lock()

    def _recv(self, timeout: float, reply: bool = True):
        """The next answer to a request (``reply``) or the next message of any kind, as ``(message,
        fds)``; ``None`` after ``timeout``. Exit notices are kept for ``exit_code``. Raises
        ``ZygoteGone`` on EOF."""
        deadline = time.monotonic() + timeout
        while True:
            if not _readable(self.ctl, max(0.0, deadline - time.monotonic())):
                return None
            data, fds, _, _ = socket.recv_fds(self.ctl, MAX_MESSAGE, 1)
            if not data:
                raise ZygoteGone("the zygote exited")
            msg = pickle.loads(data)
            if msg[0] == "exit":
                self._exits[msg[1]] = msg[2]
                self.children.discard(msg[1])
                if reply:
                    continue
            return msg, fds

    def wait_ready(self, timeout: float) -> Optional[str]:
        """``None`` once the zygote is ready to fork, else why it is not (it is then closed)."""
        if self.ready:
            return None
        with self._lock:
            try:
                got = self._recv(timeout)
                reason = got[0][1] if got is not None else f"not ready after {timeout:.0f} s"
            except ZygoteGone:
                got, reason = None, f"it exited ({wording.exit_text(self.proc.wait())})"
            if got is not None and got[0][0] == "ready":
                self.ready = True
                return None
        self._end()
        self.output.seek(0)
        tail = self.output.read()[-800:].decode(errors="replace").strip()
        self.output.close()
        return reason + (f"; its output: {tail}" if tail and tail not in reason else "")

    def answered(self) -> bool:
        """Whether the zygote has said it is ready, or why it is not (or exited): a fork asked now
        does not wait for its imports. Never waits, reads nothing: ``wait_ready`` takes the answer."""
        if self.ready:
            return True
        if not self._lock.acquire(blocking=False):  # another thread talks to it: not settled yet
            return False
        try:
            return _readable(self.ctl, 0.0)
        except (OSError, ValueError):  # closed: the next fork finds out
            return True
        finally:
            self._lock.release()

    def fork(self, cfg: RankConfig, env: Dict[str, str], log_fd: int, timeout: float) -> ForkedRank:
        """Fork rank ``cfg.rank`` (its channel ends ``cfg.job_fd``/``cfg.diag_fd``, output on
        ``log_fd``); ``timeout`` covers imports queued before the request. Raises ``ZygoteGone``
        (or ``OSError``) when the zygote cannot."""
        request = pickle.dumps(("fork", cfg.__dict__, env, os.getcwd()))
        with self._lock:
            socket.send_fds(self.ctl, [request], [cfg.job_fd, cfg.diag_fd, log_fd])
            got = self._recv(timeout)
        if got is None:
            raise ZygoteGone(f"no answer to a fork within {timeout:.0f} s")
        (kind, value), fds = got
        if kind != "forked" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ZygoteGone(f"the zygote could not fork: {value}")
        self.children.add(value)
        return ForkedRank(self, value, fds[0])

    def learn(self, names: Sequence[str]) -> None:
        """Have the zygote import ``names`` before its next fork (no answer; a failing import is
        skipped)."""
        with self._lock:
            socket.send_fds(self.ctl, [pickle.dumps(("import", list(names)))], [])

    def exit_code(self, pid: int) -> int:
        """The exit code (or ``-signal``) of a forked rank that has exited. A rank whose zygote
        died was killed by its parent-death signal (SIGKILL)."""
        with self._lock:
            try:
                while pid not in self._exits:
                    if self._recv(REPLY_TIMEOUT_S, reply=False) is None:
                        break
            except (ZygoteGone, OSError, ValueError):  # ValueError: closed meanwhile
                pass
            return self._exits.pop(pid, -signal.SIGKILL)

    def busy(self) -> bool:
        """Whether a rank it forked still runs (ending the zygote would kill it)."""
        with self._lock:
            try:
                while self._recv(0.0, reply=False) is not None:
                    pass
            except (ZygoteGone, OSError, ValueError):  # gone, or closed: its ranks are gone too
                return False
            return bool(self.children)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """End the zygote (EOF on its socket; SIGKILL if it lingers) and reap it. Its ranks get
        their parent-death signal: close their groups first."""
        self._end()
        self.output.close()

    def _end(self) -> None:
        self.ctl.close()
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Zygotes:
    """A pool's zygotes: for each environment its groups' ranks were started with, one zygote per
    rank index (module docstring), each started when a group first needs it. At most
    ``MAX_ENVIRONMENTS`` environments: a new one replaces one whose ranks are all gone, else its
    ranks are spawned."""

    #: environments with zygotes of their own (a test that sets a variable starts a set for it)
    MAX_ENVIRONMENTS = 3

    def __init__(self, preload: Sequence[str] = PRELOAD, start_timeout: float = 120.0,
                 started_pids: Optional[List[int]] = None):
        self.preload = tuple(preload)
        #: modules learned from the jobs (``learn``): a zygote started later imports them at once
        self.learned: List[str] = []
        self.start_timeout = start_timeout
        #: every zygote pid started (the pool's ``started_pids``: proof that none is left behind)
        self.started_pids = started_pids if started_pids is not None else []
        #: checked environment (``UNCHECKED_VARS`` left out) -> (the zygotes' environment, zygote per rank index)
        self.sets: "OrderedDict[tuple, Tuple[Dict[str, str], List[Optional[Zygote]]]]" = OrderedDict()
        #: why the zygotes are not used (ranks are spawned), once one could not start
        self.failed: Optional[str] = None
        self._lock = threading.Lock()

    def fork(self, cfg: RankConfig, env: Dict[str, str], log_fd: int) -> Optional[ForkedRank]:
        """Rank ``cfg.rank`` forked by its zygote; ``None`` when it must be spawned instead (too many
        environments in use, or the zygotes cannot start or fork)."""
        with self._lock:
            if self.failed is not None:
                return None
            chosen = self._set_for(env)
            if chosen is None:
                return None
            zygote = self._ready(*chosen, cfg.rank, cfg.world_size)
            if zygote is None:
                return None
            try:
                return zygote.fork(cfg, env, log_fd, self.start_timeout)
            except (ZygoteGone, OSError) as e:
                if zygote.alive():  # it runs but cannot fork (unsafe after an import, no answer...)
                    self._give_up(f"zygote {cfg.rank} failed: {e}")
                return None  # a dead one (killed?) is replaced when the next group starts

    def _set_for(self, env: Dict[str, str]) -> Optional[Tuple[Dict[str, str], List[Optional[Zygote]]]]:
        """The set of zygotes for ranks with ``env`` -- ``(the zygotes' environment, zygote per rank
        index)`` -- made room for and created if new; ``None`` when every set is busy."""
        key = tuple(sorted((k, v) for k, v in env.items() if k not in UNCHECKED_VARS))
        if key not in self.sets:
            for old in [k for k, (_, zs) in self.sets.items() if not any(z is not None and z.busy() for z in zs)]:
                if len(self.sets) < self.MAX_ENVIRONMENTS:
                    break
                for z in self.sets.pop(old)[1]:
                    if z is not None:
                        z.close()
            if len(self.sets) >= self.MAX_ENVIRONMENTS:
                return None
            self.sets[key] = ({k: v for k, v in env.items() if k not in NODE_VARS}, [])
        self.sets.move_to_end(key)
        return self.sets[key]

    def _ready(self, env: Dict[str, str], zygotes: List[Optional[Zygote]], index: int, world_size: int
               ) -> Optional[Zygote]:
        """Zygote ``index`` of a set, ready; the group's other missing zygotes are started meanwhile
        (not waited for), so that a group's zygotes import in parallel."""
        self._fill(env, zygotes, index, world_size)
        reason = cast(Zygote, zygotes[index]).wait_ready(self.start_timeout)  # every slot filled above
        if reason is not None:
            self._give_up(f"zygote {index} could not start: {reason}")
            return None
        return zygotes[index]

    def _fill(self, env: Dict[str, str], zygotes: List[Optional[Zygote]], first: int, world_size: int,
              extra: Sequence[str] = ()) -> None:
        """Start (not wait for) zygotes ``first .. world_size - 1`` of a set where none runs; they import
        the preload, what was learned and ``extra`` (optional: one that fails is skipped)."""
        while len(zygotes) < world_size:
            zygotes.append(None)
        for i in range(first, world_size):
            z = zygotes[i]
            if z is None or (z.ready and not z.alive()):  # never started, or died (killed?): a new one
                if z is not None:
                    z.close()
                optional = tuple(dict.fromkeys(tuple(self.learned) + tuple(extra)))
                zygotes[i] = z = Zygote(env, self.preload + tuple(m + "?" for m in optional))
                self.started_pids.append(z.pid)

    def start(self, env: Dict[str, str], world_size: int, extra: Sequence[str] = ()) -> bool:
        """Start the zygotes of ranks ``0 .. world_size - 1`` with ``env`` now, not waited for, so that
        their imports (torch, ``extra``: e.g. the target's modules) overlap the caller's own start-up
        instead of delaying the first group. Whether a group of ``world_size`` ranks would start now
        without waiting for a zygote's imports (each has answered, ``Zygote.answered``; or its ranks
        are spawned). Never raises: a zygote that cannot start is found out when a group needs it."""
        try:
            with self._lock:
                if self.failed is not None:
                    return True
                chosen = self._set_for(env)
                if chosen is None:
                    return True
                self._fill(*chosen, 0, world_size, extra)
                return all(z is not None and z.answered() for z in chosen[1][:world_size])
        except Exception:
            return True

    def _all(self) -> List[Zygote]:
        return [z for _, zs in self.sets.values() for z in zs if z is not None]

    def learn(self, modules: Sequence[str]) -> None:
        """Modules of ``LEARNED_PACKAGES`` that a group's jobs imported (``WorkerGroup.job_modules``):
        every zygote imports those it has not, so that the ranks it forks next start with them."""
        with self._lock:
            known = set(self.learned)
            new = [m for m in modules if m.split(".")[0] in LEARNED_PACKAGES and m not in known]
            if not new or self.failed is not None:
                return
            self.learned += new
            for z in self._all():
                if z.ready and z.alive():
                    try:
                        z.learn(new)
                    except OSError:  # it died: the next fork replaces it
                        pass

    def _give_up(self, reason: str) -> None:
        self.failed = reason
        warnings.warn(f"dpfsdp-verify: rank processes are spawned (seconds each): {reason}", RuntimeWarning,
                      stacklevel=4)

    def pids(self) -> List[int]:
        """pids of the zygotes still running."""
        return [z.pid for z in self._all() if z.alive()]

    def close(self) -> None:
        """End every zygote (after the pool's groups: their ranks die with their zygote)."""
        with self._lock:
            zygotes = self._all()
            self.sets.clear()
            for z in zygotes:
                z.close()


# -- zygote side --------------------------------------------------------------------------
def _import_all(names: Sequence[str]) -> None:
    """Import ``names``; one with a trailing ``?`` is skipped when its import fails."""
    for name in names:
        optional = name.endswith("?")
        try:
            importlib.import_module(name.rstrip("?"))
        except (Exception, SystemExit):
            if not optional:
                raise


def _unsafe_to_fork() -> Optional[str]:
    """Why forking this process would not give a clean rank, if it would not."""
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads > 1:
        return f"{threads} threads run after the imports (a fork would copy their locks, not them)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised by the imports (a forked child cannot use it)"
    return None


def _interpreter_path() -> List[str]:
    """The ``sys.path`` entries this interpreter adds after ``PYTHONPATH`` (stdlib, site-packages,
    ``.pth`` entries): what a spawned rank's ``sys.path`` ends with."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import sys, json; print(json.dumps(sys.path[0 if sys.flags.safe_path else 1:]))"
    out = subprocess.run([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                         check=True, text=True)
    return json.loads(out.stdout)


def rank_sys_path(cwd: str, pythonpath: str, interpreter_path: List[str]) -> List[str]:
    """The ``sys.path`` of ``python -m ...`` started in ``cwd`` with ``PYTHONPATH=pythonpath``: the
    working directory first (unless ``-P``/``PYTHONSAFEPATH``), then ``PYTHONPATH`` made absolute,
    then the interpreter's own entries as it adds them, each entry once (``site.removeduppaths``;
    ``site`` adds a directory only if it is not there yet)."""
    out, seen = [], set()
    pythonpath_entries = [os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p]
    for entry in pythonpath_entries + interpreter_path:
        if os.path.normcase(entry) not in seen:
            seen.add(os.path.normcase(entry))
            out.append(entry)
    return out if sys.flags.safe_path else [cwd] + out


def _become_rank(cfg: dict, env: Dict[str, str], cwd: str, fds: List[int], zygote_pid: int,
                 interpreter_path: List[str], ctl: socket.socket, own_fds: Sequence[int]) -> None:
    """In the forked child: turn into what ``launch.spawn_rank`` starts, and run it. Never returns."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        ctl.close()  # the zygote's socket: only the zygote may answer the harness
        for fd in own_fds:
            os.close(fd)
        job_fd, diag_fd, log_fd = fds
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = rank_sys_path(cwd, env.get("PYTHONPATH", ""), interpreter_path)
        importlib.invalidate_caches()  # files written since the zygote started (test modules...)
        cfg = dict(cfg, job_fd=job_fd, diag_fd=diag_fd, parent_pid=zygote_pid)
        sys.argv = [cast(Any, importlib.util.find_spec(RANK_MODULE)).origin, json.dumps(cfg)]  # ours: found
        runpy.run_module(RANK_MODULE, run_name="__main__", alter_sys=True)  # exits itself (os._exit)
        code = 0
    except SystemExit as e:  # as the interpreter would exit
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _send(ctl: socket.socket, msg, fds: Sequence[int] = ()) -> None:
    socket.send_fds(ctl, [pickle.dumps(msg)], list(fds))


def _reap(ctl: socket.socket) -> None:
    """Reap every exited child and report its exit code (``-signal`` when killed)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(ctl, ("exit", pid, os.waitstatus_to_exitcode(status)))


def _serve(ctl: socket.socket, interpreter_path: List[str], wake_r: int, wake_w: int) -> None:
    """Fork a rank per request, import what the harness learned, until EOF (the harness is gone)."""
    unsafe = None  # why forking became unsafe after a learned import
    while True:
        watched: List[Union[socket.socket, int]] = [ctl, wake_r]
        ready = select.select(watched, [], [])[0]
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
            _reap(ctl)
        if ctl not in ready:
            continue
        data, fds, _, _ = socket.recv_fds(ctl, MAX_MESSAGE, 3)
        if not data:
            return
        request = pickle.loads(data)
        if request[0] == "import":
            _import_all([name + "?" for name in request[1]])
            unsafe = unsafe or _unsafe_to_fork()
            gc.collect()
            gc.freeze()
            continue
        _, cfg, env, cwd = request
        sys.stdout.flush()
        sys.stderr.flush()
        zygote_pid = os.getpid()
        if unsafe is not None:
            _send(ctl, ("failed", unsafe))
        else:
            try:
                pid = os.fork()
            except OSError as e:
                _send(ctl, ("failed", f"fork: {e}"))
            else:
                if pid == 0:
                    _become_rank(cfg, env, cwd, fds, zygote_pid, interpreter_path, ctl, (wake_r, wake_w))
                pidfd = os.pidfd_open(pid)
                _send(ctl, ("forked", pid), [pidfd])
                os.close(pidfd)
        for fd in fds:
            os.close(fd)


def main(argv=None) -> None:
    argv = argv or sys.argv
    ctl = socket.socket(fileno=int(argv[1]))
    try:
        _import_all(json.loads(argv[2]))
        interpreter_path = _interpreter_path()
        problem = _unsafe_to_fork()
    except BaseException:
        problem = traceback.format_exc(limit=-3).strip()
    if problem:
        _send(ctl, ("failed", problem))
        os._exit(1)
    # the children share these pages until they write them: freeze what the imports left so
    # that their collections do not touch (and copy) them
    gc.collect()
    gc.freeze()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a byte on wake_w: reap
    _send(ctl, ("ready", os.getpid()))
    try:
        _serve(ctl, interpreter_path, wake_r, wake_w)
    finally:
        os._exit(0)  # the ranks follow (their parent-death signal)


if __name__ == "__main__":
    main()


__all__ = ["ZYGOTE_MODULE", "PRELOAD", "LEARNED_PACKAGES", "UNCHECKED_VARS", "MAX_MESSAGE", "REPLY_TIMEOUT_S",
           "ZygoteGone", "ForkedRank", "Zygote", "Zygotes", "rank_sys_path", "main"]

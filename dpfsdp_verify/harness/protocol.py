"""The tiny protocol between the parent (``group.py``) and each rank (``rank.py``).

Each rank is a process holding two ``multiprocessing.connection.Connection`` ends of
``socket.socketpair()``s inherited from the parent (or passed to the zygote that forks it) — no TCP
port, no socket file. Every message
is one of the small dataclasses below (pickled with ``send``/``recv``):

* the **job channel**, read by the rank's main thread:
    parent -> rank  ``Job(job_id, payload)``   payload = ``pickle.dumps((fn, args, kwargs))``
    parent -> rank  ``Stop()``                 destroy the process group and exit 0
    rank -> parent  ``Ready(rank, pid)``       once, after ``init_process_group``
    rank -> parent  ``Result(job_id, result)`` result: a ``JobResult``
    parent -> rank  ``Renew(generation)``      after an ``Abort``: create a fresh process group
                                               (store prefix ``renew<generation>/``), then
                                               ``Ready`` again
* the **diagnosis channel**, read by a daemon thread in the rank so that it answers while the
  main thread is blocked in a collective or spinning in Python:
    parent -> rank  ``ProbeRequest(job_id)``  cheap, polled while a job runs (no stacks)
    rank -> parent  ``Probe(...)``      job state + last flight-recorder entry per process group
    parent -> rank  ``DumpRequest()``   the full picture, for a verdict's report
    rank -> parent  ``Dump(dump)``      dump: a ``RankDump`` (stacks + flight-recorder trace)
    parent -> rank  ``Abort()``         free the main thread from a blocked collective (no answer;
                                        ``Backend.free_blocked``: gloo's connections are shut
                                        down, NCCL's communicator aborted)

EOF on either channel means the parent is gone: the rank exits at once (it also has
``PR_SET_PDEATHSIG``), so a killed pytest/xdist worker leaves no orphans.
"""

from __future__ import annotations

import io
import json
import pickle
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

#: Rank-side settings passed as argv[1] (JSON): see ``RankConfig``.
RANK_MODULE = "dpfsdp_verify.harness.rank"


@dataclass
class RankConfig:
    rank: int
    world_size: int
    backend: str
    store_path: str
    job_fd: int
    diag_fd: int
    parent_pid: int
    pg_timeout_s: float
    #: modules to import before Ready (see ``WorkerGroup(preload=...)``)
    preload: List[str] = field(default_factory=list)
    #: torch intra-op threads the rank sets once it runs (``launch.rank_threads``; 0: torch's own)
    threads: int = 0

    def to_argv(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_argv(cls, text: str) -> "RankConfig":
        return cls(**json.loads(text))


@dataclass
class JobError:
    """An exception raised by a job on one rank."""

    type: str
    message: str
    traceback: str
    #: the traceback as data, innermost last: ``(file, line, function, source line)``
    #: (``frames.frames_of``; ``frames.user_frames`` leaves the harness's own out)
    frames: List[Tuple[str, int, str, str]] = field(default_factory=list)


@dataclass
class JobResult:
    """What one rank reports for one job: ``value`` if ``error`` is None."""

    rank: int
    value: Any = None
    error: Optional[JobError] = None
    seconds: float = 0.0
    #: True when the job left the rank unusable for another job (it destroyed the process group).
    dirty: bool = False
    #: What the job wrote to sys.stdout / sys.stderr on this rank (the tail, when long).
    stdout: str = ""
    stderr: str = ""
    #: installed-package modules imported on this rank since it started (what a replacement
    #: group preloads)
    modules: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class RankDump:
    """A rank's state at the moment the parent asked: every thread's Python stack and the
    flight recorder's collective trace (``None`` when the recorder is unavailable)."""

    rank: int
    pid: int
    stacks: Dict[str, List[str]] = field(default_factory=dict)   # thread name -> frames, innermost last
    main_frames: List[tuple] = field(default_factory=list)        # (file, line, function) innermost last
    flight_recorder: Optional[dict] = None
    flight_recorder_error: Optional[str] = None


# -- messages ------------------------------------------------------------------------------
@dataclass
class Job:
    job_id: int
    payload: bytes


@dataclass
class Stop:
    pass


@dataclass
class Ready:
    rank: int
    pid: int


@dataclass
class Result:
    job_id: int
    result: JobResult


@dataclass
class Renew:
    generation: int


@dataclass
class Abort:
    pass


@dataclass
class DumpRequest:
    pass


@dataclass
class Dump:
    dump: RankDump


@dataclass
class ProbeRequest:
    job_id: int   # echoed in the answer, so a late answer is never taken for the next job's


@dataclass
class Probe:
    """A rank's answer to ``ProbeRequest``.

    ``running``: the job the rank's main thread is in (``None``: idle). ``done``: the newest job
    whose ``Result`` the rank has already sent (so ``done >= job_id`` proves the rank finished
    that job). ``recent``: per process group (the recorder's group name, ``"0"`` = the default
    group), the newest flight-recorder entries this rank issued, ``{seq_id: (op, sizes)}`` e.g.
    ``{3: ("gloo:all_reduce", "[[5]]")}``. ``error``: why there is no trace (recorder off...), in which case ``recent``
    is
    empty and nothing can be proven from it."""

    rank: int
    job_id: int
    running: Optional[int] = None
    done: int = 0
    recent: Dict[str, Dict[int, Tuple[str, str]]] = field(default_factory=dict)
    error: Optional[str] = None
    modules: List[str] = field(default_factory=list)   # as ``JobResult.modules``

    def last(self, pg: str) -> Optional[int]:
        """The newest sequence id this rank issued in group ``pg`` (``None``: none recorded)."""
        seqs = self.recent.get(pg)
        return max(seqs) if seqs else None


def _tensor_from_numpy(array):
    import torch

    return torch.from_numpy(array)


class _Pickler(pickle.Pickler):
    """Plain pickle, with CPU tensors carried as numpy arrays: torch's own tensor pickling goes
    through ``torch.serialization`` (measured ~0.4 ms to dump and ~0.8 ms to load a step's dozen
    small tensors, vs ~0.04 / 0.02 ms as arrays) and ships a view's whole storage."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if (torch is not None and type(obj) is torch.Tensor and obj.device.type == "cpu"
                and not obj.requires_grad and obj.layout is torch.strided):
            try:
                return _tensor_from_numpy, (obj.numpy(),)
            except (TypeError, RuntimeError):  # bfloat16, conjugate views...: torch's own way
                pass
        return NotImplemented


def send(conn, obj) -> None:
    """Send with plain pickle: ``Connection.send`` uses ForkingPickler, which torch teaches to pass
    tensor storage as shared-memory file descriptors -- meaningless between unrelated processes."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    conn.send_bytes(buf.getvalue())


def recv(conn):
    return pickle.loads(conn.recv_bytes())


__all__ = ["RANK_MODULE", "RankConfig", "JobError", "JobResult", "RankDump", "Job", "Stop", "Ready", "Result", "Renew",
           "Abort", "DumpRequest", "Dump", "ProbeRequest", "Probe", "send", "recv"]

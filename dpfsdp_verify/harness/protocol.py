"""The tiny protocol between the parent (``group.py``) and each rank (``rank.py``).

Each rank is a child process holding two ``multiprocessing.connection.Connection`` ends of
``socket.socketpair()``s inherited from the parent — no TCP port, no socket file:

* the **job channel**, read by the rank's main thread:
    parent -> rank  ``("job", job_id, payload)``  payload = ``pickle.dumps((fn, args, kwargs))``
    parent -> rank  ``("stop",)``                 destroy the process group and exit 0
    rank -> parent  ``("ready", rank, pid)``      once, after ``init_process_group``
    rank -> parent  ``("result", job_id, JobResult)``
* the **diagnosis channel**, read by a daemon thread in the rank so that it answers while the
  main thread is blocked in a collective or spinning in Python:
    parent -> rank  ``("dump",)``
    rank -> parent  ``("dump", RankDump)``

EOF on either channel means the parent is gone: the rank exits at once (it also has
``PR_SET_PDEATHSIG``), so a killed pytest/xdist worker leaves no orphans.
"""

from __future__ import annotations

import io
import json
import pickle
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

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


@dataclass
class JobResult:
    """What one rank reports for one job: ``value`` if ``error`` is None."""

    rank: int
    value: Any = None
    error: Optional[JobError] = None
    seconds: float = 0.0
    #: True when the job left the rank unusable for another job (it destroyed the process group).
    dirty: bool = False

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

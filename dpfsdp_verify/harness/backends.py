"""The process-group backends the harness knows, as data: one table read by every place that
used to know "gloo" and "nccl" by name (group launch, rank setup, the CLI's ``--backend``, the
pytest plugin's torchrun mode).

A ``Backend`` says whether it can give ``world_size`` ranks here (``unavailable(world_size)``
returns the reason it cannot, or ``None``), which device a rank uses, what a rank must do
before ``init_process_group`` (``setup_rank``, e.g. ``torch.cuda.set_device``), and how a rank
frees a collective it is blocked in (``free_blocked``).

The device is a single value derived from the backend (``rank_device``): gloo computes on the
CPU *whatever the machine has*, nccl on the rank's own GPU. torch's defaults do not follow the
backend: FSDP2's ``fully_shard`` without ``mesh=`` builds its mesh on ``torch._C._get_accelerator()``,
the accelerator torch was *built* for (CUDA on any GPU machine's torch, GPUs visible or not), so a
gloo rank on a GPU box had its parameters moved to cuda:0 while its batches stayed on the CPU.
``setup_rank`` of gloo therefore makes this process's accelerator query answer ``cpu``
(``pin_accelerator``): every torch default built from it (FSDP2's default mesh, ``barrier``'s
device) then follows the backend, for any adapter, including those that cannot pass a mesh
(opacus' ``FSDP2Wrapper`` has no ``mesh`` argument). Hiding the GPUs (``CUDA_VISIBLE_DEVICES=``)
would not do: the query answers the build, and FSDP2 would then ask an empty CUDA runtime for its
current device.

``SIMULATED_ACCELERATOR_ENV`` (private, for the suite's own tests): a rank started with it set to
``cuda`` has its accelerator query answer ``cuda`` before anything else runs, as torch does on a
GPU box, so the CPU test suite can show what a GPU box does to a gloo group
(``tests/harness/test_devices.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, cast


def _gloo_unavailable(world_size: int) -> Optional[str]:
    import torch.distributed as dist

    if not dist.is_gloo_available():
        return "backend 'gloo' is not built into this torch"
    return None


#: private: the GPU count the gate plans with instead of asking CUDA (``visible_gpus``); only the
#: suite's tests set it, to plan nccl runs for a machine with that many GPUs on a CPU machine
SIMULATED_GPUS_ENV = "_DPFSDP_VERIFY_SIMULATED_GPUS"


def visible_gpus() -> int:
    """How many CUDA GPUs this process sees (0 without CUDA); ``SIMULATED_GPUS_ENV`` overrides it."""
    simulated = os.environ.get(SIMULATED_GPUS_ENV)
    if simulated:
        return int(simulated)
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nccl_unavailable(world_size: int) -> Optional[str]:
    n = visible_gpus()
    if not n:
        return "backend 'nccl' needs CUDA GPUs; none is available on this machine"
    if n < world_size:
        return f"backend 'nccl' needs one GPU per rank: world_size={world_size} but {n} GPU(s) visible"
    return None


def _close_tcp_connections() -> int:
    """Shut down every connected TCP socket of this process (not listeners: gloo aborts the
    process when its listener fails): with gloo those are the process groups' pairs, and a
    collective blocked on one raises "Connection closed by peer" -- on this rank and on its
    peers. ``_abort_process_group`` does not free a blocked gloo collective (measured, torch
    2.13). Returns how many sockets were shut down."""
    import socket

    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except (OSError, ValueError):
            continue
        try:
            if (s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM
                    and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                s.shutdown(socket.SHUT_RDWR)
                n += 1
        except OSError:
            pass
        finally:
            s.close()  # the dup only; shutdown already reached the shared socket
    return n


def _abort_default_group() -> int:
    import torch.distributed as dist

    try:
        dist.distributed_c10d._abort_process_group()
    except Exception:
        return 0
    return 1


def _cuda_device(local_rank: int) -> str:
    import torch

    return f"cuda:{local_rank % torch.cuda.device_count()}"


def _cuda_setup(local_rank: int) -> None:
    import torch

    torch.cuda.set_device(local_rank % torch.cuda.device_count())


#: private: a rank started with this set (to ``cuda``) answers torch's accelerator query with it,
#: as a GPU machine's torch does (module docstring); only the suite's tests set it
SIMULATED_ACCELERATOR_ENV = "_DPFSDP_VERIFY_SIMULATED_ACCELERATOR"


def pin_accelerator(device_type: str) -> None:
    """Make ``torch._C._get_accelerator()`` -- torch's query for "the" accelerator, read at call
    time by FSDP2's default mesh, ``barrier`` and an undefined backend's choice -- answer
    ``device_type`` in this process (module docstring)."""
    import torch

    answer = torch.device(device_type)
    torch._C._get_accelerator = cast(Any, lambda: answer)  # replaced, not called here: its stub types the original


def simulate_accelerator_from_env() -> None:
    """Tests only: answer the accelerator query as ``SIMULATED_ACCELERATOR_ENV`` says (unset: leave
    torch alone). Called first thing in a rank, before the backend's ``setup_rank``."""
    device_type = os.environ.get(SIMULATED_ACCELERATOR_ENV)
    if device_type:
        pin_accelerator(device_type)


def _cpu_setup(local_rank: int) -> None:
    """gloo computes on the CPU: torch's defaults must not pick the machine's GPU (module docstring)."""
    pin_accelerator("cpu")


@dataclass(frozen=True)
class Backend:
    name: str
    #: ``unavailable(world_size)`` -> the reason this backend cannot give that many ranks, or None
    unavailable: Callable[[int], Optional[str]]
    #: ``device(local_rank)`` -> the torch device string a rank computes on
    device: Callable[[int], str]
    #: the device type every rank of this backend computes on (``rank_device``)
    device_type: str
    #: ``setup_rank(local_rank)``: what a rank does before ``init_process_group``
    setup_rank: Callable[[int], None]
    #: ``free_blocked()``, called from a rank's diagnosis thread: make a collective the main thread
    #: is blocked in raise (after a proven deadlock, so that the rank can be reused)
    free_blocked: Callable[[], int]
    description: str = ""


BACKENDS: Dict[str, Backend] = {
    b.name: b for b in (
        Backend("gloo", _gloo_unavailable, lambda local_rank: "cpu", "cpu", _cpu_setup, _close_tcp_connections,
                "gloo (CPU)"),
        Backend("nccl", _nccl_unavailable, _cuda_device, "cuda", _cuda_setup, _abort_default_group,
                "nccl (one GPU per rank)"),
    )
}

#: ``--backend`` choices, in the order they are documented.
NAMES = tuple(BACKENDS)


def get_backend(name: str) -> Backend:
    """The table entry for ``name``. Raises ``ValueError`` naming the known backends."""
    try:
        return BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown backend {name!r}; choose " + " or ".join(repr(n) for n in NAMES)) from None


def rank_device(backend: str):
    """The ``torch.device`` a rank of ``backend`` computes on: ``cpu`` for gloo, the current CUDA
    device (``setup_rank`` set it to the rank's own GPU) for nccl."""
    import torch

    if get_backend(backend).device_type == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def preferred_backend() -> str:
    """The first backend of the table that can give one rank here (nccl on a GPU box, else gloo):
    what a torchrun job uses when nothing says otherwise."""
    for name in ("nccl", "gloo"):
        if BACKENDS[name].unavailable(1) is None:
            return name
    return "gloo"


__all__ = ["SIMULATED_ACCELERATOR_ENV", "SIMULATED_GPUS_ENV", "visible_gpus", "pin_accelerator",
           "simulate_accelerator_from_env", "Backend", "BACKENDS",
           "NAMES", "get_backend", "rank_device", "preferred_backend"]

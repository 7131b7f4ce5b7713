"""Small helpers every target adapter needs on a rank: gather full tensors, pick a rank's samples.

They are plain functions of the ``RunSpec`` and the process group, so an adapter for a fork (or a
specimen in ``fixtures/``) reports exactly the same shapes and names as the built-in target.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Tuple, cast

import torch
import torch.distributed as dist

from .. import models
from .base import RunSpec

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def world() -> Tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` when ``torch.distributed`` is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def device() -> torch.device:
    """The device this rank computes on: the one its process group's backend implies
    (``harness.backends.rank_device``): ``cpu`` under gloo whatever GPUs the machine has, the rank's
    own GPU under nccl; ``cpu`` outside a process group. An adapter puts its model (or mesh), its
    batches and its noise generator there; the suite's judges read every reported tensor back
    as float64 on the CPU."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    from ..harness.backends import rank_device

    name = str(dist.get_backend())  # "gloo", "nccl", or a per-device map such as "cpu:gloo,cuda:nccl"
    return rank_device("nccl" if "nccl" in name else "gloo")


def numerics() -> Dict[str, object]:
    """The switches that decide how this rank rounds float32 products, as they stand now: on a
    CUDA device whether TF32 is allowed for matmuls and for cuDNN convolutions; ``{}`` on the
    CPU, which has no such switch."""
    if device().type != "cuda":
        return {}
    return {"tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32)}


def float32_numerics() -> None:
    """On a CUDA rank, TF32 off for matmuls and for cuDNN convolutions, so that float32 rounds as
    IEEE float32, for which the suite's float32 tolerances are derived
    (``properties.analysis.compare.TOLERANCES``). torch's defaults leave cuDNN convolutions in TF32 (a
    10-bit mantissa: ~1e-3 relative, ten times the float32 tolerance): set by the suite before
    every run and reported in each verdict's evidence (``numerics``). No-op on the CPU."""
    if device().type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def device_mesh(spec: Optional[RunSpec] = None):
    """The mesh an adapter passes as ``fully_shard(..., mesh=device_mesh(spec))``, on ``device()``
    so that FSDP2 shards on the backend's device, never on the accelerator torch was built for
    (``harness.backends`` docstring): the 1-D mesh over every rank, or the ``DeviceMesh`` of a 2-D
    ``spec.mesh`` (``mesh.Mesh.build``). A collective: every rank calls it alike."""
    if spec is not None and spec.mesh:
        return spec.layout.build(device().type)
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device().type, (world()[1],))


def rank_and_world(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """A virtual ``(rank, world_size)`` when both are given (``Target.sample_batches``), this
    process's own (``world()``) when both are ``None``; ``ValueError`` otherwise."""
    if rank is None and world_size is None:
        return world()
    if rank is None or world_size is None:
        raise ValueError("give both rank and world_size (a virtual rank) or neither (this process's own)")
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"virtual rank {rank!r} of world size {world_size!r}: need 0 <= rank < world_size")
    return rank, world_size


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The un-sharded float64 CPU copy of ``t`` (a DTensor is all-gathered: a collective, so every
    rank must call this for the same tensors in the same order)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to(torch.float64).cpu().clone()


def _dim0_sharded(t) -> bool:
    """FSDP2's layout: a DTensor sharded on dim 0 over a 1-D mesh."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(t, DTensor) and t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(0),)


def full_tensors(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """``[full_tensor(t) for t in tensors]`` with every dim-0-sharded DTensor on the first one's
    mesh gathered in ONE ``all_gather_into_tensor`` instead of one collective each: on 2 CPU cores
    a gloo collective costs ~1 ms, and a step's report gathered a dozen tensors one by one
    (measured: a third of a fuzz example's time). Collective: call on every rank alike.

    Each rank's local shard is padded to ``ceil(dim0 / world)`` rows (FSDP2 shards with
    ``torch.chunk`` semantics: only trailing ranks hold fewer rows, possibly none), so the ranks'
    blocks concatenated and cut at ``dim0`` rows are the full tensor."""
    out: List = [None] * len(tensors)
    batch = [(i, cast("DTensor", t)) for i, t in enumerate(tensors) if _dim0_sharded(t)]
    if batch:
        mesh = batch[0][1].device_mesh
        batch = [(i, t) for i, t in batch if t.device_mesh == mesh]
    for i, t in enumerate(tensors):
        if not any(i == j for j, _ in batch):
            out[i] = full_tensor(t)
    if not batch:
        return out
    group = mesh.get_group()
    n_ranks = dist.get_world_size(group)
    pieces, layout = [], []
    for i, t in batch:
        rows = -(-t.shape[0] // n_ranks) if t.shape[0] else 0
        row_numel = 1
        for d in t.shape[1:]:
            row_numel *= d
        local = t.to_local().detach().to(torch.float64).reshape(-1)
        padded = local.new_zeros(rows * row_numel)
        padded[:local.numel()] = local
        pieces.append(padded)
        layout.append((i, tuple(t.shape), rows * row_numel))
    flat = torch.cat(pieces)
    gathered = flat.new_empty(n_ranks * flat.numel())
    dist.all_gather_into_tensor(gathered, flat, group=group)
    gathered = gathered.view(n_ranks, -1)
    offset = 0
    for i, shape, numel in layout:
        block = gathered[:, offset:offset + numel].reshape((-1,) + shape[1:])
        out[i] = block[:shape[0]].cpu().clone()
        offset += numel
    return out


def strip_prefixes(name: str, prefixes: Iterable[str] = ("_module.", "_fsdp_wrapped_module.", "module.")) -> str:
    """A parameter name as the bare model names it (``fc1.weight``), wrapper prefixes removed."""
    changed = True
    while changed:
        changed = False
        for p in prefixes:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name.replace("._fsdp_wrapped_module", "").replace("._checkpoint_wrapped_module", "")


def gather_named(named: Iterable[Tuple[str, torch.nn.Parameter]], what: str) -> Dict[str, torch.Tensor]:
    """``{bare name: full float64 tensor}`` of ``what`` (``"grad"`` or ``"param"``); a missing
    gradient is reported as zeros (the parameter got no signal and no noise). One collective for
    all of FSDP2's shards (``full_tensors``)."""
    found = [(strip_prefixes(name), p, p if what == "param" else p.grad) for name, p in named]
    full = iter(full_tensors([t for _, _, t in found if t is not None]))
    return {name: next(full) if t is not None else torch.zeros(p.shape, dtype=torch.float64)
            for name, p, t in found}


def global_dataset(spec: RunSpec) -> models.Batch:
    """All steps' global batches concatenated: step ``k``'s sample ``i`` has index
    ``k * spec.global_batch_size + i`` (what a data loader over "the dataset" would index)."""
    from ..models.contract import cat_samples  # inputs may be a dict of tensors (docs/models.md)

    batches = [spec.global_batch(k) for k in range(spec.steps)]
    return models.Batch(cat_samples([b.inputs for b in batches]), torch.cat([b.targets for b in batches]),
                        batches[0].loss)


def dataset_index(spec: RunSpec) -> torch.Tensor:
    """The index column to carry through a dataset built from ``global_dataset``: row ``j`` is
    ``j``. A target reports what it processed by reading this column back from the batches its
    data path yields (``step_indices``), never by echoing ``spec.rank_indices``."""
    return torch.arange(spec.steps * spec.global_batch_size)


def step_indices(index_column: torch.Tensor, spec: RunSpec, step: int) -> List[int]:
    """The step's global sample indices (``0..global_batch_size-1``) of the rows a loader yielded
    at ``step``; a row from another step's batch comes out negative or too large, so the suite
    reports it as a foreign sample."""
    return [int(i) - step * spec.global_batch_size for i in index_column.reshape(-1)]


def local_batch(spec: RunSpec, step: int, rank: int, world_size: int) -> Tuple[List[int], models.Batch]:
    """``(indices, batch)``: the samples this rank processes at ``step``, and their global indices
    read back from the rows selected (an index column travels with the data)."""
    rows = torch.as_tensor(spec.rank_indices(step, rank, world_size), dtype=torch.long)
    return torch.arange(spec.global_batch_size)[rows].tolist(), spec.global_batch(step).select(rows)


__all__ = ["world", "device", "device_mesh", "numerics", "float32_numerics", "full_tensor", "full_tensors",
           "strip_prefixes", "gather_named", "global_dataset", "dataset_index", "step_indices", "local_batch"]


def tensor_parallel_plan(model: torch.nn.Module) -> dict:
    """The suite's tensor-parallel plan for ``parallelize_module``: every ``nn.Linear``
    column-parallel (weight and bias sharded on the output dim) with its output all-gathered
    (``output_layouts=Replicate()``), so every layer after it sees whole activations; every other
    parameter (norms, embeddings) is held whole by each TP peer. Column-parallel everywhere, not the
    colwise/rowwise pairs of a production plan: a row-parallel bias is a *replicated* DTensor, which
    opacus 1.6.0's ghost_tp refuses (docs/meshes.md)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    return {name: ColwiseParallel(output_layouts=Replicate()) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)}


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """Save an FSDP2 model's and its optimizer's state the way a user does under FSDP2:
    ``torch.distributed.checkpoint`` (each rank writes its own shards; a collective, so every rank
    calls it) of ``get_state_dict(model, optimizer)``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=directory)


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """Load what ``save_sharded`` wrote into a freshly built model and optimizer (same sharding)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: Dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def precision_policy(spec: RunSpec):
    """The ``mp_policy`` a user passes to every ``fully_shard`` call for ``spec.precision``:
    ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` under
    ``bf16-fsdp`` (forward/backward in bf16, gradients reduce-scattered and kept in float32);
    ``None`` otherwise (FSDP2's default policy: no casts)."""
    if spec.precision != "bf16-fsdp":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def precision_autocast(spec: RunSpec):
    """The context a user runs the forward and the loss in for ``spec.precision``:
    ``torch.autocast(<this rank's device type>, dtype=torch.bfloat16)`` under ``bf16-autocast``
    (float32 parameters, matmuls in bf16), a disabled autocast otherwise."""
    return torch.autocast(device().type, dtype=torch.bfloat16, enabled=spec.precision == "bf16-autocast")

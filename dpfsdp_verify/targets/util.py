"""Small helpers every target adapter needs on a rank: gather full tensors, pick a rank's samples.

They are plain functions of the ``RunSpec`` and the process group, so an adapter for a fork (or a
specimen in ``fixtures/``) reports exactly the same shapes and names as the built-in target.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch
import torch.distributed as dist

from .. import models
from .base import RunSpec


def world() -> Tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` when ``torch.distributed`` is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The un-sharded float64 copy of ``t`` (a DTensor is all-gathered: a collective, so every
    rank must call this for the same tensors in the same order)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to(torch.float64).clone()


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
    gradient is reported as zeros (the parameter got no signal and no noise)."""
    out = {}
    for name, p in named:
        if what == "param":
            out[strip_prefixes(name)] = full_tensor(p)
        else:
            g = p.grad
            out[strip_prefixes(name)] = full_tensor(g) if g is not None else torch.zeros(p.shape, dtype=torch.float64)
    return out


def global_dataset(spec: RunSpec) -> models.Batch:
    """All steps' global batches concatenated: step ``k``'s sample ``i`` has index
    ``k * spec.global_batch_size + i`` (what a data loader over "the dataset" would index)."""
    batches = [spec.global_batch(k) for k in range(spec.steps)]
    return models.Batch(torch.cat([b.inputs for b in batches]), torch.cat([b.targets for b in batches]),
                        batches[0].loss)


def local_batch(spec: RunSpec, step: int, rank: int, world_size: int) -> Tuple[List[int], models.Batch]:
    """``(indices, batch)``: the global indices this rank processes at ``step`` and those samples."""
    idx = spec.rank_indices(step, rank, world_size)
    return idx, spec.global_batch(step).select(idx)


def compute_loss_per_sample(outputs: torch.Tensor, batch: models.Batch, reduction: str) -> torch.Tensor:
    """``[b]`` per-sample losses with the reference's definition (see ``reference.per_sample_losses``)."""
    from ..reference import per_sample_losses

    return per_sample_losses(outputs, batch.targets, batch.loss, reduction)

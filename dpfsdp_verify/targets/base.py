"""The target contract: how the suite drives an implementation of DP training under FSDP.

A *target* is the implementation under test (upstream opacus, a fork, a specimen). The suite never
looks inside it; on every rank of a worker group (``torch.distributed`` initialised) it calls

    target.run(spec: RunSpec) -> RankOutput

and judges the outputs of all ranks against ``dpfsdp_verify.reference``. ``run`` must:

1. build the model ``models.build_model(spec.model, spec.model_seed, dtype, **dict(spec.model_kwargs))``
   on every rank and shard it the way the implementation does (FSDP2 ``fully_shard`` / ``FSDP2Wrapper``...);
2. for each step ``k`` take the global batch ``spec.global_batch(k)`` and feed this rank the
   samples ``spec.rank_indices(k, rank)`` (``split``: what a ``DistributedSampler`` over the
   global dataset gives, or the explicit per-rank split in ``spec.rank_batches``; ``replicated``:
   every sample on every rank), in that order;
3. take one DP step (clip with ``spec.max_grad_norm``, noise ``spec.noise_multiplier`` from a
   generator seeded with ``spec.noise_seed`` where the target supports one, loss reduction
   ``spec.reduction``, plain SGD with ``spec.lr``);
4. report, per step, a ``StepOutput``: the global indices of the samples it processed, the
   per-sample norms it *clipped with* (aligned with those indices), its loss, and the full
   (un-sharded) gradient after the DP step and parameters after the optimizer step, float64,
   keyed by the model's own parameter names (``fc1.weight``, no wrapper prefixes).

Third-party adapters: expose a ``Target`` subclass (or a zero-argument factory returning one)
and point the suite at it with ``--target package.module:Attr`` or the entry-point group
``dpfsdp_verify.targets`` (name -> ``module:attr``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

import torch

from .. import models

DATA_LAYOUTS = ("replicated", "split")
#: upstream opacus' FSDP ghost-clipping mode: what the suite runs unless told otherwise
DEFAULT_GRAD_SAMPLE_MODE = "ghost_fsdp"


@dataclass(frozen=True)
class RunSpec:
    """Everything a target needs to run one configuration; picklable, identical on every rank."""

    model: str = "mlp"
    model_seed: int = 0
    global_batch_size: int = 8
    batch_seed: int = 1
    data_layout: str = "split"
    reduction: str = "mean"
    max_grad_norm: float = 1.0
    noise_multiplier: float = 0.0
    noise_seed: int = 1234
    steps: int = 1
    lr: float = 0.5
    grad_sample_mode: str = DEFAULT_GRAD_SAMPLE_MODE
    dtype: str = "float64"
    #: explicit uneven split: ``rank_batches[k][r]`` = global indices rank r gets at step k
    rank_batches: Optional[tuple] = None
    #: free-form options a target may read (a fork's flags); never required
    options: tuple = ()
    #: model (and batch) dimensions, sorted ``(key, value)`` pairs of ``models.MODEL_DIMS[model]``
    #: (e.g. ``(("hidden", 3),)``); ``()`` is the default model. Used by ``global_batch`` and by
    #: targets when they build the model.
    model_kwargs: tuple = ()

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def global_batch(self, step: int = 0) -> models.Batch:
        return models.make_batch(self.model, self.global_batch_size, self.batch_seed + step, dtype=self.torch_dtype,
                                 **dict(self.model_kwargs))

    def rank_indices(self, step: int, rank: int, world_size: int) -> List[int]:
        """Global sample indices rank ``rank`` processes at ``step``, in order."""
        if self.rank_batches is not None:
            return list(self.rank_batches[step][rank])
        if self.data_layout == "replicated":
            return list(range(self.global_batch_size))
        # DistributedSampler(shuffle=False, drop_last=False) on a divisible batch
        return list(range(rank, self.global_batch_size, world_size))

    def with_(self, **changes) -> "RunSpec":
        return replace(self, **changes)


@dataclass
class StepOutput:
    indices: List[int]
    norms: Optional[torch.Tensor]          # [len(indices)], or None if the target cannot report them
    loss: float
    gradient: Dict[str, torch.Tensor] = field(default_factory=dict)
    parameters: Dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class RankOutput:
    rank: int
    world_size: int
    steps: List[StepOutput] = field(default_factory=list)


class Target:
    """Base class of adapters. Subclasses set ``name`` and implement ``run``."""

    name: str = "target"

    def version(self) -> str:
        return "unknown"

    def run(self, spec: RunSpec) -> RankOutput:  # pragma: no cover - interface
        raise NotImplementedError

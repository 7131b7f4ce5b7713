"""The built-in target: whatever ``opacus`` is importable, driven only through its public API.

On each rank: ``FSDP2Wrapper(model)`` -> ``PrivacyEngine().make_private(...,
grad_sample_mode=spec.grad_sample_mode, poisson_sampling=False, noise_generator=<seeded>)`` ->
``loss = criterion(...)``; ``loss.backward()`` (ghost clipping's two backward passes) ->
``optimizer.step()``. This is how a user trains, so the suite judges what a user gets.

Data is fed the way opacus expects under FSDP (``make_private`` divides the expected batch size
by the world size): a ``DataLoader`` over the *global* dataset (all steps' global batches
concatenated) with a ``DistributedSampler`` for split data, or -- for ``spec.rank_batches`` -- a
batch sampler that yields exactly the requested global indices. Replicated data is a plain
``DataLoader`` of the whole global batch on every rank; opacus defines a DP *step* only for split
data (see ``properties``), but its per-sample norms are well defined for both layouts.

Fork switches (``OPACUS_USE_DEFERRED_NORM``...) are environment variables of the worker group, not
arguments here.
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn as nn

from .. import models
from .base import RankOutput, RunSpec, StepOutput, Target
from .util import dataset_index, gather_named, global_dataset, step_indices, world


class _ExactBatches(torch.utils.data.Sampler):
    """A batch sampler yielding the given lists of dataset indices, in order (may be empty)."""

    def __init__(self, batches: List[List[int]]):
        self.batches = [list(b) for b in batches]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


class OpacusTarget(Target):
    name = "opacus"

    def version(self) -> str:
        import opacus

        return getattr(opacus, "__version__", "unknown")

    def _data_loader(self, spec: RunSpec, dataset, rank: int, world_size: int):
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        b = spec.global_batch_size
        if spec.rank_batches is not None:
            batches = [[k * b + i for i in spec.rank_indices(k, rank, world_size)] for k in range(spec.steps)]
            return DataLoader(dataset, batch_sampler=_ExactBatches(batches), collate_fn=_Collate(dataset))
        if spec.data_layout == "replicated":
            return DataLoader(dataset, batch_size=b, shuffle=False)
        if b % world_size:
            raise ValueError(f"split data needs global_batch_size divisible by world_size "
                             f"({b} % {world_size} != 0); pass rank_batches for an uneven split")
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
        return DataLoader(dataset, batch_size=b // world_size, sampler=sampler)

    def run(self, spec: RunSpec) -> RankOutput:
        from opacus import PrivacyEngine
        from opacus.utils.fsdp_utils import FSDP2Wrapper
        from torch.utils.data import TensorDataset

        rank, world_size = world()
        model = models.build_model(spec.model, spec.model_seed, dtype=spec.torch_dtype, **dict(spec.model_kwargs))
        fsdp = FSDP2Wrapper(model)
        optimizer = torch.optim.SGD(fsdp.parameters(), lr=spec.lr)
        data = global_dataset(spec)
        # the index column travels with each sample: the indices reported are the ones the loader yielded
        loader = self._data_loader(spec, TensorDataset(data.inputs, data.targets, dataset_index(spec)), rank,
                                   world_size)
        criterion = nn.CrossEntropyLoss(reduction=spec.reduction)
        generator = torch.Generator().manual_seed(spec.noise_seed)
        module, optimizer, criterion, loader = PrivacyEngine().make_private(
            module=fsdp, optimizer=optimizer, criterion=criterion, data_loader=loader,
            noise_multiplier=spec.noise_multiplier, max_grad_norm=spec.max_grad_norm,
            poisson_sampling=False, grad_sample_mode=spec.grad_sample_mode, loss_reduction=spec.reduction,
            noise_generator=generator)
        module.train()
        out = RankOutput(rank=rank, world_size=world_size)
        for k, (x, y, index) in enumerate(loader):
            optimizer.zero_grad()
            logits = module(x)
            if data.loss == "token_cross_entropy":
                # privacy unit = the sequence: opacus needs the [B, T, V] shape to regroup tokens
                loss = criterion(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), shape=logits.shape)
            else:
                loss = criterion(logits, y)
            loss.backward()
            norms = getattr(module, "per_sample_gradient_norms", None)
            norms = None if norms is None else norms.detach().to(torch.float64).reshape(-1).clone()
            optimizer.step()
            named = list(module.named_parameters())
            out.steps.append(StepOutput(
                indices=step_indices(index, spec, k), norms=norms, loss=float(loss.item()),
                gradient=gather_named(named, "grad"), parameters=gather_named(named, "param")))
        return out


class _Collate:
    """Stack samples; an empty index list gives zero-length tensors of the right trailing shape
    (the default collate cannot), so an empty local batch reaches the implementation."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __call__(self, samples):
        if not samples:
            return tuple(t[:0] for t in self.dataset.tensors)
        return tuple(torch.stack([s[j] for s in samples]) for j in range(len(samples[0])))

"""What the built-in models and the models of one's own share: the ``Batch`` a model is fed, and the
one lock held while a model's parameters are drawn from torch's default generator. A leaf module
(``builtin.py`` and ``contract.py`` both import it; it imports neither)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

#: held while a model's parameters are drawn from torch's default generator (``builtin.build_model``,
#: ``contract.build_model``): two threads building models at once would otherwise interleave its draws
DEFAULT_GENERATOR = threading.Lock()


def seed_cpu(seed: int) -> None:
    """Seed torch's default CPU generator only: what a model built on the CPU draws from.
    ``torch.manual_seed`` seeds every device too, and before CUDA (or XPU, MTIA) is initialised it
    queues each of those seeds with a formatted stack of the caller: 0.5-5 ms a call, ~1/6 of a
    fuzz example's main-process time at 2 ranks. It also reseeds an initialised GPU's generator,
    which the callers' ``fork_rng(devices=[])`` does not restore: a model build should not move a
    device's random stream."""
    torch.default_generator.manual_seed(seed)


@dataclass
class Batch:
    """A batch: ``inputs`` and ``targets`` share dim 0; ``loss`` is ``"cross_entropy"``
    (one label per sample) or ``"token_cross_entropy"`` (labels [B, T], ``IGNORE_INDEX`` masks
    positions; the privacy unit is the whole sequence). A model of one's own (``docs/models.md``):
    ``inputs`` may be a ``contract.SampleInputs`` (a dict of tensors indexed along dim 0) and ``loss``
    is its ``contract.ContractLoss`` (callable: the model's own per-sample loss)."""

    inputs: Any
    targets: torch.Tensor
    loss: Any

    def __len__(self):
        return self.inputs.shape[0]

    def select(self, index) -> "Batch":
        """The rows ``index`` (a list/tensor of sample indices, may be empty)."""
        index = torch.as_tensor(index, dtype=torch.long)
        return Batch(self.inputs[index], self.targets[index], self.loss)


__all__ = ["Batch", "DEFAULT_GENERATOR"]

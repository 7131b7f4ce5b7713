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

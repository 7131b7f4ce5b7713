"""Models given by their own code (``docs/models.md``): ``--models package.module:ATTR``, or a short
name of ``catalog.CONTRACT_MODELS``. ATTR is a class or zero-argument factory giving an object with

* ``build(seed) -> torch.nn.Module`` -- the same weights for the same seed;
* ``batch(n, seed) -> (inputs, targets)`` -- ``inputs`` a tensor, or a dict of keyword tensors, whose
  dim 0 is the sample; ``targets`` a tensor whose dim 0 is the sample;
* ``loss(output, targets) -> tensor [n]`` -- the per-sample losses (the privacy unit is one sample).

Nothing of the suite is imported by such a model. Here it is turned into what the rest of the
suite already knows: ``build_model`` (the module, its forward taking a dict of inputs as keywords,
in the run's dtype) and ``make_batch`` (a ``Batch`` whose ``loss`` is a ``ContractLoss``, which
``reference.per_sample_losses`` and ``ContractCriterion`` call). A dict of inputs travels as
``SampleInputs``: indexed and sliced along dim 0 like a tensor, so batches are split over ranks and
into samples without knowing what is inside.

A contract that cannot be used raises ``ContractError`` with one line (the gate: exit 2).
"""

from __future__ import annotations

import importlib
import threading
import types
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Tuple

import torch
import torch.nn as nn

from .batch import DEFAULT_GENERATOR, Batch
from .catalog import contract_path
from .errors import ContractError, Float64Unsupported

#: the contract's methods (``docs/models.md``)
METHODS = ("build", "batch", "loss")


class SampleInputs(Mapping):
    """A dict of keyword tensors that indexes like a tensor along dim 0 (the sample): ``x[i]``,
    ``x[a:b]``, ``x[index]`` give every tensor's rows; ``x["name"]`` one tensor. ``len`` and
    ``shape[0]`` are the number of samples; ``to(dtype)`` casts the floating tensors only."""

    def __init__(self, tensors):
        self._tensors: Dict[str, torch.Tensor] = dict(tensors)

    def __getitem__(self, key):
        if isinstance(key, str):
            return self._tensors[key]
        return SampleInputs({k: v[key] for k, v in self._tensors.items()})

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    def keys(self):
        return self._tensors.keys()

    def items(self):
        return self._tensors.items()

    def values(self):
        return self._tensors.values()

    @property
    def shape(self) -> torch.Size:
        """``[samples]`` (``[]`` for one sample taken by an integer index)."""
        first = next(iter(self._tensors.values()))
        return torch.Size(first.shape[:1])

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def is_floating_point(self) -> bool:
        return any(v.is_floating_point() for v in self._tensors.values())

    def to(self, *args, **kwargs) -> "SampleInputs":
        """Every tensor moved (a device), the floating ones also cast (a dtype)."""
        plain = [a for a in args if not isinstance(a, torch.dtype)]
        rest = {k: v for k, v in kwargs.items() if k != "dtype"}
        return SampleInputs({k: v.to(*args, **kwargs) if v.is_floating_point() else v.to(*plain, **rest)
                             for k, v in self._tensors.items()})

    def __repr__(self) -> str:
        return "SampleInputs(" + ", ".join(f"{k}={tuple(v.shape)}" for k, v in self._tensors.items()) + ")"


def stack_samples(samples: List[Any]):
    """``torch.stack`` of samples that may be ``SampleInputs`` (a collate of single samples)."""
    if isinstance(samples[0], SampleInputs):
        return SampleInputs({k: torch.stack([s[k] for s in samples]) for k in samples[0].keys()})
    return torch.stack(samples)


def cat_samples(parts: List[Any]):
    """``torch.cat`` along dim 0 of batches' inputs that may be ``SampleInputs``."""
    if parts and isinstance(parts[0], SampleInputs):
        return SampleInputs({k: torch.cat([p[k] for p in parts]) for k in parts[0].keys()})
    return torch.cat(parts)


class ContractLoss:
    """A contract model's per-sample loss: ``loss(output, targets)``, checked to be ``[n]``. Equal to
    another one of the same model name (it travels inside every ``Batch`` of that model)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, outputs, targets: torch.Tensor) -> torch.Tensor:
        out = load(self.name).loss(outputs, targets)
        n = targets.shape[0]
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (n,):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ContractError(f"model {self.name}: loss(output, targets) gave {got}, not per-sample losses of "
                                f"shape ({n},) (docs/models.md)")
        return out

    def __eq__(self, other) -> bool:
        return isinstance(other, ContractLoss) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("contract", self.name))

    def __repr__(self) -> str:
        return f"loss of {self.name}"


class ContractCriterion(nn.Module):
    """A criterion module over a contract loss, for an adapter that hands one to its library (opacus'
    ``make_private``): ``reduction`` ``"none"`` gives the per-sample losses, else their mean or sum."""

    def __init__(self, loss: ContractLoss, reduction: str = "mean"):
        super().__init__()
        self.loss, self.reduction = loss, reduction

    def forward(self, outputs, targets: torch.Tensor) -> torch.Tensor:
        losses = self.loss(outputs, targets)
        if self.reduction == "none":
            return losses
        return losses.mean() if self.reduction == "mean" else losses.sum()


_LOADED: Dict[str, Any] = {}
_LOCK = threading.RLock()


def load(name: str) -> Any:
    """The contract object of model ``name`` (imported and made once per process)."""
    with _LOCK:
        if name not in _LOADED:
            _LOADED[name] = _make(name)
        return _LOADED[name]


def _make(name: str) -> Any:
    path = contract_path(name)
    if path is None:
        raise ContractError(f"model {name!r} is not given by the contract (package.module:ATTR, docs/models.md)")
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's, said in one line
        raise ContractError(f"model {name}: cannot import {module_name!r}: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ContractError(f"model {name}: {module_name!r} has no attribute {attr!r}") from None
        obj = getattr(obj, part)
    if not callable(obj):
        raise ContractError(f"model {name}: {attr} is a {type(obj).__name__}, not a class or zero-argument factory")
    try:
        made = obj()
    except Exception as e:  # noqa: BLE001
        raise ContractError(f"model {name}: {attr}() raised {type(e).__name__}: {e}") from None
    missing = [m for m in METHODS if not callable(getattr(made, m, None))]
    if missing:
        raise ContractError(f"model {name}: {attr}() gave a {type(made).__name__} without method(s) "
                            f"{', '.join(missing)} (a model needs build(seed), batch(n, seed), loss(output, targets): "
                            "docs/models.md)")
    return made


def _forward(self, *args, **kwargs):
    """The module's own forward; a ``SampleInputs`` given alone is passed as keyword arguments."""
    if len(args) == 1 and not kwargs and isinstance(args[0], SampleInputs):
        return type(self).forward(self, **args[0])
    return type(self).forward(self, *args, **kwargs)


def build_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``build(seed)`` of model ``name`` in ``dtype``, under torch's default generator seeded with
    ``seed`` too (a ``build`` that draws from it is then seeded all the same)."""
    obj = load(name)
    with DEFAULT_GENERATOR, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = obj.build(seed)
        except Exception as e:  # noqa: BLE001
            raise ContractError(f"model {name}: build({seed}) raised {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ContractError(f"model {name}: build({seed}) gave a {type(model).__name__}, not a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise ContractError(f"model {name}: build({seed}) gave a module with no trainable parameter")
    # a dict of inputs reaches the module's forward as keywords, whatever wraps it later (FSDP, opacus)
    model.forward = types.MethodType(_forward, model)
    try:
        return model.to(dtype)
    except Exception as e:  # noqa: BLE001
        if dtype == torch.float64:
            raise Float64Unsupported(f"model {name}: .to(float64) raised {type(e).__name__}: {e}") from None
        raise ContractError(f"model {name}: .to({dtype}) raised {type(e).__name__}: {e}") from None


def make_batch(name: str, batch_size: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    """``batch(batch_size, seed)`` of model ``name`` as a ``Batch`` (floating tensors in ``dtype``),
    checked: inputs a tensor or a dict of tensors, every dim 0 and the targets' ``batch_size``."""
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    try:
        got = load(name).batch(batch_size, seed)
    except Exception as e:  # noqa: BLE001
        raise ContractError(f"model {name}: batch({batch_size}, {seed}) raised {type(e).__name__}: {e}") from None
    if not isinstance(got, tuple) or len(got) != 2:
        raise ContractError(f"model {name}: batch(n, seed) must return (inputs, targets), got a "
                            f"{type(got).__name__}")
    inputs, targets = got
    if isinstance(inputs, Mapping):
        tensors = dict(inputs)
        if not tensors or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
            raise ContractError(f"model {name}: batch(n, seed) inputs must be a tensor or a non-empty dict of "
                                "keyword -> tensor")
        inputs = SampleInputs({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()})
        dims = {k: _dim0(v) for k, v in tensors.items()}
    elif isinstance(inputs, torch.Tensor):
        inputs = inputs.to(dtype) if inputs.is_floating_point() else inputs
        dims = {"inputs": _dim0(inputs)}
    else:
        raise ContractError(f"model {name}: batch(n, seed) inputs must be a tensor or a dict of tensors, got a "
                            f"{type(inputs).__name__}")
    if not isinstance(targets, torch.Tensor):
        raise ContractError(f"model {name}: batch(n, seed) targets must be a tensor, got a {type(targets).__name__}")
    dims["targets"] = _dim0(targets)
    wrong = {k: d for k, d in dims.items() if d != batch_size}
    if wrong:
        raise ContractError(f"model {name}: batch({batch_size}, {seed}) gave dim 0 "
                            + ", ".join(f"{k}={d}" for k, d in wrong.items()) + f", not {batch_size}")
    targets = targets.to(dtype) if targets.is_floating_point() else targets
    return Batch(inputs, targets, ContractLoss(name))


def _dim0(t: torch.Tensor):
    return t.shape[0] if t.dim() else None


def check(name: str) -> Tuple[int, int]:
    """Use model ``name`` once as a run would (build, a batch of 2, forward, loss in float64 and
    float32): ``ContractError`` naming what is wrong. Returns ``(parameters, trainable)``."""
    model = build_model(name, 0, torch.float32)
    batch = make_batch(name, 2, 0, torch.float32)
    _forward_loss(name, model, batch)
    total = sum(p.numel() for p in model.parameters())
    return total, sum(p.numel() for p in model.parameters() if p.requires_grad)


def _forward_loss(name: str, model: nn.Module, batch) -> torch.Tensor:
    try:
        out = model(batch.inputs)
    except Exception as e:  # noqa: BLE001
        raise ContractError(f"model {name}: the forward of a batch of {len(batch)} raised {type(e).__name__}: "
                            f"{e}") from None
    try:
        return batch.loss(out, batch.targets)
    except ContractError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ContractError(f"model {name}: loss(output, targets) raised {type(e).__name__}: {e}") from None


def float64_problem(name: str) -> str:
    """Why model ``name`` cannot give a float64 reference ('' when it can): it is built, a batch of 2
    drawn, its loss computed and differentiated in float64."""
    try:
        model = build_model(name, 0, torch.float64)
        with torch.enable_grad():
            loss = _forward_loss(name, model, make_batch(name, 2, 0, torch.float64))
            torch.autograd.grad(loss.sum(), [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    except (Float64Unsupported, ContractError) as e:
        return str(e)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        return f"model {name}: the backward in float64 raised {type(e).__name__}: {str(e).splitlines()[0]}"
    return ""


__all__ = ["METHODS", "ContractError", "Float64Unsupported", "SampleInputs", "stack_samples", "cat_samples",
           "ContractLoss",
           "ContractCriterion", "load", "build_model", "make_batch", "check", "float64_problem"]

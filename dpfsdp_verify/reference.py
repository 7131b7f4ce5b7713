"""Ground truth on one process: float64 per-sample gradients and norms, clipping, the DP-SGD step.

Everything here is deliberately obvious. ``per_sample_grads(..., method="loop")`` runs autograd
once per sample; ``method="vmap"`` (the default, the fast path) uses ``torch.func`` and is tested
against the loop. All arithmetic is float64 whatever the model's dtype.

Definitions (they follow opacus 1.6.0, so that a correct opacus matches to float64 rounding):

* the *per-sample loss* ``l_i``: cross-entropy of sample ``i``; for a token model (privacy unit
  = one sequence) the sum over the sequence's non-ignored tokens (``reduction="sum"``) or their
  mean (``reduction="mean"``), as ``DPLossFastGradientClipping(..., shape=)`` computes it;
* the *per-sample gradient* ``g_i = d l_i / d theta`` and its norm ``||g_i||_2`` over all
  parameters. It does not depend on the batch reduction: opacus rescales backprops by the batch
  size under ``"mean"`` so that norms are those of ``l_i``;
* the *clip coefficient* ``c_i = min(1, C / (||g_i|| + CLIP_EPSILON))`` with ``CLIP_EPSILON =
  1e-6`` (opacus' ``get_clipping_coef``; the epsilon keeps a zero gradient finite and makes a
  sample exactly at the bound scale by ``C/(C+1e-6)``, not 1). DP-SGD's own coefficient is
  ``min(1, C/||g_i||)``; an epsilon only clips harder, so the checks accept any epsilon from 0 to
  ``MAX_CLIP_EPSILON`` (``clip_epsilon=`` below; ``clipfit.fit_clip_epsilon``);
* the *DP-SGD gradient* ``(sum_i c_i g_i + sigma * C * z) / D`` with ``z`` standard normal per
  coordinate drawn from an explicit generator and ``D`` the expected batch size under
  ``"mean"`` (1 under ``"sum"``).

Config mistakes raise ``ReferenceInputError`` subclasses with a message naming the problem
(unsupported layer, empty batch, mismatched batch sizes), never an error from deep inside torch.

Fine-tuning (``docs/finetune.md``): only parameters with ``requires_grad`` have per-sample
gradients; norms, clipping and noise are over those alone, and a frozen parameter never moves.
A parameter used in several places (tied weights: one tensor under several names, e.g. an LM
head that is its token embedding) is one parameter: its per-sample gradient is the *sum* over its
uses, and it appears once, under its first name (``named_parameters()``). Both methods get that
sum from autograd itself; ``per_use_grads`` unties the model to show each use on its own (the
sum of the uses is tested against the tied gradient).

Your own model (``docs/models.md``): a batch whose ``loss`` is callable is of a model given by its
own code (``models.contract``). Its per-sample loss is the model's own ``loss(output, targets)``,
and its per-sample gradients are the loop's -- each sample's inputs sliced along dim 0, alone
through forward and autograd -- with no knowledge of the layers inside (no ``SUPPORTED_LAYERS``
check: what the target cannot do with them is the target's verdict).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config.defaults import CLIP_EPSILON, MAX_CLIP_EPSILON  # the clip form's constants, defined torch-free
from .models import IGNORE_INDEX, Batch

#: Layers opacus 1.6.0 can sample (grad sampler or ghost norm sampler) that matter for FSDP
#: models. A module with parameters of any other type is refused: the reference would happily
#: compute its per-sample gradients, but then it would check something opacus cannot do.
SUPPORTED_LAYERS = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm,
                    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)

LOSSES = ("cross_entropy", "token_cross_entropy")
REDUCTIONS = ("mean", "sum")

Grads = Dict[str, torch.Tensor]


class ReferenceInputError(ValueError):
    """A model or batch the reference cannot give ground truth for; the message says why."""


class UnsupportedLayerError(ReferenceInputError):
    pass


class BatchError(ReferenceInputError):
    pass


def is_contract(batch: Batch) -> bool:
    """Whether ``batch`` is of a model given by its own code (``docs/models.md``): its loss is the
    model's own, and the reference knows nothing of its layers (module docstring, "Your own model")."""
    return callable(batch.loss)


def check_model(model: nn.Module) -> None:
    """Raise ``UnsupportedLayerError`` if the model is out of scope. Tied parameters are in scope
    (module docstring: their per-sample gradient is the sum over their uses)."""
    for name, module in model.named_modules():
        # Checked before the parameter test: BatchNorm(affine=False) holds no parameters, yet in
        # training mode it couples the samples of a batch, so per-sample gradients do not exist
        # (opacus refuses it too) and torch would fail deep inside the loop or vmap.
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise UnsupportedLayerError(
                f"layer {name or '<root>'!r} of type {type(module).__name__} normalises over the batch, so "
                "samples are not independent and per-sample gradients are undefined; it is not supported "
                "(use GroupNorm or LayerNorm)"
            )
        if any(True for _ in module.parameters(recurse=False)) and not isinstance(module, SUPPORTED_LAYERS):
            raise UnsupportedLayerError(
                f"layer {name or '<root>'!r} of type {type(module).__name__} holds parameters but is not "
                f"supported; supported layers: {', '.join(t.__name__ for t in SUPPORTED_LAYERS)}"
            )


def check_batch(batch: Batch, reduction: str = "mean") -> None:
    """Raise ``BatchError`` (or ``ReferenceInputError``) for a batch the reference cannot use."""
    if reduction not in REDUCTIONS:
        raise ReferenceInputError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not is_contract(batch) and batch.loss not in LOSSES:
        raise ReferenceInputError(f"loss must be one of {LOSSES}, got {batch.loss!r}")
    n_in, n_t = batch.inputs.shape[0], batch.targets.shape[0]
    if n_in != n_t:
        raise BatchError(f"inputs have batch size {n_in} but targets have {n_t}; they must match")
    if n_in == 0:
        raise BatchError("batch is empty (batch size 0): per-sample gradients need at least one sample")


def per_sample_losses(outputs: torch.Tensor, targets: torch.Tensor, loss: str, reduction: str) -> torch.Tensor:
    """``[B]`` per-sample losses ``l_i`` (see module docstring); ``loss`` a callable: the model's own
    (``models.contract.ContractLoss``, whatever the reduction)."""
    if callable(loss):
        return loss(outputs, targets)
    if loss == "cross_entropy":
        return F.cross_entropy(outputs, targets, reduction="none")
    if loss == "token_cross_entropy":
        b, t = targets.shape
        tok = F.cross_entropy(outputs.reshape(b * t, outputs.shape[-1]), targets.reshape(-1), reduction="none",
                              ignore_index=IGNORE_INDEX).view(b, t)
        if reduction == "sum":
            return tok.sum(dim=1)
        valid = (targets != IGNORE_INDEX).sum(dim=1).clamp(min=1)
        return tok.sum(dim=1) / valid
    raise ReferenceInputError(f"loss must be one of {LOSSES}, got {loss!r}")


def batch_loss(per_sample: torch.Tensor, reduction: str) -> torch.Tensor:
    """The reduced training loss: mean or sum of the per-sample losses."""
    return per_sample.mean() if reduction == "mean" else per_sample.sum()


def as_float64(model: nn.Module, batch: Batch, dtype: torch.dtype = torch.float64, own: bool = False):
    """A float64 (or ``dtype``) deep copy of ``model`` and ``batch`` (integer inputs such as token ids
    stay). ``own``: the caller hands ``model`` over and never uses it again, so it is converted in place,
    not copied (a deep copy costs more than building a small model afresh)."""
    m = (model if own else copy.deepcopy(model)).to(dtype)
    x = batch.inputs.to(dtype) if batch.inputs.is_floating_point() else batch.inputs
    return m, Batch(x, batch.targets, batch.loss)


def per_sample_grads(model: nn.Module, batch: Batch, reduction: str = "mean", method: str = "vmap",
                     dtype: torch.dtype = torch.float64, own: bool = False) -> Grads:
    """float64 per-sample gradients ``{param name: [B, *param.shape]}`` of the per-sample losses,
    for the parameters with ``requires_grad`` (a tied one once, under its first name, summed over
    its uses).

    ``method="loop"`` is the obvious one (autograd per sample); ``"vmap"`` is ``torch.func``.
    ``dtype``: compute in another precision instead (float32: how much rounding the model's own
    arithmetic leaves in its gradients, ``clipfit.rounding_floor``). ``own``: the caller hands
    ``model`` over (a model built for this call alone): it is used, not copied (``as_float64``).
    Raises ``ReferenceInputError`` subclasses for out-of-scope models or bad batches.
    """
    check_batch(batch, reduction)
    if is_contract(batch):  # any layers: one autograd pass per sample, whatever they are
        return _contract_grads(model, batch, reduction, dtype)
    check_model(model)
    m, b = as_float64(model, batch, dtype, own)
    m.train()
    if method == "loop":
        return _per_sample_grads_loop(m, b, reduction)
    if method == "vmap":
        return _per_sample_grads_vmap(m, b, reduction)
    raise ValueError(f"method must be 'loop' or 'vmap', got {method!r}")


def _per_sample_grads_loop(m: nn.Module, b: Batch, reduction: str) -> Grads:
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    params = [p for p in m.parameters() if p.requires_grad]
    rows: List[List[torch.Tensor]] = []
    for i in range(len(b)):
        out = m(b.inputs[i:i + 1])
        l_i = per_sample_losses(out, b.targets[i:i + 1], b.loss, reduction)[0]
        g = torch.autograd.grad(l_i, params, allow_unused=True)
        rows.append([torch.zeros_like(p) if gi is None else gi for p, gi in zip(params, g)])
    return {n: torch.stack([r[j] for r in rows]) for j, n in enumerate(names)}


def _contract_grads(model: nn.Module, batch: Batch, reduction: str, dtype: torch.dtype) -> Grads:
    """The loop over a model of its own: every sample's inputs sliced along dim 0 (a tensor, or every
    tensor of a dict), its loss and gradient alone. A model that cannot run in ``dtype`` raises
    ``Float64Unsupported`` (its verdicts skip, saying why)."""
    from .models.contract import Float64Unsupported, float64_problem

    try:
        m, b = as_float64(model, batch, dtype)
        m.train()
        with torch.enable_grad():  # a caller may judge under no_grad
            return _per_sample_grads_loop(m, b, reduction)
    except (RuntimeError, TypeError, NotImplementedError):
        problem = float64_problem(batch.loss.name) if dtype == torch.float64 else ""
        if not problem:
            raise
        raise Float64Unsupported(problem) from None


def _per_sample_grads_vmap(m: nn.Module, b: Batch, reduction: str) -> Grads:
    from torch.func import functional_call, grad, vmap

    params = {n: p.detach() for n, p in m.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in m.named_parameters() if not p.requires_grad}

    def loss_one(p, x, y):
        out = functional_call(m, {**p, **frozen}, (x.unsqueeze(0),))
        return per_sample_losses(out, y.unsqueeze(0), b.loss, reduction)[0]

    return vmap(grad(loss_one), in_dims=(None, 0, 0))(params, b.inputs, b.targets)


def tied_names(model: nn.Module) -> Dict[str, List[str]]:
    """``{first name: [every name]}`` for each parameter registered under more than one name."""
    names: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {group[0]: group for group in names.values() if len(group) > 1}


def untie(model: nn.Module) -> nn.Module:
    """A copy of ``model`` in which every use of a tied parameter (each name it is registered
    under) is a separate parameter with the same values and ``requires_grad``."""
    m = copy.deepcopy(model)
    for group in tied_names(m).values():
        for name in group[1:]:
            owner, _, attr = name.rpartition(".")
            module = m.get_submodule(owner) if owner else m
            p = getattr(module, attr)
            setattr(module, attr, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
    return m


def per_use_grads(model: nn.Module, batch: Batch, reduction: str = "mean", method: str = "vmap") -> Grads:
    """float64 per-sample gradients with each use of a tied parameter apart, keyed by the name of
    the use (``tok.weight`` for the embedding's use, ``head.weight`` for the head's): the
    per-sample gradients of ``untie(model)``. Summed over the names of a tied group they are the
    tied parameter's per-sample gradient (``per_sample_grads``)."""
    return per_sample_grads(untie(model), batch, reduction, method)


def with_all_trainable(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose frozen parameters are trainable too (what a target that forgets
    ``requires_grad`` computes): for diagnosing norms that include frozen parameters."""
    m = copy.deepcopy(model)
    for p in m.parameters():
        p.requires_grad_(True)
    return m


def per_sample_norms(grads: Grads) -> torch.Tensor:
    """``[B]`` L2 norms of each sample's gradient over all parameters together."""
    sq = cast(torch.Tensor, sum(g.reshape(g.shape[0], -1).pow(2).sum(dim=1) for g in grads.values()))
    return sq.sqrt()


def clip_coefficients(norms: torch.Tensor, max_grad_norm: float, epsilon: float = CLIP_EPSILON) -> torch.Tensor:
    """``min(1, C / (norm + epsilon))`` per sample (opacus' ``get_clipping_coef`` at the default
    epsilon; ``epsilon=0`` is DP-SGD's ``min(1, C/norm)``, with a zero norm left unscaled)."""
    if max_grad_norm <= 0:
        raise ReferenceInputError(f"max_grad_norm must be > 0, got {max_grad_norm}")
    return (max_grad_norm / (norms + epsilon).clamp_min(1e-300)).clamp(max=1.0)


def clipped_sum(grads: Grads, coefficients: torch.Tensor) -> Grads:
    """``sum_i c_i g_i`` per parameter."""
    return {n: torch.einsum("b,b...->...", coefficients.to(g.dtype), g) for n, g in grads.items()}


def noise_like(grads: Grads, std: float, generator: Optional[torch.Generator]) -> Grads:
    """Independent N(0, std^2) per coordinate, drawn in parameter order from ``generator``."""
    return {n: torch.normal(0.0, std, size=g.shape[1:], generator=generator, dtype=torch.float64)
            if std > 0 else torch.zeros(g.shape[1:], dtype=torch.float64) for n, g in grads.items()}


@dataclass
class DPStep:
    """Everything the reference DP-SGD step computed, float64."""

    norms: torch.Tensor          # [B] per-sample gradient norms
    coefficients: torch.Tensor   # [B] clip coefficients
    clipped_sum: Grads           # sum_i c_i g_i
    noise: Grads                 # sigma * C * z (before division)
    gradient: Grads              # (clipped_sum + noise) / D
    loss: float                  # reduced batch loss at the current parameters


def dp_sgd_gradient(model: nn.Module, batch: Batch, *, max_grad_norm: float, noise_multiplier: float = 0.0,
                    reduction: str = "mean", expected_batch_size: Optional[int] = None,
                    generator: Optional[torch.Generator] = None, method: str = "vmap",
                    clip_epsilon: float = CLIP_EPSILON) -> DPStep:
    """The reference DP-SGD gradient for one batch (see module docstring).

    ``expected_batch_size`` defaults to ``len(batch)``; it is the divisor under ``"mean"``.
    ``clip_epsilon`` is the epsilon in the clip coefficient's denominator (``clip_coefficients``).
    """
    if noise_multiplier < 0:
        raise ReferenceInputError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
    grads = per_sample_grads(model, batch, reduction, method)
    norms = per_sample_norms(grads)
    coef = clip_coefficients(norms, max_grad_norm, clip_epsilon)
    summed = clipped_sum(grads, coef)
    noise = noise_like(grads, noise_multiplier * max_grad_norm, generator)
    divisor = 1.0
    if reduction == "mean":
        divisor = float(expected_batch_size if expected_batch_size is not None else len(batch))
        if divisor <= 0:
            raise ReferenceInputError(f"expected_batch_size must be > 0, got {expected_batch_size}")
    gradient = {n: (summed[n] + noise[n]) / divisor for n in summed}
    with torch.no_grad():
        m, b = as_float64(model, batch)
        loss = batch_loss(per_sample_losses(m(b.inputs), b.targets, b.loss, reduction), reduction).item()
    return DPStep(norms, coef, summed, noise, gradient, loss)


@dataclass
class Trajectory:
    losses: List[float]                 # reduced batch loss before each step
    parameters: Dict[str, torch.Tensor]  # float64, after the last step
    #: float64 parameters after each step, in order (``steps[-1]`` is ``parameters``)
    steps: List[Dict[str, torch.Tensor]] = field(default_factory=list)


def dp_sgd_trajectory(model: nn.Module, batches: Sequence[Batch], *, lr: float, max_grad_norm: float,
                      reduction: str = "mean", expected_batch_size: Optional[int] = None,
                      noise_multiplier: float = 0.0, generator: Optional[torch.Generator] = None,
                      empty_steps: bool = False, momentum: float = 0.0,
                      clip_epsilon: float = CLIP_EPSILON) -> Trajectory:
    """DP-SGD training on one process, one step per batch, in float64: plain SGD, or with
    ``momentum`` mu torch's SGD momentum (``buf = g`` at the first step, then ``buf = mu buf + g``;
    ``p -= lr buf``; dampening 0, no Nesterov).

    An empty batch is refused (``BatchError``) unless ``empty_steps`` (Poisson sampling can draw
    one): then it is a step of noise alone, with loss NaN. ``clip_epsilon``: as in
    ``dp_sgd_gradient``. The input model is not modified.
    """
    m = copy.deepcopy(model).to(torch.float64)
    bufs: Dict[str, torch.Tensor]
    losses, history, bufs = [], [], {}

    def update(p: torch.Tensor, name: str, g: torch.Tensor) -> None:
        if momentum:
            bufs[name] = g.clone() if name not in bufs else bufs[name].mul_(momentum).add_(g)
            g = bufs[name]
        p -= lr * g

    for batch in batches:
        if empty_steps and len(batch) == 0 and len(batch.targets) == 0:
            # an empty Poisson batch: DP-SGD still takes the step and releases the noise alone; the
            # batch has no loss (NaN: a caller compares losses of non-empty batches only)
            losses.append(float("nan"))
            shapes = {n: p.detach().unsqueeze(0) for n, p in m.named_parameters() if p.requires_grad}
            noise = noise_like(shapes, noise_multiplier * max_grad_norm, generator)
            divisor = float(expected_batch_size or 1) if reduction == "mean" else 1.0
            with torch.no_grad():
                for n, p in m.named_parameters():
                    if n in noise:  # trainable ones only: a frozen parameter gets no noise either
                        update(p, n, noise[n] / divisor)
            history.append({n: p.detach().clone() for n, p in m.named_parameters()})
            continue
        step = dp_sgd_gradient(m, batch, max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
                               reduction=reduction, expected_batch_size=expected_batch_size, generator=generator,
                               clip_epsilon=clip_epsilon)
        losses.append(step.loss)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if n in step.gradient:
                    update(p, n, step.gradient[n])
        history.append({n: p.detach().clone() for n, p in m.named_parameters()})
    return Trajectory(losses, {n: p.detach().clone() for n, p in m.named_parameters()}, history)


__all__ = ["per_sample_grads", "per_sample_norms", "clip_coefficients", "clipped_sum", "noise_like",
           "dp_sgd_gradient", "dp_sgd_trajectory", "per_sample_losses", "batch_loss", "check_model",
           "check_batch", "DPStep", "Trajectory", "ReferenceInputError", "UnsupportedLayerError",
           "BatchError", "tied_names", "untie", "per_use_grads", "with_all_trainable", "SUPPORTED_LAYERS",
           "CLIP_EPSILON", "MAX_CLIP_EPSILON", "LOSSES", "REDUCTIONS", "is_contract"]

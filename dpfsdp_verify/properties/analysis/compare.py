"""Numbers every property compares: tolerances, the float64 reference for a ``RunSpec`` (cached
model, batch, per-sample gradients and norms), which samples a run processed, and tensor
comparisons.

No running here (that is ``runner.py``; what it checks of every run first is ``prechecks.py``) and
no verdicts: plain functions of specs, rank outputs and tensors, shared so that no property imports
a sibling. Beside it: ``clipfit.py`` (the clip bound a property picks, clip coefficients read back
from a released gradient and the errors they fit), ``precision_bounds.py`` (mixed-precision error
bounds), ``norm_hypotheses.py`` (the wrong per-sample norms a target may clip with).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, Union

from ...lazy import models, reference, torch
from ...targets import RankOutput, RunSpec
from .memo import Memo

#: ``(rtol, atol)`` per dtype for values the target computes with a different evaluation order than
#: the reference (ghost-clipping Gram products, sharded reduce-scatter sums). float64: unit
#: round-off 1.1e-16, sums of <= ~1e3 terms here, so honest differences stay below ~1e-13 relative;
#: 1e-9 keeps 4 orders of margin and is still >= 7 orders below the smallest bug effect the suite
#: names (a factor sqrt(2), a dropped layer). float32: opacus' own per-sample test tolerance.
TOLERANCES = {"float64": (1e-9, 1e-12), "float32": (1e-4, 1e-6), "bfloat16": (2e-2, 1e-3)}


def tolerance(dtype: str) -> Tuple[float, float]:
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {', '.join(TOLERANCES)}")
    return TOLERANCES[dtype]


def reference_model(spec: RunSpec) -> torch.nn.Module:
    return models.build_model(spec.model, spec.model_seed, dtype=torch.float64, **dict(spec.model_kwargs))


def reference_batch(spec: RunSpec, step: int = 0) -> models.Batch:
    """The global batch of ``step`` in float64 (the reference always computes in float64). For a
    Poisson spec, the whole dataset (its step indices are dataset indices, whatever the step)."""
    if spec.poisson:
        return models.make_batch(spec.model, spec.dataset_size, spec.batch_seed, dtype=torch.float64,
                                 **dict(spec.model_kwargs))
    return models.make_batch(spec.model, spec.global_batch_size, spec.batch_seed + step, dtype=torch.float64,
                             **dict(spec.model_kwargs))


_GRADS_CACHE: "Memo[reference.Grads]" = Memo(32)


def reference_grads(spec: RunSpec, step: int = 0) -> "reference.Grads":
    """``{name: [batch, *shape]}`` float64 per-sample gradients of ``reference_batch(spec, step)``
    at the initial parameters. Cached (a property, its clip bound and its fuzz recipe all ask for
    the same ones; a fuzz example computed them three times): callers must not modify them."""
    key = (spec.model, spec.model_seed, spec.batch_seed, spec.reduction, spec.model_kwargs, spec.poisson,
           spec.dataset_size if spec.poisson else spec.global_batch_size, 0 if spec.poisson else step)
    return _GRADS_CACHE.get(key, lambda: reference.per_sample_grads(reference_model(spec), reference_batch(spec, step),
                                                                    spec.reduction, own=True))


_FROZEN_CACHE: "Memo[Dict[str, torch.Tensor]]" = Memo(32)


def frozen_parameters(spec: RunSpec) -> Dict[str, torch.Tensor]:
    """``{name: initial value}`` of the model's frozen parameters (``requires_grad=False``), in the
    spec's dtype (what a target that never touches them reports), as float64. Cached (every run
    of every case asks); callers must not modify them."""
    key = (spec.model, spec.model_seed, spec.dtype, spec.model_kwargs)

    def frozen() -> Dict[str, torch.Tensor]:
        model = models.build_model(spec.model, spec.model_seed, dtype=spec.torch_dtype, **dict(spec.model_kwargs))
        return {n: p.detach().to(torch.float64) for n, p in model.named_parameters() if not p.requires_grad}
    return _FROZEN_CACHE.get(key, frozen)


def trainable_names(spec: RunSpec) -> List[str]:
    """The names of the model's parameters with ``requires_grad`` (a tied one once)."""
    return [n for n, p in reference_model(spec).named_parameters() if p.requires_grad]


def rows(grads: "reference.Grads", indices: Sequence[int]) -> "reference.Grads":
    """The per-sample gradients of the samples ``indices``, in that order."""
    index = torch.as_tensor(list(indices), dtype=torch.long)
    return {n: g[index] for n, g in grads.items()}


def flat(tensors: Dict[str, "torch.Tensor"], names: Optional[Sequence[str]] = None) -> "torch.Tensor":
    """``tensors[n]`` for ``n`` in ``names`` (default: sorted names) flattened into one float64
    vector: how the checks line a released gradient (or parameters) up with the reference's, and
    the order of ``sample_columns``' rows."""
    return torch.cat([tensors[n].reshape(-1).to(torch.float64) for n in (sorted(tensors) if names is None else names)])


def unflat(vector: "torch.Tensor", names: Sequence[str], like: Dict[str, "torch.Tensor"]) -> Dict[str, "torch.Tensor"]:
    """``flat``'s inverse: ``vector`` cut back into tensors shaped as ``like[n]``."""
    out, at = {}, 0
    for n in names:
        k = like[n].numel()
        out[n] = vector[at:at + k].reshape(like[n].shape)
        at += k
    return out


def sample_columns(grads: "reference.Grads", indices: Sequence[int]) -> torch.Tensor:
    """``[P, len(indices)]``: the per-sample gradients of the samples ``indices`` as float64 columns,
    each sample's tensors flattened and concatenated in sorted name order (``flat``'s order: the
    order in which the checks concatenate a released gradient to fit it against them)."""
    picked = rows(grads, indices)
    count = len(list(indices))
    return torch.cat([picked[n].reshape(count, -1).to(torch.float64) for n in sorted(picked)], dim=1).T


def reference_norms(spec: RunSpec, step: int = 0) -> torch.Tensor:
    """``[global_batch_size]`` per-sample gradient norms at the initial parameters."""
    return reference.per_sample_norms(reference_grads(spec, step))


T = TypeVar("T")

#: the bound a dry run's plan carries where a run picks one from the reference norms, and the size
#: of the one tensor it plans with where a run reads the model's parameters
PLANNED_CLIP, PLANNED_NUMEL = 1.0, 1024


def planned(compute: Callable[[], T], placeholder: T, planning: bool) -> T:
    """``compute()``: a value a case derives from the float64 reference when it is planned (a clip
    bound, the parameters' shapes); ``placeholder`` when ``planning`` (a dry run plans without the
    reference: ``Options.planning``, read by the cases as ``point.planning`` and handed down)."""
    return placeholder if planning else compute()


def norm_picked(spec: RunSpec, pick: Callable[[torch.Tensor], T], step: int = 0,
                planning: bool = False) -> Union[T, float]:
    """``pick(reference_norms(spec, step))``: a clip bound (or other value) a case derives from the
    reference norms when it is planned; ``PLANNED_CLIP`` when ``planning``: a plan's cases are the
    same (a bound changes no case's shape), only their C is not yet known (``run --dry-run``)."""
    placeholder: Union[T, float] = PLANNED_CLIP
    return planned(lambda: pick(reference_norms(spec, step)), placeholder, planning)


def trainable_shapes(spec: RunSpec, planning: bool = False) -> Dict[str, Tuple[int, ...]]:
    """The shape of each trainable parameter of ``spec``'s model (frozen ones are not released);
    when ``planning``, one placeholder tensor of ``PLANNED_NUMEL`` coordinates."""
    return planned(lambda: {n: tuple(p.shape) for n, p in reference_model(spec).named_parameters() if p.requires_grad},
                   {"planned": (PLANNED_NUMEL,)}, planning)


def smallest_norm(norms: torch.Tensor) -> float:
    """The smallest *non-zero* norm of ``norms``: a sample whose gradient is exactly zero (a
    sequence that is all padding has no real token, so no loss and no gradient) is below every
    clip bound whatever C, so a bound picked as a fraction of the smallest norm ignores it."""
    positive = norms[norms > 0]
    return float(positive.min()) if len(positive) else 0.0


def norm_ratios(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """``got / want`` over the samples whose true norm is non-zero (a zero-norm sample, e.g. an
    all-padding sequence, has no ratio; it is compared by absolute tolerance alone)."""
    keep = want > 0
    return got[keep] / want[keep]


def data_outputs(outputs: Sequence[RankOutput], spec: RunSpec) -> Sequence[RankOutput]:
    """The ranks whose samples make up the batch: every rank, or on a 2-D mesh one rank per data
    slice (tensor-parallel peers hold the same samples: ``mesh.Mesh.data_ranks``)."""
    if not spec.mesh:
        return outputs
    return [outputs[r] for r in spec.layout.data_ranks()]


def shard_divisor(spec: RunSpec, world_size: int) -> int:
    """How many dim-0 shards each parameter is cut into: the world size on a 1-D mesh, the mesh's
    second dim (the FSDP shard or TP group) on a 2-D one."""
    return spec.layout.shape[1] if spec.mesh else world_size


def replica_problem(spec: RunSpec, outputs: Sequence[RankOutput], what: str) -> Optional[Tuple[str, dict]]:
    """On a 2-D mesh, the first step and tensor where a rank's reported ``what`` (``"gradient"`` or
    ``"parameters"``) is not bit-identical to rank 0's, as ``(message, evidence)``; ``None`` if every
    rank holds the same. Each rank reports the full tensor as its own replica holds it, so ranks
    of different replicas differ exactly when the replicas drifted apart: the released model is
    then not one model, and replicas of one shard added different noise."""
    if not spec.mesh:
        return None
    layout = spec.layout
    first = outputs[0]
    for k, step in enumerate(first.steps):
        for name in sorted(getattr(step, what)):
            want = getattr(step, what)[name]
            for r, o in enumerate(outputs[1:], start=1):
                got = getattr(o.steps[k], what).get(name)
                if got is not None and got.shape == want.shape and torch.equal(got, want):
                    continue
                diff = ((got - want).abs() if got is not None and got.shape == want.shape else None)
                at = int(diff.reshape(-1).argmax()) if diff is not None else 0
                rows = want.shape[0] if want.dim() else 1
                row = at // max(1, want.numel() // max(1, rows))
                shard = next(j for j, c in enumerate(torch.arange(rows).chunk(layout.shape[1])) if row in c.tolist())
                size = f"max |difference| {float(diff.max()):.3g}" if diff is not None else "a different shape"
                return (f"rank {r} (row {layout.row(r)} of {layout.label}) and rank 0 hold different {what} of "
                        f"{name!r} after step {spec.first_step + k} ({size}, first in dim-0 shard {shard}, held by "
                        f"ranks {layout.replica_groups()[shard]}): replicas of one shard must stay bit-identical",
                        {"replica_divergence": {"step": spec.first_step + k, "tensor": name, "ranks": [0, r],
                                                "shard": shard}})
    return None


def processed_indices(outputs: Sequence[RankOutput], step: int, spec: RunSpec) -> List[int]:
    """The global indices that make up the step's batch: every rank's for split data, one copy for
    replicated data (each rank holds all of them)."""
    if spec.data_layout == "replicated" and spec.rank_batches is None:
        return list(range(spec.global_batch_size))
    idx: List[int] = []
    for o in data_outputs(outputs, spec):
        idx += list(o.steps[step].indices)
    return sorted(idx)


def global_loss(outputs: Sequence[RankOutput], step: int, spec: RunSpec) -> float:
    """The batch loss reconstructed from each rank's local loss: a mean of local means weighted by
    local batch size (``mean``) or a sum of local sums (``sum``); any one rank's for replicated data."""
    if spec.data_layout == "replicated" and spec.rank_batches is None:
        return float(outputs[0].steps[step].loss)
    total, n = 0.0, 0
    for o in data_outputs(outputs, spec):
        s = o.steps[step]
        k = len(s.indices)
        if k == 0:
            continue
        total += s.loss * (k if spec.reduction == "mean" else 1)
        n += k
    return total / n if spec.reduction == "mean" else total


def max_rel_diff(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> Tuple[float, str]:
    """``(max over tensors of max|got-want| / max|want|, worst tensor name)``; a missing tensor, a
    wrong shape or a non-finite value anywhere -> inf (never a small number). A tensor whose
    reference is (near) zero -- e.g. attention key biases, whose gradient softmax cancels -- is
    measured against 1e-3 of the largest reference tensor instead of its own rounding noise."""
    worst, name = 0.0, ""
    floor = 1e-3 * max((w.abs().max().item() for w in want.values() if w.numel()), default=0.0)
    for n, w in want.items():
        if n not in got or got[n].shape != w.shape:
            return float("inf"), n
        scale = max(w.abs().max().item() if w.numel() else 0.0, floor, 1e-300)
        d = (got[n].to(torch.float64) - w).abs().max().item() / scale
        if not d <= worst:  # NaN compares False with everything: it must win, not lose
            worst, name = (d if math.isfinite(d) else float("inf")), n
    return worst, name


def tensors_close(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], rtol: float, atol: float,
                  extra: Optional[Dict[str, torch.Tensor]] = None) -> bool:
    """Every tensor within ``atol + rtol * max|want|`` (a tensor-wise scale: a coordinate near zero
    is judged against its tensor's magnitude, since it is a difference of large terms), plus
    ``extra[name]`` coordinate by coordinate where given (the rounding a correct target is measured to
    leave there: ``clipfit.rounding_floor``). NaN or inf anywhere is never close."""
    for n, w in want.items():
        g = got.get(n)
        if g is None or g.shape != w.shape:
            return False
        allowed = atol + rtol * (w.abs().max().item() if w.numel() else 0.0)
        diff = (g.to(torch.float64) - w).abs()
        if extra is not None and n in extra:
            if not bool((diff <= allowed + extra[n]).all()):
                return False
        elif not diff.max().item() <= allowed:
            return False
    return True


def close(got: float, want: float, rtol: float, atol: float) -> bool:
    """``|got - want| <= atol + rtol * |want|``, False for NaN/inf."""
    return abs(got - want) <= atol + rtol * abs(want)


def fmt(x: float) -> str:
    return f"{x:.3g}"


#: what a property's ``judge`` may use (CONTRIBUTING.md's example uses ``tolerance``,
#: ``reference_model`` and ``reference_batch``)
__all__ = ["flat", "unflat", "TOLERANCES", "tolerance",
           "reference_model", "reference_batch", "reference_grads", "reference_norms",
           "norm_picked", "planned", "trainable_shapes", "PLANNED_CLIP", "PLANNED_NUMEL",
           "frozen_parameters", "trainable_names", "rows", "sample_columns", "smallest_norm", "norm_ratios",
           "data_outputs",
           "shard_divisor", "replica_problem", "processed_indices", "global_loss", "max_rel_diff", "tensors_close",
           "close", "fmt"]

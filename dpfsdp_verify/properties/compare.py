"""Numbers every property compares: tolerances, the float64 reference for a ``RunSpec``, the
clip bound a property picks, tensor comparisons, and clip coefficients (read back from a released
gradient; the coefficient error they fit, in words).

No running here (that is ``runner.py``) and no verdicts: plain functions of specs, rank outputs
and tensors, shared so that no property imports a sibling.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import models, reference
from ..harness.rank_groups import grouped
from ..targets import RankOutput, RunSpec

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


_GRADS_CACHE: "OrderedDict[tuple, reference.Grads]" = OrderedDict()


def reference_grads(spec: RunSpec, step: int = 0) -> "reference.Grads":
    """``{name: [batch, *shape]}`` float64 per-sample gradients of ``reference_batch(spec, step)``
    at the initial parameters. Cached (a property, its clip bound and its fuzz recipe all ask for
    the same ones; a fuzz example computed them three times): callers must not modify them."""
    key = (spec.model, spec.model_seed, spec.batch_seed, spec.reduction, spec.model_kwargs, spec.poisson,
           spec.dataset_size if spec.poisson else spec.global_batch_size, 0 if spec.poisson else step)
    grads = _GRADS_CACHE.get(key)
    if grads is None:
        grads = reference.per_sample_grads(reference_model(spec), reference_batch(spec, step), spec.reduction)
        _GRADS_CACHE[key] = grads
        while len(_GRADS_CACHE) > 32:
            _GRADS_CACHE.popitem(last=False)
    return grads


_FROZEN_CACHE: "OrderedDict[tuple, Dict[str, torch.Tensor]]" = OrderedDict()


def frozen_parameters(spec: RunSpec) -> Dict[str, torch.Tensor]:
    """``{name: initial value}`` of the model's frozen parameters (``requires_grad=False``), in the
    spec's dtype (what a target that never touches them reports), as float64. Cached (every run
    of every case asks); callers must not modify them."""
    key = (spec.model, spec.model_seed, spec.dtype, spec.model_kwargs)
    if key not in _FROZEN_CACHE:
        model = models.build_model(spec.model, spec.model_seed, dtype=spec.torch_dtype, **dict(spec.model_kwargs))
        _FROZEN_CACHE[key] = {n: p.detach().to(torch.float64) for n, p in model.named_parameters()
                              if not p.requires_grad}
        while len(_FROZEN_CACHE) > 32:
            _FROZEN_CACHE.popitem(last=False)
    return _FROZEN_CACHE[key]


def trainable_names(spec: RunSpec) -> List[str]:
    """The names of the model's parameters with ``requires_grad`` (a tied one once)."""
    return [n for n, p in reference_model(spec).named_parameters() if p.requires_grad]


def frozen_problem(spec: RunSpec, outputs: Sequence[RankOutput]) -> Optional[Tuple[str, dict]]:
    """``(message, evidence)`` if a frozen parameter got a gradient (or noise) or moved on any rank
    at any step; ``None`` if every frozen parameter was left exactly alone. Exact comparison: a
    frozen parameter is not trained, so nothing about it may change, not even by rounding."""
    frozen = frozen_parameters(spec)
    if not frozen:
        return None
    for o in outputs:
        for k, s in enumerate(o.steps):
            for n, init in frozen.items():
                g = s.gradient.get(n)
                if g is not None and bool((torch.as_tensor(g) != 0).any()):
                    g = torch.as_tensor(g, dtype=torch.float64)
                    return (f"rank {o.rank}, step {k}: frozen parameter {n!r} (requires_grad=False) received "
                            f"a gradient or noise: {int((g != 0).sum())} of {g.numel()} released coordinates are "
                            f"non-zero (largest {float(g.abs().max()):.3g}). A frozen parameter is not trained: "
                            "its gradient is not in the per-sample norms the clipping bounds, so any signal on it "
                            "is unclipped (a privacy violation), and noise on it only corrupts the frozen base",
                            {"frozen_parameter": n, "rank": o.rank, "step": k})
                p = s.parameters.get(n)
                if p is not None and not torch.equal(torch.as_tensor(p, dtype=torch.float64), init):
                    diff = float((torch.as_tensor(p, dtype=torch.float64) - init).abs().max())
                    return (f"rank {o.rank}, step {k}: frozen parameter {n!r} (requires_grad=False) changed by up "
                            f"to {diff:.3g}: the optimizer updated a parameter the user froze. Its update is not "
                            "covered by the clipping (norms are over trainable parameters) nor, unless noised, by "
                            "the noise: a privacy violation, and the pretrained base drifts",
                            {"frozen_parameter": n, "rank": o.rank, "step": k, "max_change": diff})
    return None


def finetune_norms(spec: RunSpec) -> List[Tuple[str, torch.Tensor, str]]:
    """The per-sample norms (over ``reference_batch(spec)``) of the ways a target gets frozen or
    tied parameters wrong, as ``(diagnosis, norms, what it does)``: norms that include the frozen
    parameters (all of them, or those sharing a layer with a trainable one); a tied parameter's
    gradient from one of its uses only, or its uses' squared norms added (their cross term
    dropped). ``undercount`` where some sample's norm comes out below its true norm (it can then
    contribute more than C), else ``mismatch``. Empty for a model with neither."""
    model, batch = reference_model(spec), reference_batch(spec)
    true = reference_norms(spec)
    out: List[Tuple[torch.Tensor, str]] = []
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        every = reference.per_sample_grads(reference.with_all_trainable(model), batch, spec.reduction)
        out.append((reference.per_sample_norms(every), f"include the frozen parameters' per-sample gradients "
                    f"({', '.join(frozen)}): a frozen parameter is not released, so it has no place in the norm"))
        mixed = []
        for name, module in model.named_modules():
            own = list(module.named_parameters(recurse=False))
            if any(p.requires_grad for _, p in own):
                mixed += [f"{name}.{n}" if name else n for n, p in own if not p.requires_grad]
        if mixed and len(mixed) < len(frozen):
            keep = {n: g for n, g in every.items() if n not in set(frozen) - set(mixed)}
            out.append((reference.per_sample_norms(keep), f"include the frozen parameters of layers that also hold a "
                        f"trainable one ({', '.join(mixed)}): the layer's norm covers all its parameters, "
                        "requires_grad is not looked at"))
    ties = reference.tied_names(model)
    if ties:
        uses = reference.per_use_grads(model, batch, spec.reduction)
        tied_uses = {u for group in ties.values() for u in group}
        base = sum(g.flatten(1).pow(2).sum(1) for n, g in uses.items() if n not in tied_uses)

        def sq(g):
            return g.flatten(1).pow(2).sum(1)

        for first, group in ties.items():
            rest = base + sum(sq(sum(uses[u] for u in other)) for f, other in ties.items() if f != first)
            for u in group:
                out.append(((rest + sq(uses[u])).sqrt(), f"take the tied parameter {first!r} (also {', '.join(group[1:])}) "
                            f"from its use as {u!r} only: each use's hook sets the parameter's norm, the last one wins; "
                            "its per-sample gradient is the sum over all its uses"))
            out.append(((rest + sum(sq(uses[u]) for u in group)).sqrt(), f"add the squared norms of the tied parameter "
                        f"{first!r}'s uses ({', '.join(group)}) as if they were separate parameters: the norm of "
                        "their sum has a cross term, which is dropped"))
    found = []
    for norms, what in out:
        below = bool((norms < true * (1 - 1e-9)).any())
        found.append(("undercount" if below else "mismatch", norms, what))
    return found


_OMITTED_CACHE: "OrderedDict[tuple, list]" = OrderedDict()


def omitted_layer_norms(spec: RunSpec) -> List[Tuple[str, torch.Tensor, str]]:
    """The per-sample norms (over ``reference_batch(spec)``) of a norm registry that misses a layer
    type, as ``("undercount", norms, what it does)``: for each layer type of the model (``Linear``,
    ``GroupNorm``, ``Conv2d``...) the norms without every parameter of every layer of that type,
    and for each type whose layers hold a bias, the norms without those biases alone (a conv bias
    the per-sample code forgets). Such a target trains the missing parameters with the coefficients
    the other layers' norms give: a sample's norm is undercounted, so it can contribute more than
    C. The conv types together ("convolution") and the InstanceNorm types together are hypotheses
    too (a registry keyed by their base class). Cached per model and batch; only types that hold a trainable parameter, and not when the
    model has a single layer type (nothing would be left)."""
    key = (spec.model, spec.model_seed, spec.batch_seed, spec.reduction, spec.model_kwargs, spec.poisson,
           spec.dataset_size if spec.poisson else spec.global_batch_size)
    if key in _OMITTED_CACHE:
        return _OMITTED_CACHE[key]
    grads = reference_grads(spec)
    by_type: "OrderedDict[str, Tuple[List[str], List[str], List[str]]]" = OrderedDict()
    for name, module in reference_model(spec).named_modules():
        own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        layers, params, biases = by_type.setdefault(type(module).__name__, ([], [], []))
        layers.append(name)
        params += [f"{name}.{n}" for n in own]
        biases += [f"{name}.{n}" for n in own if n == "bias"]
    # a registry keyed by a family's base class (torch's _ConvNd, _InstanceNorm) misses every member at once
    for family, members in (("convolution", ("Conv1d", "Conv2d", "Conv3d")),
                            ("InstanceNorm", ("InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"))):
        present = [by_type[m] for m in members if m in by_type]
        if len(present) > 1:
            by_type[family] = tuple(sum((list(x[i]) for x in present), []) for i in range(3))
    out: List[Tuple[str, torch.Tensor, str]] = []
    if len(by_type) > 1:
        for kind, (layers, params, biases) in by_type.items():
            what = f"{kind} layer{'s' if len(layers) > 1 else ''} {', '.join(repr(n) for n in layers)}"
            for left_out, missing in ((params, f"leave out every {kind} layer ({what}): a norm registry without "
                                               f"{kind}"),
                                      (biases, f"leave out the bias of every {kind} layer ({what})")):
                if not left_out or (missing.startswith("leave out the bias") and left_out == params):
                    continue
                keep = {n: g for n, g in grads.items() if n not in set(left_out)}
                out.append(("undercount", reference.per_sample_norms(keep), f"{missing}; its parameters "
                            f"({', '.join(left_out)}) are trained with the coefficients the other layers' norms give"))
    _OMITTED_CACHE[key] = out
    while len(_OMITTED_CACHE) > 32:
        _OMITTED_CACHE.popitem(last=False)
    return out


def sequence_weights(spec: RunSpec) -> List[Tuple[str, torch.Tensor, str]]:
    """The ways a target gets the per-sequence loss of padded token batches wrong, as ``(diagnosis,
    weights, what it does)`` with ``weights[i]`` the factor its per-sample loss (so its gradient
    and norm) carries over the reference's for sample ``i`` of ``reference_batch(spec)``. Under
    ``"mean"`` the reference averages a sequence's loss over its real tokens (opacus 1.6.0's
    ``DPLossFastGradientClipping`` with an ``ignore_index`` criterion); averaging over the padded
    length T counts padding tokens: ``weights = real / T``. ``mismatch``: each sequence's clipped
    contribution still stays within C (a target clips what it computes), so privacy holds, but
    short sequences are down-weighted and the objective is not the one configured. Empty for
    batches without ignored targets, and under ``"sum"`` (no normalisation)."""
    batch = reference_batch(spec)
    if batch.loss != "token_cross_entropy" or spec.reduction != "mean" or not len(batch):
        return []
    t = batch.targets.shape[1]
    real = (batch.targets != models.IGNORE_INDEX).sum(dim=1)
    if bool((real == t).all()):
        return []
    shortest = int(real[real > 0].min()) if bool((real > 0).any()) else 0
    return [("mismatch", real.to(torch.float64) / t,
             f"count padding tokens in the per-sequence mean: each sequence's loss is divided by the padded "
             f"length T={t}, not by its {shortest}..{int(real.max())} real tokens, so its gradient and norm are "
             f"(real tokens / T) times the true ones. Each sequence's clipped contribution stays within C (not a "
             f"privacy violation), but short sequences are down-weighted: the objective is not the per-token mean "
             f"the loss asks for (ignore_index positions are excluded from the denominator, as opacus 1.6.0 does)")]


def rows(grads: "reference.Grads", indices: Sequence[int]) -> "reference.Grads":
    """The per-sample gradients of the samples ``indices``, in that order."""
    index = torch.as_tensor(list(indices), dtype=torch.long)
    return {n: g[index] for n, g in grads.items()}


def reference_norms(spec: RunSpec, step: int = 0) -> torch.Tensor:
    """``[global_batch_size]`` per-sample gradient norms at the initial parameters."""
    return reference.per_sample_norms(reference_grads(spec, step))


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


def tensors_close(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], rtol: float, atol: float) -> bool:
    """Every tensor within ``atol + rtol * max|want|`` (a tensor-wise scale: a coordinate near zero
    is judged against its tensor's magnitude, since it is a difference of large terms). NaN or
    inf anywhere is never close."""
    for n, w in want.items():
        g = got.get(n)
        if g is None or g.shape != w.shape:
            return False
        if not (g.to(torch.float64) - w).abs().max().item() <= atol + rtol * w.abs().max().item():
            return False
    return True


def close(got: float, want: float, rtol: float, atol: float) -> bool:
    """``|got - want| <= atol + rtol * |want|``, False for NaN/inf."""
    return abs(got - want) <= atol + rtol * abs(want)


def device_facts(outputs: Sequence[RankOutput]) -> Dict[str, object]:
    """What every verdict's evidence says about where the ranks computed: ``device`` (each rank's,
    in rank order, joined when they differ: ``cuda:0, cuda:1``) and, on CUDA, ``numerics`` (the
    TF32 switches in force after the run, ``targets.util.numerics``). ``{}`` for outputs from an
    older rank that did not say."""
    devices = list(dict.fromkeys(o.device for o in outputs if getattr(o, "device", "")))
    if not devices:
        return {}
    facts: Dict[str, object] = {"device": ", ".join(devices)}
    how = next((o.numerics for o in outputs if getattr(o, "numerics", None)), None)
    if how:
        facts["numerics"] = dict(how)
    return facts


def tf32_problem(spec: RunSpec, outputs: Sequence[RankOutput]) -> Optional[str]:
    """Why a float32 case cannot be judged: a rank computed it with TF32 in force (the suite turns
    it off before each run, ``targets.util.float32_numerics``; the target turned it back on), and
    the float32 tolerances are derived for IEEE float32, ten times finer than TF32's rounding.
    ``None`` otherwise (float64, bf16 precisions, the CPU)."""
    if spec.compute_dtype != torch.float32:
        return None
    on = sorted({k for o in outputs for k, v in (getattr(o, "numerics", None) or {}).items() if v})
    if not on:
        return None
    return (f"the target computed float32 with TF32 in force ({', '.join(on)} = True after its run; the suite "
            "sets them False before it): float32 tolerances assume IEEE float32 rounding, TF32 keeps 10 mantissa "
            "bits (~1e-3 relative). Leave torch.backends.cuda.matmul.allow_tf32 / torch.backends.cudnn.allow_tf32 "
            "as the suite sets them, or run --dtypes float64")


def non_finite(outputs: Sequence[RankOutput]) -> Optional[str]:
    """Where the first NaN/inf is in what the ranks reported (loss, norms, gradient, parameters),
    as "rank r, step k: gradient 'fc1.weight' has 3 NaN and 0 inf of 48 values"; ``None`` if all
    is finite."""
    for o in outputs:
        for k, s in enumerate(o.steps):
            if not math.isfinite(s.loss):
                return f"rank {o.rank}, step {k}: the loss is {s.loss}"
            named = [("per-sample norms", "", s.norms)] if s.norms is not None else []
            named += [("gradient", n, t) for n, t in s.gradient.items()]
            named += [("parameter", n, t) for n, t in s.parameters.items()]
            for what, name, t in named:
                t = torch.as_tensor(t)
                if not bool(torch.isfinite(t).all()):
                    label = f"{what} {name!r}" if name else what
                    return (f"rank {o.rank}, step {k}: {label} has {int(torch.isnan(t).sum())} NaN and "
                            f"{int(torch.isinf(t).sum())} inf of {t.numel()} values")
    return None


def all_padding_note(spec: RunSpec, outputs: Sequence[RankOutput]) -> str:
    """For a non-finite release on a token batch: which processed sequences are all padding (no
    target other than ``ignore_index``) and whether the non-finite per-sample norms are exactly
    theirs, as a sentence to append (``""`` if no processed sequence is all padding)."""
    empty_at: List[str] = []
    for o in outputs:
        for k, s in enumerate(o.steps):
            if not len(s.indices):
                continue
            batch = reference_batch(spec, k)
            if batch.loss != "token_cross_entropy":
                return ""
            rows = batch.targets[torch.as_tensor(list(s.indices), dtype=torch.long)]
            empty = (rows != models.IGNORE_INDEX).sum(dim=1) == 0
            if not bool(empty.any()):
                continue
            where = [i for i, e in zip(s.indices, empty.tolist()) if e]
            if s.norms is not None and len(s.norms) == len(s.indices):
                bad = ~torch.isfinite(torch.as_tensor(s.norms, dtype=torch.float64))
                if bool(bad.any()) and bool((bad == empty).all()):
                    return (f" The non-finite per-sample norms (rank {o.rank}, step {k}) are exactly those of the "
                            f"sequence(s) {where} that are all padding (no real token): a per-sequence mean over "
                            "zero tokens is 0/0 = NaN. Such a sequence must contribute nothing (loss 0, gradient 0), "
                            "and one NaN poisons every sample's released gradient.")
            empty_at.append(f"rank {o.rank} step {k}: {where}")
    if not empty_at:
        return ""
    return (f" The processed batches hold all-padding sequences ({'; '.join(empty_at)}): a per-sequence mean over "
            "zero real tokens (0/0) gives NaN; such a sequence must contribute nothing.")


def data_problem(spec: RunSpec, world_size: int, outputs: Sequence[RankOutput]) -> Optional[str]:
    """How what the ranks say they processed differs from what ``spec`` gave them (steps taken;
    per step, the global indices observed in the data: missing, duplicated or foreign samples);
    ``None`` if it is exactly that (order within a local batch does not matter)."""
    counts = [len(o.steps) for o in outputs]
    # a resumed run's half takes steps first_step..end_step-1 (``RunSpec.resume_at``), numbered so
    asked = spec.end_step - spec.first_step
    if any(c != asked for c in counts):
        half = f" ({spec.phase} half of a run resumed at step {spec.resume_at})" if spec.phase else ""
        took = grouped({r: str(c) for r, c in enumerate(counts)}, between=" took ", sep=", ")
        return (f"{took} step(s) where {asked} were asked for{half}: a rank that returns early, or takes extra "
                "steps, trains on other data than its peers")
    for k in range(spec.first_step, spec.end_step):
        for r, o in enumerate(outputs):
            got, want = sorted(o.steps[k - spec.first_step].indices), sorted(spec.rank_indices(k, r, world_size))
            if got != want:
                missing = sorted(set(want) - set(got))
                foreign = sorted(set(got) - set(want))
                dup = sorted({i for i in got if got.count(i) > 1})
                parts = [f"{label} {v}" for label, v in (("missing", missing), ("foreign", foreign),
                                                         ("duplicated", dup)) if v]
                peers = ""
                if spec.mesh and spec.layout.tensor_parallel:
                    layout = spec.layout
                    peers = (f" (on {layout.label} the {layout.shape[1]} tensor-parallel peers of a data replica share "
                             f"its samples: the batch is split over the {layout.data_degree} data replicas only)")
                return (f"rank {r}, step {k}: processed samples {got} but was given {want} ({'; '.join(parts)}): "
                        f"the data path does not feed each rank the samples it was given{peers}")
    return None


def poisson_problem(spec: RunSpec, world_size: int, outputs: Sequence[RankOutput]
                    ) -> Optional[Tuple[str, str, dict]]:
    """What is wrong with a Poisson run's data, as ``(diagnosis, message, evidence)``, or ``None``.
    Indices are random, so they are checked for what Poisson sampling guarantees: every rank took
    the same number of steps (``step_divergence``: evidence = each rank's step count and local
    batch sizes), no more than asked for, every index is a dataset index, and no sample is in a
    step twice, across all ranks (each sample's Bernoulli draw is made once) (``mismatch``)."""
    counts = [len(o.steps) for o in outputs]
    sizes = [[len(s.indices) for s in o.steps] for o in outputs]
    brief = [x if len(x) <= 64 else f"{len(x)} steps, {sum(1 for b in x if b == 0)} empty, mean "
             f"{sum(x) / max(1, len(x)):.3g}" for x in sizes]
    evidence = {"step_counts": counts, "local_batch_sizes": brief}
    if len(set(counts)) > 1:
        return ("step_divergence", (
            f"the ranks took different numbers of steps: {grouped({r: str(c) for r, c in enumerate(counts)}, ': ', ', ')} "
            f"(nominal {spec.nominal_steps}: {spec.epochs} epoch(s) of int(1/q) = {spec.steps_per_epoch}). "
            "Under FSDP every step joins collectives, so the rank with more steps waits forever in the next "
            "one; and the accountant's step count is no longer one number. Typical cause: each rank draws "
            "its Poisson mask from its own random stream and skips its empty local batches."), evidence)
    if spec.task == "train" and counts and counts[0] == 0 and spec.nominal_steps > 0:
        return ("mismatch", f"no rank took a step of the {spec.nominal_steps} nominal Poisson steps: does the target "
                "implement RunSpec.sampling? (a target that ignores it runs the fixed path with steps=0)", evidence)
    if counts and counts[0] > spec.end_step - spec.first_step:
        return ("mismatch", f"the ranks took {counts[0]} steps; at most {spec.end_step - spec.first_step} are possible "
                f"({spec.epochs} epoch(s) of {spec.steps_per_epoch})", evidence)
    for k in range(counts[0] if counts else 0):
        seen: Dict[int, int] = {}
        for r, o in enumerate(outputs):
            for i in o.steps[k].indices:
                if not 0 <= i < spec.dataset_size:
                    return ("mismatch", f"rank {r}, step {k}: drew index {i}, not a dataset index (0.."
                            f"{spec.dataset_size - 1}): the data path feeds samples that are not in the dataset",
                            evidence)
                if i in seen:
                    return ("mismatch", f"step {k}: sample {i} was processed by rank {seen[i]} and again by "
                            f"rank {r}: each sample's inclusion must be one Bernoulli draw per step; a sample "
                            "counted twice has twice the influence the clip bound allows", evidence)
                seen[i] = r
    return None


def physical_problem(spec: RunSpec, outputs: Sequence[RankOutput]) -> Optional[Tuple[str, str, dict]]:
    """What is wrong with the physical passes the ranks report under gradient accumulation
    (``spec.physical_batch_size`` p > 0), as ``(diagnosis, message, evidence)``, or ``None``: each
    step must say how it was split (a target that ignores p would run unsplit and pass every
    comparison), every pass must hold at most p samples and the passes all of the step's samples
    (``mismatch``), and the ranks must run equally many passes per step (``step_divergence``: under
    FSDP every pass joins collectives)."""
    p = spec.physical_batch_size
    if not p:
        return None
    counts = [[len(s.physical_batches or ()) for s in o.steps] for o in outputs]
    evidence = {"physical_passes_per_step": counts}
    for o in outputs:
        for k, s in enumerate(o.steps):
            sizes = s.physical_batches
            if not sizes:
                return ("mismatch", f"rank {o.rank}, step {k}: no physical passes reported for physical_batch_size={p} "
                        "(StepOutput.physical_batches): does the target implement gradient accumulation?", evidence)
            if max(sizes) > p or sum(sizes) != len(s.indices):
                return ("mismatch", f"rank {o.rank}, step {k}: physical passes of sizes {list(sizes)} for a local batch "
                        f"of {len(s.indices)} with physical_batch_size={p}: each pass must hold at most p samples and "
                        "the passes together exactly the step's samples", evidence)
    steps = min((len(c) for c in counts), default=0)
    for k in range(steps):
        per_rank = [c[k] for c in counts]
        if len(set(per_rank)) > 1:
            return ("step_divergence", (
                f"step {k}: the ranks ran different numbers of physical passes "
                f"({grouped({r: str(n) for r, n in enumerate(per_rank)}, ': ', ', ')}; every rank's passes per step in "
                "the evidence). "
                "Under FSDP every pass joins collectives: passes that differ pair across logical steps and the "
                "rank with more passes waits forever at the end"), evidence)
    return None


def privacy_steps_problem(spec: RunSpec, outputs: Sequence[RankOutput]) -> Optional[Tuple[str, str, dict]]:
    """What is wrong with the privacy step counts a run reports (``StepOutput.privacy_steps``), as
    ``(diagnosis, message, evidence)``, or ``None`` (also where no step reports a count). The
    accountant composes one DP step per released update: after step j of a run it has counted
    ``first_step + j + 1`` on every rank -- not one per physical pass, not only the steps whose
    local batch held a sample. A resumed run's ``load`` half must count one per step from where
    it starts; where it starts (the steps restored from the checkpoint) is checkpoint_resume's to
    judge, against its ``save`` half. ``step_count_wrong``."""
    counts = [[s.privacy_steps for s in o.steps] for o in outputs]
    if all(c is None for row in counts for c in row):
        return None
    evidence = {"privacy_steps": counts}
    for o, row in zip(outputs, counts):
        if any(c is None for c in row):
            return ("step_count_wrong", f"rank {o.rank} reports no privacy step count (StepOutput.privacy_steps) after "
                    f"some steps: {row}. A target that reports the count reports it after every DP step", evidence)
    # the counts each rank should report, and what a count per physical pass / per non-empty batch would be
    resumed = spec.phase == "load"
    for o, row in zip(outputs, counts):
        start = (row[0] - 1) if resumed and row else spec.first_step
        want = [start + j + 1 for j in range(len(row))]
        if row == want:
            continue
        passes = [start + sum(len(s.physical_batches or (0,)) for s in o.steps[:j + 1]) for j in range(len(row))]
        nonempty = [start + sum(1 for s in o.steps[:j + 1] if len(s.indices)) for j in range(len(row))]
        k = next(j for j, (g, w) in enumerate(zip(row, want)) if g != w)
        if spec.physical_batch_size and row == passes:
            how = "it counts one step per physical pass (its count is the passes run so far), not one per DP step"
        elif row == nonempty:
            how = "it does not count the steps whose local batch on this rank was empty, though they were taken"
        elif k and row[k] == row[k - 1]:
            how = f"its count does not advance at step {spec.first_step + k}"
        else:
            how = "it does not count one per DP step"
        if row[k] > want[k]:
            meaning = ("the accountant composes more steps than were released: the reported epsilon is too large "
                       "(over-reported, and the accountant does not count DP steps)")
        else:
            meaning = ("PRIVACY VIOLATION in the accounting: the accountant composes fewer steps than were released, "
                       "so the reported epsilon is smaller than the run's privacy loss")
        ranks = "" if all(r == counts[0] for r in counts) else (
            "; the ranks' counts differ (" + ", ".join(f"rank {x.rank}: {r}" for x, r in zip(outputs, counts)) + ")")
        return ("step_count_wrong", f"rank {o.rank}: the privacy step count (StepOutput.privacy_steps) after each step "
                f"is {row}, expected {want}: {how}{ranks}. {meaning[0].upper() + meaning[1:]}.", evidence)
    if any(r != counts[0] for r in counts):
        return ("step_count_wrong", "the ranks' privacy step counts differ: " + ", ".join(
            f"rank {x.rank}: {r}" for x, r in zip(outputs, counts)) + ". The accountant's step count is one number for "
            "the run: ranks that disagree report different epsilons for the same release", evidence)
    return None


def fmt(x: float) -> str:
    return f"{x:.3g}"


def pick_clip_bound(spec: RunSpec) -> Optional[float]:
    """C between the two middle reference norms of step 0's global batch (a Poisson spec: of its
    dataset) (some samples clipped, some not: a missing ``min(1, .)`` or a wrong norm both show);
    ``None`` if they tie or the batch has fewer than two samples."""
    if (spec.dataset_size if spec.poisson else spec.global_batch_size) < 2:
        return None
    n = torch.sort(reference_norms(spec)).values
    lo, hi = float(n[len(n) // 2 - 1]), float(n[len(n) // 2])
    return None if hi - lo < 1e-6 * hi else (lo + hi) / 2


def with_picked_clip(spec: RunSpec, fallback: float = 1.0) -> RunSpec:
    """``spec`` with ``max_grad_norm`` set to ``pick_clip_bound(spec)``, or to ``fallback`` where no
    bound splits the batch (ties, fewer than two samples, a bound of 0)."""
    return spec.with_(max_grad_norm=pick_clip_bound(spec) or fallback)


# -- clip coefficients: recovered from a released gradient, and the coefficient errors they fit --

#: how far clip coefficients recovered from a released gradient may be from the reference's. They
#: come from a least-squares solve against float64 per-sample gradients. Measured on upstream opacus
#: and the correct specimen (mlp and transformer, 1-2 ranks, both layouts and reductions): float64
#: within 4e-15, float32 within 3e-7 (its gradients carry ~1e-7 relative rounding). The bounds keep
#: >= 30x margin and stay far below the smallest bug effect named here (a bfloat16-rounded
#: coefficient: 2e-3; a factor sqrt(2): 0.3; a bound 1.01 C: 1e-2 relative).
COEF_TOL = {"float64": 1e-9, "float32": 1e-5, "bfloat16": 5e-2}
#: a sample's coefficient is recovered only if its gradient is this far (relative) from the span of
#: the others': a zero gradient (a dead ReLU) or collinear samples (tiny fuzzed models) carry no
#: information about their own coefficient, and rounding in the target's dtype is amplified by
#: 1/distance
IDENTIFIABLE = {"float64": 1e-6, "float32": 1e-3, "bfloat16": 1e-1}


def identifiable(basis: torch.Tensor, min_distance: float) -> torch.Tensor:
    """``[B]`` bool: which columns of ``basis`` (``[P, B]`` per-sample gradients) have a relative
    distance >= ``min_distance`` from the span of the other columns."""
    norms = basis.norm(dim=0)
    ok = norms > 1e-12 * float(norms.max().clamp_min(1e-300))
    for i in range(basis.shape[1]):
        others = torch.cat([basis[:, :i], basis[:, i + 1:]], dim=1)
        if ok[i] and others.shape[1]:
            col = basis[:, i:i + 1]
            proj = others @ torch.linalg.lstsq(others, col, driver="gelsd").solution
            ok[i] = float((col - proj).norm() / norms[i]) >= min_distance
    return ok


@dataclass
class RecoveredCoefficients:
    """Per-sample clip coefficients read back from a released (noise 0) gradient."""

    indices: List[int]            # the processed samples, in the order of ``coefficients``
    coefficients: torch.Tensor    # [len(indices)] float64 least-squares c_i
    residual: float               # relative residual of the fit: > COEF_TOL means not sum_i c_i g_i
    identifiable: torch.Tensor    # [len(indices)] bool: which c_i the data determine (``identifiable``)


def recover_clip_coefficients(spec: RunSpec, indices: Sequence[int], gradient: Dict[str, torch.Tensor],
                              step: int = 0) -> RecoveredCoefficients:
    """With noise 0 the released gradient times the divisor D (``spec.expected_batch_size`` under
    ``mean``, 1 under ``sum``) is ``sum_i c_i g_i`` over the processed samples ``indices``; a
    least-squares fit against the reference per-sample gradients ``g_i`` at the initial parameters
    (far more parameters than samples) recovers each ``c_i``. Step 0 only (later steps are at other
    parameters)."""
    indices = list(indices)
    grads = rows(reference_grads(spec, step), indices)
    names = sorted(grads)
    basis = torch.cat([grads[n].reshape(len(indices), -1) for n in names], dim=1).T
    d = spec.divisor
    released = torch.cat([gradient[n].reshape(-1).to(torch.float64) for n in names]) * d
    # gelsd (SVD): torch's default CPU driver (gelsy) returns a wrong solution, with a residual above
    # 1, when samples repeat exactly (measured on a fuzzed transformer with duplicate inputs)
    coef = torch.linalg.lstsq(basis, released.unsqueeze(1), driver="gelsd").solution.squeeze(1)
    residual = float((basis @ coef - released).norm() / released.norm().clamp_min(1e-300))
    # bf16 compute rounds each gradient far more than its float32 parameters do
    key = "bfloat16" if spec.precision != "fp32" else spec.dtype
    seen = identifiable(basis, IDENTIFIABLE.get(key, IDENTIFIABLE["float64"]))
    return RecoveredCoefficients(indices, coef, residual, seen)


def fit_clip_epsilon(evaluate: Callable[[float], torch.Tensor], got: torch.Tensor) -> float:
    """The clip epsilon ``e`` in ``[0, reference.MAX_CLIP_EPSILON]`` whose reference output
    ``evaluate(e)`` (a flat float64 tensor: coefficients, a gradient, a trajectory's parameters) is
    nearest to ``got``: DP-SGD's ``min(1, C/||g||)`` may carry any epsilon in that range
    (``reference.MAX_CLIP_EPSILON``), so a check compares with the reference at the target's own.
    The output is smooth in ``e`` and the range is tiny: ``got`` projected on the line through
    ``evaluate(0)`` and ``evaluate(MAX_CLIP_EPSILON)``, clamped to the range. A looser clip (``e < 0``)
    or a far larger epsilon comes out at an end of the range, where the caller's comparison fails."""
    top = reference.MAX_CLIP_EPSILON
    low, high = evaluate(0.0), evaluate(top)
    step = high - low
    span = float(step @ step)
    if span == 0.0:  # no sample is near or above C: the epsilon changes nothing
        return reference.CLIP_EPSILON
    t = float((got.to(torch.float64) - low) @ step) / span
    return min(max(t, 0.0), 1.0) * top


def at_own_clip_epsilon(make: Callable[[float], "reference.Trajectory"], got: Dict[str, torch.Tensor],
                        rtol: float, atol: float) -> Tuple["reference.Trajectory", float]:
    """``(reference trajectory, epsilon)``: ``make(e)`` (the reference at clip epsilon ``e``) at
    opacus' epsilon, or -- where the parameters ``got`` after the last step differ from it -- at the
    accepted epsilon nearest to them (``fit_clip_epsilon``) if they match that one. A caller then
    compares with the trajectory returned; a target outside the accepted range still differs."""
    ref = make(reference.CLIP_EPSILON)
    if tensors_close(got, ref.parameters, rtol, atol):
        return ref, reference.CLIP_EPSILON
    names = sorted(n for n in ref.parameters if n in got and got[n].shape == ref.parameters[n].shape)
    if len(names) != len(ref.parameters):
        return ref, reference.CLIP_EPSILON

    def flat(params: Dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([params[n].reshape(-1).to(torch.float64) for n in names])

    eps = fit_clip_epsilon(lambda e: flat(make(e).parameters), flat(got))
    own = make(eps)
    return (own, eps) if tensors_close(got, own.parameters, rtol, atol) else (ref, reference.CLIP_EPSILON)


@dataclass(frozen=True)
class CoefficientFit:
    """A clip-coefficient error that reproduces measured coefficients: ``kind`` is ``bound`` (clips
    at ``value`` x C), ``floor`` (``max(min(1, C/n), value)``), ``cap`` (``min(value, C/n)``: the
    cap of ``min(1, .)`` is ``value``; ``inf``: no cap at all), ``epsilon`` (``min(1, C/(n +
    value))`` instead of opacus' ``n + 1e-6``) or ``scale`` (``value`` x ``min(1, C/n)``)."""

    kind: str
    value: float
    max_error: float


def fit_clip_coefficients(coef: torch.Tensor, norms: torch.Tensor, c: float, tol: float
                          ) -> Optional[CoefficientFit]:
    """The first coefficient error (``CoefficientFit`` kinds, in that order) whose one parameter,
    estimated from ``coef`` (measured per-sample coefficients) and ``norms`` (the true norms),
    predicts every coefficient within ``tol`` (relative to max(1, the prediction)); ``None`` if
    none fits. Only called for coefficients that differ from ``min(1, C/(n + 1e-6))``."""
    coef, norms = coef.to(torch.float64), norms.to(torch.float64)
    if not len(coef) or not bool(torch.isfinite(coef).all()):
        return None
    eps = reference.CLIP_EPSILON
    true = reference.clip_coefficients(norms, c)
    raw = c / (norms + eps)
    clipped = coef < 1 - tol
    candidates = []
    if bool(clipped.any()):
        k = float((coef[clipped] * (norms[clipped] + eps) / c).median())
        if k > 0:
            candidates.append(("bound", k, reference.clip_coefficients(norms, k * c)))
    f = float(coef.min())
    candidates.append(("floor", f, true.clamp(min=f)))
    top = float(coef.max())
    cap = float("inf") if top >= float(raw.max()) * (1 - tol) and top > 1 + tol else top
    candidates.append(("cap", cap, raw.clamp(max=cap)))
    if bool(clipped.any()):
        e = float((c / coef[clipped] - norms[clipped]).median())
        if e > -float(norms.min()):
            candidates.append(("epsilon", e, (c / (norms + e)).clamp(max=1.0)))
    k = float(coef @ true / (true @ true))
    candidates.append(("scale", k, k * true))
    for kind, value, pred in candidates:
        err = float((coef - pred).abs().max())
        if err <= tol * max(1.0, float(pred.abs().max())) and float((pred - true).abs().max()) > tol:
            return CoefficientFit(kind, value, err)
    return None


def describe_clip_fit(fit: CoefficientFit, c: float) -> str:
    """``fit`` in words: what the target's clip coefficient is, in opacus' terms."""
    if fit.kind == "bound":
        return f"min(1, C'/||g_i||) with C' = {fit.value:.6g} x C (C={c:.4g}): clipped at the wrong bound"
    if fit.kind == "floor":
        return (f"max(min(1, C/||g_i||), {fit.value:.4g}): the clip coefficient is floored at {fit.value:.4g}, "
                f"so a sample with norm above C/{fit.value:.4g} = {c / fit.value:.4g} contributes more than C")
    if fit.kind == "cap":
        if math.isinf(fit.value):
            return ("C/||g_i|| *not capped at 1* (no min(1, .)): the samples with norm below C are scaled up "
                    "to norm C instead of being left alone")
        return f"min({fit.value:.4g}, C/||g_i||): the coefficient is capped at {fit.value:.4g} instead of 1"
    if fit.kind == "epsilon" and fit.value < 0:
        return (f"min(1, C/(||g_i|| - {-fit.value:.3g})): an epsilon of the wrong sign, a clip *looser* than "
                f"min(1, C/||g_i||): every clipped sample keeps more than C (a privacy violation)")
    if fit.kind == "epsilon":
        return (f"min(1, C/(||g_i|| + {fit.value:.3g})): the norm's epsilon is {fit.value:.3g}, beyond the "
                f"{reference.MAX_CLIP_EPSILON:g} the gate accepts (opacus: {reference.CLIP_EPSILON:g}): every clipped "
                "sample is over-clipped (utility loss)")
    return f"{fit.value:.6g} x min(1, C/||g_i||): every coefficient scaled by one factor"


# -- mixed precision: error bounds derived from the compute dtype's unit roundoff ------------------

#: unit roundoff u = 2^-p of each compute dtype (p significand bits, the implicit one included): the
#: largest relative error of rounding one value to it (round to nearest)
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float32": 2.0 ** -24, "float64": 2.0 ** -53}

#: model sizes a mixed-precision case runs at: an accumulation error grows with the number of terms
#: summed, so a norm accumulated in bf16 (a fork's bug) only shows once a layer holds thousands of
#: coordinates of similar size (17k in the mlp's first layer; the default mlp has 99 in all, where
#: bf16 accumulation loses ~1%, below any honest bound). Still milliseconds per step on a CPU.
PRECISION_DIMS = {"mlp": (("d_in", 128), ("hidden", 128)), "transformer": (("d_ff", 64), ("d_model", 32))}


def precision_spec(spec: RunSpec) -> RunSpec:
    """``spec`` at ``PRECISION_DIMS`` when it computes in bf16 (unchanged otherwise, or when the
    spec already names its model sizes)."""
    if spec.precision == "fp32" or spec.model_kwargs or spec.model not in PRECISION_DIMS:
        return spec
    return spec.with_(model_kwargs=PRECISION_DIMS[spec.model])


@dataclass(frozen=True)
class PrecisionBound:
    """How far a correct implementation computing in ``spec.compute_dtype`` can be from the
    float64 reference, derived from the compute dtype's unit roundoff (``precision_bound``)."""

    precision: str
    u: float              # unit roundoff of the compute dtype (bf16: 2^-8)
    layers: int           # L: parameterised layers (an upper bound on the layers on any path)
    roundings: int        # K = 3 L + 2: bf16 roundings on the path of a per-sample gradient coordinate
    terms: int            # n: coordinates of one sample's gradient (summed in float32 for the norm)
    u_accumulate: float   # unit roundoff of the accumulation (float32: 2^-24)

    @property
    def coordinate(self) -> float:
        """K u: the relative error of one per-sample gradient coordinate (first order)."""
        return self.roundings * self.u

    @property
    def norm_rtol(self) -> float:
        """K u + n u_32: the relative error of a per-sample norm."""
        return self.coordinate + self.terms * self.u_accumulate

    def describe(self) -> str:
        return (f"{self.precision}: bf16 unit roundoff u = 2^-8 = {self.u:.4g}; a per-sample gradient coordinate is "
                f"the product of a bf16 activation and a bf16 backprop (exact in float32) carrying K = 3L + 2 = "
                f"{self.roundings} bf16 roundings to first order (input and loss gradient; per each of the L = "
                f"{self.layers} parameterised layers its weight, its output and its backprop), so it is within "
                f"K u = {self.coordinate:.3g} relative, and so is the norm; summing its n = {self.terms} squares in "
                f"float32 adds n 2^-24 = {self.terms * self.u_accumulate:.3g}. Norm bound: {self.norm_rtol:.3g} "
                "relative")


def precision_bound(spec: RunSpec) -> Optional[PrecisionBound]:
    """The error bound of ``spec``'s mixed precision (``None`` under ``fp32``: the dtype's own
    ``TOLERANCES`` apply). First-order rounding-error analysis: each rounding to bf16 perturbs a
    value by at most u relative, every operation's condition number taken as 1; errors along a path
    add up. The derivation is ``PrecisionBound.describe`` (docs/precision.md)."""
    if spec.precision == "fp32":
        return None
    model = reference_model(spec)
    layers = sum(1 for m in model.modules() if isinstance(m, reference.SUPPORTED_LAYERS)
                 and any(p.requires_grad for p in m.parameters(recurse=False)))
    terms = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return PrecisionBound(spec.precision, UNIT_ROUNDOFF["bfloat16"], layers, 3 * layers + 2, terms,
                          UNIT_ROUNDOFF["float32"])


def precision_coefficient_bounds(spec: RunSpec, bound: PrecisionBound, indices: Sequence[int]
                                 ) -> Tuple[float, float]:
    """``(coefficient tolerance, residual tolerance)`` of clip coefficients recovered from a
    released gradient computed under ``bound`` (``recover_clip_coefficients``). The target
    releases ``e + sum_j c_j g_j`` where, to first order, its coefficients are within
    ``norm_rtol c_j`` (its norms) and each coordinate of its per-sample gradients within ``K u``
    (its backward in bf16): ``|e| <= sum_j (norm_rtol + K u) c_j |g_j|`` coordinate-wise. The fit
    against the float64 ``g_j`` reads ``c_i`` through the dual vector ``h_i`` (``<h_i, g_j> =
    [i = j]``), so it recovers ``c_i`` within ``norm_rtol c_i + K u <|h_i|, sum_j c_j |g_j|>``,
    and leaves a relative residual of at most ``||(norm_rtol + K u) sum_j c_j |g_j||| /
    ||sum_j c_j g_j||``. Only the samples ``recover_clip_coefficients`` judges (identifiable) count."""
    indices = list(indices)
    grads = rows(reference_grads(spec), indices)
    basis = torch.cat([grads[n].reshape(len(indices), -1) for n in sorted(grads)], dim=1).T
    norms = basis.norm(dim=0)
    coef = reference.clip_coefficients(norms, spec.max_grad_norm)
    spread = basis.abs() @ coef                              # sum_j c_j |g_j|, coordinate-wise
    dual = torch.linalg.pinv(basis.T)                        # columns h_i: <h_i, g_j> = [i = j]
    seen = identifiable(basis, IDENTIFIABLE["bfloat16"])
    worst = 0.0
    for i in range(basis.shape[1]):
        if bool(seen[i]):
            worst = max(worst, bound.norm_rtol * float(coef[i]) + bound.coordinate * float(dual[:, i].abs() @ spread))
    released = float((basis @ coef).norm())
    return worst, (bound.norm_rtol + bound.coordinate) * float(spread.norm()) / max(released, 1e-300)


def precision_gradient_bound(spec: RunSpec, bound: PrecisionBound, indices: Sequence[int],
                             coefficients: torch.Tensor) -> float:
    """The bound on ``||released - sum_i c_i g_i / D||`` (2-norm over every parameter) for a
    gradient computed under ``bound``: ``(norm_rtol + K u) sum_i c_i ||g_i|| / D`` (each sample's
    coefficient within ``norm_rtol``, its gradient within ``K u`` in norm, first order), plus the
    float32 rounding of the result. Norm-wise, not per coordinate: a coordinate whose exact value
    is a difference of large terms (a LayerNorm bias, an attention key bias whose gradient
    softmax cancels to 0) carries bf16 rounding of the terms, not of itself."""
    grads = rows(reference_grads(spec), list(indices))
    flat = torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], dim=1)
    c = coefficients.to(torch.float64)
    spread = float(c @ flat.norm(dim=1)) / spec.divisor
    want = float((c @ flat).norm()) / spec.divisor
    return (bound.norm_rtol + bound.coordinate) * spread + bound.u_accumulate * want


#: what a property's ``judge`` may use (CONTRIBUTING.md's example uses ``tolerance``,
#: ``reference_model`` and ``reference_batch``); the data checks are the runner's
__all__ = ["TOLERANCES", "tolerance", "reference_model", "reference_batch", "reference_grads", "reference_norms",
           "device_facts", "tf32_problem", "rows", "processed_indices", "global_loss", "max_rel_diff", "tensors_close",
           "close", "non_finite",
           "all_padding_note", "pick_clip_bound", "smallest_norm", "norm_ratios", "sequence_weights", "fmt",
           "COEF_TOL", "IDENTIFIABLE", "identifiable", "RecoveredCoefficients", "recover_clip_coefficients",
           "CoefficientFit", "fit_clip_coefficients", "fit_clip_epsilon", "at_own_clip_epsilon", "describe_clip_fit", "UNIT_ROUNDOFF", "PRECISION_DIMS",
           "precision_spec", "PrecisionBound", "precision_bound", "precision_coefficient_bounds",
           "precision_gradient_bound", "with_picked_clip", "privacy_steps_problem", "omitted_layer_norms"]

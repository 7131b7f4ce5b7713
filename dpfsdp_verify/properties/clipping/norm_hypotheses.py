"""The wrong per-sample norms a target may clip with, each as a hypothesis a property tests the
measured norms or coefficients against: norms that count frozen parameters or a tied parameter's
uses wrongly (``finetune_norms``), a norm registry that misses a layer type (``omitted_layer_norms``),
a bias term counted for a layer without one (``phantom_bias_norms``), an Embedding's padding row counted
(``padding_row_norms``), a LayerNorm without affine parameters counted with them (``affine_free_norms``),
a per-sequence loss averaged over padding (``sequence_weights``); for a model given by its own code
(``docs/models.md``), one parameter's per-sample gradient summed over the local batch
(``batch_summed_norms``), named by the model's own parameter name.

DP meaning: an undercounted norm lets a sample contribute more than C (a privacy violation); the
others clip with a norm that is not the sample's (utility, or the objective). ``norm_fidelity`` and
``clipped_step`` name the hypothesis that fits in their message.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import List, Tuple, cast

from ...lazy import torch

from ...lazy import models, reference
from ...targets import RunSpec
from ..analysis.compare import reference_batch, reference_grads, reference_model, reference_norms
from ..analysis.memo import Memo


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
                out.append(((rest + sq(uses[u])).sqrt(), f"take the tied parameter {first!r} (also "
                                                         f"{', '.join(group[1:])}) "
                            f"from its use as {u!r} only: each use's hook sets the parameter's norm, the last one "
                            "wins; "
                            "its per-sample gradient is the sum over all its uses"))
            out.append(((rest + sum(sq(uses[u]) for u in group)).sqrt(), f"add the squared norms of the tied parameter "
                        f"{first!r}'s uses ({', '.join(group)}) as if they were separate parameters: the norm of "
                        "their sum has a cross term, which is dropped"))
    found = []
    for norms, what in out:
        below = bool((norms < true * (1 - 1e-9)).any())
        found.append(("undercount" if below else "mismatch", norms, what))
    return found


_OMITTED_CACHE: "Memo[List[Tuple[str, torch.Tensor, str]]]" = Memo(32)


def omitted_layer_norms(spec: RunSpec) -> List[Tuple[str, torch.Tensor, str]]:
    """The per-sample norms (over ``reference_batch(spec)``) of a norm registry that misses a layer
    type, as ``("undercount", norms, what it does)``: for each layer type of the model (``Linear``,
    ``GroupNorm``, ``Conv2d``...) the norms without every parameter of every layer of that type,
    and for each type whose layers hold a bias, the norms without those biases alone (a conv bias
    the per-sample code forgets). Such a target trains the missing parameters with the coefficients
    the other layers' norms give: a sample's norm is undercounted, so it can contribute more than
    C. The conv types together ("convolution") and the InstanceNorm types together are hypotheses
    too (a registry keyed by their base class). Cached per model and batch; only types that hold a trainable parameter,
    and not when the
    model has a single layer type (nothing would be left)."""
    key = (spec.model, spec.model_seed, spec.batch_seed, spec.reduction, spec.model_kwargs, spec.poisson,
           spec.dataset_size if spec.poisson else spec.global_batch_size)
    return _OMITTED_CACHE.get(key, lambda: _omitted_layer_norms(spec))


def _omitted_layer_norms(spec: RunSpec) -> List[Tuple[str, torch.Tensor, str]]:
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
            by_type[family] = cast(Tuple[List[str], List[str], List[str]],
                                   tuple(sum((list(x[i]) for x in present), []) for i in range(3)))
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
    return out


def phantom_bias_norms(spec: RunSpec) -> List[Tuple[str, torch.Tensor, str]]:
    """The per-sample norms (over ``reference_batch(spec)``) of a norm formula that adds a bias term to
    layers without a bias (a ghost norm written for ``nn.Linear(bias=True)``: the per-sample sum of
    the backprop over positions, squared), as ``("mismatch", norms, what it does)``: per layer type
    with bias-free layers (``Linear``, ``Conv2d``...), and for all of them at once. The norms are too
    large: samples are over-clipped (utility). Empty for a model whose layers all hold their bias."""
    import copy

    model = copy.deepcopy(reference_model(spec))
    by_type: "OrderedDict[str, List[str]]" = OrderedDict()
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)) and m.bias is None \
                and m.weight.requires_grad:
            # a zero bias leaves the forward unchanged; its per-sample gradient is the phantom term
            m.bias = torch.nn.Parameter(torch.zeros(m.weight.shape[0], dtype=m.weight.dtype))
            by_type.setdefault(type(m).__name__, []).append(name)
    if not by_type:
        return padding_row_norms(spec) + affine_free_norms(spec)
    grads = reference.per_sample_grads(model, reference_batch(spec), spec.reduction)
    true_sq = reference_norms(spec).pow(2)
    groups = list(by_type.items()) + ([("bias-free", sum(by_type.values(), []))] if len(by_type) > 1 else [])
    out: List[Tuple[str, torch.Tensor, str]] = []
    for kind, layers in groups:
        extra = sum(grads[f"{n}.bias"].flatten(1).pow(2).sum(1) for n in layers)
        out.append(("mismatch", (true_sq + extra).sqrt(), f"count a bias term for the {kind} "
                    f"layer{'s' if len(layers) > 1 else ''} {', '.join(repr(n) for n in layers)}, which "
                    f"{'have' if len(layers) > 1 else 'has'} no bias (bias=False): a norm formula written for "
                    "the layer with its bias adds the per-sample sum of the backprop, squared"))
    return out + padding_row_norms(spec) + affine_free_norms(spec)


def affine_free_norms(spec: RunSpec) -> List[Tuple[str, torch.Tensor, str]]:
    """The per-sample norms (over ``reference_batch(spec)``) of a LayerNorm norm formula that counts a weight
    and a bias for a LayerNorm without them (``elementwise_affine=False``): the per-sample gradients an
    affine LayerNorm at weight 1, bias 0 would have (same forward), as ``("mismatch", norms, what it
    does)`` for all such LayerNorms at once. Too large: over-clipped (utility). Empty without one."""
    import copy

    model = copy.deepcopy(reference_model(spec))
    plain = {name: m for name, m in model.named_modules()
             if isinstance(m, torch.nn.LayerNorm) and not m.elementwise_affine}
    if not plain:
        return []
    dtype = next(model.parameters()).dtype
    for m in plain.values():  # weight 1 and bias 0: the same forward, and the gradients they would have
        shape = tuple(m.normalized_shape)
        m.weight = torch.nn.Parameter(torch.ones(shape, dtype=dtype))
        m.bias = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        m.elementwise_affine = True
    grads = reference.per_sample_grads(model, reference_batch(spec), spec.reduction)
    extra = sum(grads[f"{n}.{p}"].flatten(1).pow(2).sum(1) for n in plain for p in ("weight", "bias"))
    return [("mismatch", (reference_norms(spec).pow(2) + extra).sqrt(),
             f"count a weight and a bias for the LayerNorm{'s' if len(plain) > 1 else ''} "
             f"{', '.join(repr(n) for n in plain)} without affine parameters (elementwise_affine=False), which "
             f"{'have' if len(plain) > 1 else 'has'} none: a norm formula written for the affine LayerNorm adds the "
             "per-sample gradients its weight and bias would have")]


def padding_row_norms(spec: RunSpec) -> List[Tuple[str, torch.Tensor, str]]:
    """The per-sample norms (over ``reference_batch(spec)``) of an Embedding norm that counts the padding
    row (``padding_idx``) as trained -- the backprop at the padding positions summed into it, a gradient
    torch never gives that row -- as ``("mismatch", norms, what it does)``, one per such Embedding. Too
    large for every sample holding a padding token (over-clipped: utility). Empty without one (also
    ``phantom_bias_norms``' tail: both count a gradient of a parameter that has none)."""
    import copy

    model = copy.deepcopy(reference_model(spec))
    embeddings = {name: m for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None and m.weight.requires_grad}
    padded = [(name, m.padding_idx) for name, m in embeddings.items()]
    if not padded:
        return []
    for m in embeddings.values():  # without padding_idx the padding row receives the backprop of its positions
        m.padding_idx = None
    grads = reference.per_sample_grads(model, reference_batch(spec), spec.reduction)
    true_sq = reference_norms(spec).pow(2)
    return [("mismatch", (true_sq + grads[f"{name}.weight"][:, row].flatten(1).pow(2).sum(1)).sqrt(),
             f"count a gradient for the padding row (padding_idx {row}) of the Embedding {name!r}, which has none "
             "(torch leaves that row untrained): the backprop at the padding positions is summed into it")
            for name, row in padded]


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


#: diagnosis hypotheses are judged with a looser tolerance than pass/fail: they only name a cause
HYPOTHESIS_RTOL = 1e-6


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` equals ``b`` within ``HYPOTHESIS_RTOL`` (a hypothesis matched)."""
    return bool(((a - b).abs() <= HYPOTHESIS_RTOL * b.abs() + 1e-12).all())


def borrowed_norms(got, want) -> dict:
    """``{rank: other rank}`` when every rank whose norms are wrong reports exactly the true norms
    of another rank's samples (a gather read at the wrong index); else ``{}``."""
    out = {}
    for r, g in enumerate(got):
        if len(g) == len(want[r]) and close(g, want[r]):
            continue
        j = next((j for j, w in enumerate(want) if j != r and len(w) == len(g) and len(g) and close(g, w)), None)
        if j is None:
            return {}
        out[r] = j
    return out


def right_prefix(got, want) -> int:
    """``k > 0`` when on every rank exactly the first ``k`` reported norms are right (the same ``k``,
    and every later one is wrong: the shape of a chunked per-sample computation whose first chunk is
    right); else 0."""
    ks = set()
    for g, w in zip(got, want):
        ok = ((g - w).abs() <= HYPOTHESIS_RTOL * w.abs() + 1e-12).tolist()
        k = ok.index(False) if False in ok else len(ok)
        if any(ok[k:]) or k == len(ok):
            return 0
        ks.add(k)
    return ks.pop() if len(ks) == 1 and min(ks) > 0 else 0


def batch_summed_norms(spec: RunSpec, steps) -> List[Tuple[str, list, str]]:
    """For a model given by its own code (``docs/models.md``: transformers, peft, a user's), whose layers
    the suite knows nothing of: ``("sample_mixing", per-rank norms, what it does)`` for each trainable
    parameter, the norms when that parameter's per-sample gradient is replaced by its sum over the
    rank's local batch -- an input broadcast over the batch (position ids of shape ``[1, T]``) read
    as a batch of one. Every sample's norm then holds the other samples' gradients of that parameter
    (not one factor on its own share: ``param_shares`` cannot name it). ``steps`` are the ranks'
    reports (``.indices``: the global samples each processed). Empty for the built-in models."""
    from ...models.catalog import MODEL_DIMS, contract_path

    if spec.model in MODEL_DIMS or contract_path(spec.model) is None:
        return []
    grads = reference_grads(spec)
    sq = {n: g.flatten(1).pow(2).sum(1) for n, g in grads.items()}
    total = torch.stack(list(sq.values())).sum(0)
    out: List[Tuple[str, list, str]] = []
    for name, g in grads.items():
        shown = []
        for s in steps:
            idx = list(s.indices)
            summed = g[idx].sum(0).flatten().pow(2).sum() if idx else torch.zeros((), dtype=total.dtype)
            shown.append((total[idx] - sq[name][idx] + summed).clamp(min=0).sqrt())
        out.append(("sample_mixing", shown,
                    f"take parameter {name!r}'s per-sample gradient as its sum over the local batch (an input "
                    "broadcast over the batch, such as position ids of shape [1, T], read as one sample): each "
                    "sample's norm holds the other samples' gradients of that parameter"))
    return out


__all__ = ["HYPOTHESIS_RTOL", "close", "borrowed_norms", "right_prefix", "finetune_norms", "omitted_layer_norms",
           "phantom_bias_norms", "padding_row_norms", "affine_free_norms", "sequence_weights", "batch_summed_norms"]

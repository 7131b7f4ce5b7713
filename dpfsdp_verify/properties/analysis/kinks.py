"""ReLU kinks under mixed precision: which activations a correct bf16 computation may put on the
other side of a ReLU than the float64 reference, and what each such flip does to a per-sample
gradient.

The first-order bound (``precision_bounds``) assumes the computation is differentiable along the
path. A ReLU is not: a pre-activation whose float64 value is within rounding of 0 (a sum of terms
that cancel: 0.0015 from terms of ~0.3 on a 1-channel conv) may come out of a bf16 forward with
the other sign, and then the backward passes (or blocks) that unit's whole backprop -- a change of
the per-sample gradient of order one, not of order u. A correct target can do that; a bound in u
cannot cover it, and a wider bound would hide real bugs. So the flips are *modelled*:

1. **Which units are ambiguous.** Each rounding of a bf16 computation perturbs one value by at most
   u relative (u = 2^-8). The float64 model is run ``SAMPLES`` times with every rounding site -- the
   input, every parameter, every module's output, every ReLU input -- multiplied by ``1 + u s``, s a
   random sign (the largest rounding each site can take, independently: the probabilistic model of
   rounding errors of Higham and Mary, 2019). A pre-activation's spread over those runs estimates
   ``u sqrt(sum_s a_s^2)``, the standard deviation of its first-order rounding error; it is
   ambiguous when ``|z| <= LAMBDA x spread``. By Hoeffding's inequality a sum of independent
   bounded errors leaves ``LAMBDA_EFFECTIVE`` standard deviations with probability at most
   ``2 exp(-LAMBDA_EFFECTIVE^2 / 2)`` (< 1e-6 per unit; ``LAMBDA`` also covers a spread
   underestimated from ``SAMPLES`` runs). Deterministic: the signs are drawn from a fixed seed.
2. **What a flip does.** For each ambiguous unit of sample i, the float64 per-sample gradient
   with that unit's ReLU mask flipped (and, when a sample has several, with all of them flipped):
   the difference from g_i is one *flip direction*.
3. **How the checks use them.** A released gradient is judged against the nearest point of
   ``{reference + sum_k t_k flip_k : 0 <= t_k <= 1}`` (a box-constrained least squares,
   ``nearest_with_flips``), then within the first-order bound; a reported norm within the
   first-order bound plus the norm of the sum of its sample's flips' magnitudes. A flip direction
   changes a few rows of one sample's gradient: it cannot absorb a clip scaling whole per-sample
   gradients (``NoClipMin``) or a norm missing a layer.

Only ``torch.relu`` / ``F.relu`` / ``Tensor.relu`` (and their in-place forms) are kinks here (the
suite's models and opacus' supported layers have no others; GELU, tanh, softmax are smooth).
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ...lazy import reference, torch
from ...targets import RunSpec
from .compare import flat, reference_batch, reference_model
from .memo import Memo

#: Monte Carlo runs that estimate each pre-activation's rounding spread
SAMPLES = 64
#: an activation is ambiguous within LAMBDA estimated standard deviations of 0. With SAMPLES = 64
#: the estimate is below 0.7 of the true spread with probability < 1e-5 (chi-square, 64 degrees of
#: freedom), so LAMBDA = 8 is at least LAMBDA_EFFECTIVE = 5.6 true standard deviations.
LAMBDA = 8.0
LAMBDA_EFFECTIVE = 5.6
#: the most flips modelled for one sample (each combination's norm is enumerated: 2^k vertices) and
#: for one batch (each is a backward pass, and a column of the box fit): a configuration with more has
#: too many activations within rounding of 0 for a bf16 verdict, and its bf16 judges skip it, saying so
MAX_PER_SAMPLE = 12
MAX_FLIPS = 1024
#: bf16's unit roundoff 2^-8 (precision_bounds.UNIT_ROUNDOFF, the same value)
BF16_UNIT_ROUNDOFF = 2.0 ** -8
#: seed of the Monte Carlo signs (the analysis is a function of the spec alone)
SEED = 20261128


def _kink_funcs():
    import torch.nn.functional as F
    return {torch.relu, F.relu, torch.Tensor.relu, torch.relu_, torch.Tensor.relu_}


_MODE = None


def _Relus(flips: Optional[Dict[int, "torch.Tensor"]] = None, jitter=None):
    """A torch function mode that records every ReLU input (in call order); ``flips[call]`` (a
    boolean tensor like the input) replaces that call's mask ``z > 0`` by ``(z > 0) ^ flips[call]``
    (the value becomes ``z * mask``, so autograd passes the backprop exactly where the mask is 1);
    ``jitter(z)`` perturbs each input first (a rounding of whatever computed it). Built on first use
    (the mode's base class is torch's)."""
    global _MODE
    if _MODE is None:
        class Relus(torch.overrides.TorchFunctionMode):
            def __init__(self, flips, jitter):
                super().__init__()
                self.inputs: List["torch.Tensor"] = []
                self.flips = flips or {}
                self.jitter = jitter
                self.funcs = _kink_funcs()

            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func not in self.funcs:
                    return func(*args, **kwargs)
                z, call = args[0], len(self.inputs)
                if self.jitter is not None:
                    z = self.jitter(z)
                self.inputs.append(z.detach())
                if call not in self.flips:
                    return func(z, *args[1:], **kwargs)
                mask = (z.detach() > 0) ^ self.flips[call]
                return z * mask.to(z.dtype)
        _MODE = Relus
    return _MODE(flips, jitter)


def _relu_inputs(model, x, jitter=None) -> List["torch.Tensor"]:
    with torch.no_grad(), _Relus(jitter=jitter) as mode:
        model(x)
    return mode.inputs


def _perturbed(model, x, u: float, gen) -> List["torch.Tensor"]:
    """The ReLU inputs of one run with every rounding site multiplied by ``1 + u s`` (s = +-1)."""
    import copy

    def sign(t):
        return (torch.randint(0, 2, t.shape, generator=gen, dtype=torch.int64) * 2 - 1).to(t.dtype)

    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1 + u * sign(p))
    hooks = [mod.register_forward_hook(lambda _m, _i, out: out * (1 + u * sign(out))
                                       if isinstance(out, torch.Tensor) and out.is_floating_point() else None)
             for mod in m.modules() if not list(mod.children())]
    try:
        xp = x * (1 + u * sign(x)) if x.is_floating_point() else x
        return _relu_inputs(m, xp, jitter=lambda z: z * (1 + u * sign(z)))
    finally:
        for h in hooks:
            h.remove()


@dataclass(frozen=True)
class Kinks:
    """The ambiguous ReLU units of a spec's reference batch and their flip directions."""

    units: int                                           # ReLU activations per sample
    ambiguous: Dict[int, int]                            # sample -> ambiguous units (only samples with any)
    flips: Dict[int, List[Dict[str, "torch.Tensor"]]]   # sample -> per-sample gradient change of each flip
    together: Dict[int, Dict[str, "torch.Tensor"]]      # sample -> the change with all its flips at once (>= 2)
    unmodelled: Tuple[int, ...] = ()                    # samples past MAX_PER_SAMPLE / MAX_FLIPS: no flips computed

    def unjudgeable(self, indices: Sequence[int]) -> str:
        """Why a bf16 verdict on the samples ``indices`` cannot be reached (``""`` if it can): some of
        them have more ReLU units within rounding of 0 than the judges model."""
        out = set(self.unmodelled)
        hit = [i for i in indices if i in out]
        if not hit:
            return ""
        n = sum(self.ambiguous.get(i, 0) for i in indices)
        return (f"not judged under bf16: {n} ReLU pre-activations of the {len(indices)} processed samples are within "
                f"rounding of 0 ({len(hit)} sample(s) beyond what the bf16 judges model: > {MAX_PER_SAMPLE} in one "
                f"sample or > {MAX_FLIPS} in the batch); a correct bf16 forward may flip any of them, each moving a "
                "sample's gradient by O(1), so no bound in bf16's unit roundoff decides this configuration "
                "(docs/precision.md, ReLU kinks)")

    def count(self, indices: Sequence[int]) -> int:
        return sum(self.ambiguous.get(i, 0) for i in indices)

    def directions(self, i: int) -> List[Dict[str, "torch.Tensor"]]:
        """Sample ``i``'s flip directions: each flip alone, then all at once (flips interact)."""
        return self.flips.get(i, []) + ([self.together[i]] if i in self.together else [])

    def describe(self, indices: Sequence[int]) -> str:
        n = self.count(indices)
        if not n:
            return ""
        samples = sum(1 for i in indices if i in self.ambiguous)
        return (f"{n} ReLU pre-activation(s) in {samples} of {len(indices)} sample(s) are within rounding of 0 "
                f"(|z| <= {LAMBDA:g} x their estimated bf16 rounding spread): a correct bf16 computation may put "
                "them on the other side of the kink, so the gradient is judged against the reference with any "
                "combination of those flips")


_CACHE: "Memo[Kinks]" = Memo(32)


def kinks(spec: RunSpec, u: float) -> Kinks:
    """The ambiguous ReLU units of ``reference_batch(spec)`` (step 0) at unit roundoff ``u`` and the
    flip direction of each (``Kinks``). Cached per model, batch and reduction."""
    key = (spec.model, spec.model_seed, spec.batch_seed, spec.reduction, spec.model_kwargs, spec.poisson,
           spec.dataset_size if spec.poisson else spec.global_batch_size, u)
    return _CACHE.get(key, lambda: _analyse(reference_model(spec), reference_batch(spec), spec.reduction, u))


def _analyse(model, batch, reduction: str, u: float) -> Kinks:
    model = model.to(torch.float64).train()
    x = batch.inputs
    true = _relu_inputs(model, x)
    if not true or len(batch) == 0:
        return Kinks(0, {}, {}, {})
    gen = torch.Generator().manual_seed(SEED)
    sq = [torch.zeros_like(z) for z in true]
    for _ in range(SAMPLES):
        runs = _perturbed(model, x, u, gen)
        if len(runs) != len(true) or any(a.shape != b.shape for a, b in zip(runs, true)):
            return Kinks(0, {}, {}, {})  # data-dependent control flow: no call-by-call correspondence
        for s, a, b in zip(sq, runs, true):
            s += (a - b) ** 2
    ambiguous_masks = [(z.abs() <= LAMBDA * (s / SAMPLES).sqrt()) & (s > 0) for z, s in zip(true, sq)]
    units = sum(int(z[0].numel()) for z in true)
    counts: Dict[int, int] = {}
    flips: Dict[int, List[Dict[str, "torch.Tensor"]]] = {}
    together: Dict[int, Dict[str, "torch.Tensor"]] = {}
    unmodelled: List[int] = []
    modelled = 0
    for i in range(len(batch)):
        where = [(c, idx) for c, m in enumerate(ambiguous_masks) for idx in m[i].flatten().nonzero().flatten().tolist()]
        if not where:
            continue
        counts[i] = len(where)
        if len(where) > MAX_PER_SAMPLE or modelled + len(where) > MAX_FLIPS:
            unmodelled.append(i)
            continue
        modelled += len(where)
        one = batch.select([i])
        base = _grad(model, one, reduction, {})
        flips[i] = [_minus(_grad(model, one, reduction, {c: _flip_mask(true[c], i, [idx])}), base) for c, idx in where]
        if len(where) > 1:
            by_call: Dict[int, List[int]] = {}
            for c, idx in where:
                by_call.setdefault(c, []).append(idx)
            together[i] = _minus(_grad(model, one, reduction,
                                       {c: _flip_mask(true[c], i, idxs) for c, idxs in by_call.items()}), base)
    return Kinks(units, counts, flips, together, tuple(unmodelled))


def _flip_mask(z_batch: "torch.Tensor", i: int, flat: List[int]) -> "torch.Tensor":
    m = torch.zeros(z_batch[i:i + 1].numel(), dtype=torch.bool)
    m[flat] = True
    return m.reshape(z_batch[i:i + 1].shape)


def _grad(model, one, reduction: str, flips) -> Dict[str, "torch.Tensor"]:
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    with _Relus(flips=flips):
        out = model(one.inputs)
        loss = reference.per_sample_losses(out, one.targets, one.loss, reduction)[0]
    g = torch.autograd.grad(loss, params, allow_unused=True)
    return {n: (torch.zeros_like(p) if gi is None else gi.detach()) for n, p, gi in zip(names, params, g)}


def _minus(a: Dict[str, "torch.Tensor"], b: Dict[str, "torch.Tensor"]) -> Dict[str, "torch.Tensor"]:
    return {n: a[n] - b[n] for n in a}


#: up to this many flips in one sample (MAX_PER_SAMPLE: all modelled ones), the largest norm over
#: their combinations is found at every vertex of the box (2^k of them); beyond, the triangle bound
ENUMERATE = MAX_PER_SAMPLE


_DEVIATIONS: "Memo[Tuple[Kinks, torch.Tensor]]" = Memo(64)


def norm_deviations(found: Kinks, grads, indices: Sequence[int], names: Sequence[str]) -> "torch.Tensor":
    """``_norm_deviations``, cached per analysis and samples (the norm and coefficient bounds both ask)."""
    # keyed by the analysis' identity, kept beside its value so a recycled id is never taken for it
    key = (id(found), tuple(indices))
    got = _DEVIATIONS.get(key, lambda: (found, _norm_deviations(found, grads, indices, names)))
    return got[1] if got[0] is found else _norm_deviations(found, grads, indices, names)


def _norm_deviations(found: Kinks, grads, indices: Sequence[int], names: Sequence[str]) -> "torch.Tensor":
    """``[len(indices)]``: per sample, how far any combination of its flips (``t`` in ``[0, 1]^k``)
    can move its gradient's norm from the reference's: ``max(||g|| - min, max - ||g||)`` over the
    box (the norm is convex in ``t``: its minimum is a box-constrained least squares, its maximum at a
    vertex). Zero for samples without an ambiguous unit."""
    out = torch.zeros(len(indices), dtype=torch.float64)
    for pos, i in enumerate(indices):
        dirs = found.flips.get(i, [])
        if not dirs:
            continue
        g = torch.cat([grads[n][i].reshape(-1) for n in names])
        cols = torch.stack([flat(d, names) for d in found.directions(i)], dim=1)
        norm = float(g.norm())
        # the lowest over the individual flips' box (the all-at-once direction, nearly their sum, would
        # only slow the solver), then the all-at-once vertex
        a = cols[:, :len(dirs)]
        t, rest = nearest_with_flips(-g, a)
        low = float(rest.norm())
        if low > 0:  # a solver short of the minimum would overstate it: take the convexity lower bound
            grad = (a.T @ -rest) / low  # f(t*) >= f(t) + min over the box of grad.(s - t) (Frank-Wolfe gap)
            low = max(0.0, low + float(grad.clamp(max=0.0).sum()) - float(grad @ t))
        if i in found.together:
            low = min(low, float((g + cols[:, -1]).norm()))
        if len(dirs) <= ENUMERATE:
            k = len(dirs)
            picks = torch.tensor([[(v >> j) & 1 for j in range(k)] for v in range(1 << k)], dtype=torch.float64)
            a = cols[:, :k]  # ||g + A t||^2 = ||g||^2 + 2 t.A^T g + t.A^T A t, from k x k numbers
            squares = norm * norm + 2 * picks @ (a.T @ g) + ((picks @ (a.T @ a)) * picks).sum(dim=1)
            high = math.sqrt(max(float(squares.max()), 0.0))
            if i in found.together:
                high = max(high, float((g + cols[:, -1]).norm()))
        else:
            high = norm + float(cols.abs().sum(dim=1).norm())
        out[pos] = max(norm - low, high - norm)
    return out


_COMPLEMENTS: "Memo[Tuple[Kinks, Optional[torch.Tensor]]]" = Memo(64)


def complement(found: Kinks, indices: Sequence[int], names: Sequence[str]) -> Optional["torch.Tensor"]:
    """``_complement``, cached per analysis and samples (the coefficient fit and its bound both ask)."""
    key = (id(found), tuple(indices))
    got = _COMPLEMENTS.get(key, lambda: (found, _complement(found, indices, names)))
    return got[1] if got[0] is found else _complement(found, indices, names)


def _complement(found: Kinks, indices: Sequence[int], names: Sequence[str]) -> Optional["torch.Tensor"]:
    """An orthonormal basis ``Q`` (``[P, k]``) of the span of the flip directions of the samples
    ``indices`` (``None`` if there is none): a least-squares fit of a released gradient against the
    per-sample gradients projected off it (``x - Q Q^T x``) recovers each sample's coefficient as a
    fit with the flips as free extra columns would (Frisch-Waugh-Lovell), whatever flips the target
    made."""
    cols = [flat(d, names) for i in indices for d in found.directions(i)]
    if not cols:
        return None
    # SVD, not QR: a flip direction that repeats others (a sample's "all at once" of one flip) would
    # leave QR an arbitrary column, and dropping it drops the later columns' parts along it
    u, sv, _ = torch.linalg.svd(torch.stack(cols, dim=1), full_matrices=False)
    keep = sv > 1e-12 * float(sv.max().clamp_min(1e-300))
    return u[:, keep] if bool(keep.any()) else None


def flip_columns(spec: RunSpec, found: Kinks, indices: Sequence[int], grads, coefficients: "torch.Tensor",
                 names: Sequence[str]) -> "torch.Tensor":
    """``[P, k]``: how each flip moves the released gradient -- ``(clip(g_i + d) - clip(g_i)) / D``
    for each flip direction ``d`` of each processed sample ``i`` (its clip coefficient recomputed
    from the flipped norm) -- parameters flattened in ``names`` order."""
    cols = []
    for pos, i in enumerate(indices):
        dirs = found.directions(i)
        if not dirs:
            continue
        g = torch.cat([grads[n][i].reshape(-1) for n in names])
        c = float(coefficients[pos])
        for d in dirs:
            moved = g + flat(d, names)
            c2 = float(reference.clip_coefficients(moved.norm().reshape(1), spec.max_grad_norm)[0])
            cols.append((c2 * moved - c * g) / spec.divisor)
    if not cols:
        return torch.zeros(0, 0, dtype=torch.float64)
    return torch.stack(cols, dim=1)


def nearest_with_flips(residual: "torch.Tensor", columns: "torch.Tensor", iterations: int = 3000
                       ) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """``(t, residual - columns @ t)`` with ``t`` in ``[0, 1]^k`` minimising the 2-norm of the second
    (projected accelerated gradient, FISTA, on the ``k x k`` normal equations; stops once a
    projected gradient step moves ``t`` by < 1e-10; a t short of the optimum only leaves a larger
    distance)."""
    k = columns.shape[1] if columns.dim() == 2 else 0
    if k == 0:
        return torch.zeros(0, dtype=torch.float64), residual
    gram = columns.T @ columns
    rhs = columns.T @ residual
    lip = float(torch.linalg.matrix_norm(gram, 2))
    if not lip > 0:
        return torch.zeros(k, dtype=torch.float64), residual
    t = torch.zeros(k, dtype=torch.float64)
    y, step = t.clone(), 1.0
    for it in range(iterations):
        t_next = (y - (gram @ y - rhs) / lip).clamp(0.0, 1.0)
        step_next = (1 + math.sqrt(1 + 4 * step * step)) / 2
        y = t_next + ((step - 1) / step_next) * (t_next - t)
        t, step = t_next, step_next
        if it % 20 == 19 and float(((t - (gram @ t - rhs) / lip).clamp(0.0, 1.0) - t).abs().max()) < 1e-10:
            break
    return t, residual - columns @ t


def bf16_kinks(spec: RunSpec) -> Optional[Kinks]:
    """``kinks`` at bf16's unit roundoff for a spec that computes in bf16 (``None`` under fp32)."""
    return None if spec.precision == "fp32" else kinks(spec, BF16_UNIT_ROUNDOFF)


__all__ = ["SAMPLES", "LAMBDA", "BF16_UNIT_ROUNDOFF", "Kinks", "kinks", "bf16_kinks", "norm_deviations",
           "complement", "flip_columns", "nearest_with_flips"]

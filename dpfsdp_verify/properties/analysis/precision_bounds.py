"""Mixed precision: how far a correct implementation computing in bf16 can be from the float64
reference, derived from the compute dtype's unit roundoff (first-order rounding-error analysis,
docs/precision.md), for per-sample norms, recovered clip coefficients and the released gradient;
and the model sizes a bf16 case runs at (``PRECISION_DIMS``, where a norm accumulated in bf16 shows).

DP meaning: no fixed tolerance is loosened for bf16; a bound derived from the arithmetic still
tells a fork's bf16 accumulation bug (a wrong norm, so a wrong clip) from honest rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ...lazy import torch

from ...lazy import reference
from ...targets import RunSpec
from .clipfit import IDENTIFIABLE, amplification, identifiable
from .compare import reference_batch, reference_grads, reference_model, rows, sample_columns
from .kinks import BF16_UNIT_ROUNDOFF, Kinks, complement, flip_columns, kinks, norm_deviations


#: unit roundoff u = 2^-p of each compute dtype (p significand bits, the implicit one included): the
#: largest relative error of rounding one value to it (round to nearest)
UNIT_ROUNDOFF = {"bfloat16": BF16_UNIT_ROUNDOFF, "float32": 2.0 ** -24, "float64": 2.0 ** -53}

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


def precision_kinks(spec: RunSpec, bound: PrecisionBound) -> Kinks:
    """The ReLU units of ``spec``'s reference batch a correct computation at ``bound``'s unit roundoff
    may flip, and what each flip does (``kinks.kinks``): where the first-order bound does not hold."""
    return kinks(spec, bound.u)


#: the largest relative condition of a normalisation's output in its inputs (``normalisation_condition``)
#: at which the first-order bound (every operation's condition number taken as 1) still judges a bf16
#: run: the default models' are 3.8-5.2 (precision dims); a draw's 2-feature LayerNorm over inputs
#: 0.399 and 0.364 had 22, and a correct target missed that bound by 4.4 x (gate run seed 40177)
NORM_CONDITION_MAX = 10.0


#: the largest bf16 rounding of a softmax's input, ``u max |x|`` (in the softmax's own units: its odds
#: move by up to e^that), at which the first-order bound still judges a bf16 run. A rounding that large
#: ties or swaps logits, and the backward through a tie is a rounding artefact that the clip's scaling
#: does not scale (docs/precision.md): gate seed 41100's draw reached u max |x| = 1.1e4 after 3 noisy
#: steps at lr 0.47 and one sample's clipped backward came out 63 x C; the default transformer's is 0.005
SOFTMAX_ROUNDING_MAX = 1.0


def _softmax_inputs(args, kwargs, func) -> Optional[torch.Tensor]:
    """The logits a softmax call rounds (those of ``scaled_dot_product_attention`` computed from its
    query, key and scale), or ``None`` for another function."""
    if func is torch.nn.functional.scaled_dot_product_attention:
        q = args[0] if args else kwargs.get("query")
        k = args[1] if len(args) > 1 else kwargs.get("key")
        if q is None or k is None or q.dim() < 3 or k.dim() != q.dim() or q.shape[-1] != k.shape[-1]:
            return None
        scale = kwargs.get("scale") or 1.0 / float(q.shape[-1]) ** 0.5
        if k.shape[-3] != q.shape[-3]:  # grouped-query attention: each key head serves several query heads
            if q.shape[-3] % k.shape[-3]:
                return None
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        return (q @ k.transpose(-1, -2)) * scale
    softmaxes = (torch.softmax, torch.log_softmax, torch.nn.functional.softmax, torch.nn.functional.log_softmax,
                 torch.Tensor.softmax, torch.Tensor.log_softmax)
    return args[0] if any(func is f for f in softmaxes) else None


def _normalisation_hook(worst: List[Tuple[float, str]], name: str):
    """A forward hook appending ``(kappa, name)`` of a LayerNorm's or GroupNorm's input to ``worst``."""
    def record(mod, inputs, output):
        x = inputs[0].detach()
        if isinstance(mod, torch.nn.LayerNorm):
            groups = x.reshape(*x.shape[:x.dim() - len(mod.normalized_shape)], -1)
        else:
            groups = x.reshape(x.shape[0], mod.num_groups, -1)
        if groups.numel():
            spread = (groups.var(-1, unbiased=False) + mod.eps).sqrt()
            worst.append((float((groups.abs().amax(-1) / spread).max()), name))
    return record


def _softmax_recorder(logits: List[Tuple[float, str]], inside: List[str]):
    """A torch function mode appending ``(largest finite |logit|, innermost running module)`` of every
    softmax call (``_softmax_inputs``) to ``logits``."""
    class Softmaxes(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            x = _softmax_inputs(args, kwargs, func)
            if x is not None:
                finite = x.detach()[torch.isfinite(x.detach())]
                if finite.numel():
                    logits.append((float(finite.abs().max()), inside[-1] if inside else "the model"))
            return func(*args, **kwargs)
    return Softmaxes()


def state_conditions(spec: RunSpec, indices: Sequence[int], params=None, step: int = 0
                     ) -> Tuple[Tuple[float, str], Tuple[float, str]]:
    """``((kappa, layer), (logit, where))`` of the float64 reference on the processed samples of
    ``step``'s batch, at ``params`` (a name -> tensor map; the initial model for ``None``):

    * ``kappa``: the largest ``max |x| / sqrt(var(x) + eps)`` over the normalisation groups of every
      LayerNorm and GroupNorm: a relative rounding ``u`` of the inputs moves the normalised output by up
      to ``kappa u`` (its inputs nearly agree, their spread is small against their size);
    * ``logit``: the largest finite ``|x|`` a softmax (or log-softmax, or scaled dot-product attention)
      of the model's forward takes: bf16 rounds it by up to ``u logit`` in the softmax's own units.

    ``(0.0, "")`` for a kind the model has none of."""
    model = reference_model(spec)
    batch = reference_batch(spec, step).select(list(indices))
    inputs = batch.inputs if isinstance(batch.inputs, tuple) else (batch.inputs,)
    at: Dict[str, torch.Tensor] = dict(model.named_parameters())
    at.update({n: p.detach().to(torch.float64) for n, p in (params or {}).items() if n in at})
    worst: List[Tuple[float, str]] = [(0.0, "")]
    logits: List[Tuple[float, str]] = [(0.0, "")]
    inside: List[str] = []  # the modules whose forward is running, innermost last

    def enter(name):
        return lambda mod, inputs: inside.append(name)

    def leave(mod, inputs, output):
        if inside:
            inside.pop()

    handles = [m.register_forward_hook(_normalisation_hook(worst, n)) for n, m in model.named_modules()
               if isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm))]
    for n, m in model.named_modules():
        if n:
            handles += [m.register_forward_pre_hook(enter(n)), m.register_forward_hook(leave)]
    try:
        with torch.no_grad(), _softmax_recorder(logits, inside):
            torch.func.functional_call(model, at, inputs)
    finally:
        for h in handles:
            h.remove()
    return max(worst), max(logits)


_SOFTMAX_MODELS: Dict[tuple, bool] = {}


def has_softmax(spec: RunSpec) -> bool:
    """Whether ``spec``'s model calls a softmax in its forward (``state_conditions`` at the initial model, once
    per model and dimensions)."""
    key = (spec.model, spec.model_seed, spec.model_kwargs)
    if key not in _SOFTMAX_MODELS:
        _SOFTMAX_MODELS[key] = bool(state_conditions(spec, [0])[1][1])
    return _SOFTMAX_MODELS[key]


def normalisation_condition(spec: RunSpec, indices: Sequence[int]) -> Tuple[float, str]:
    """``(kappa, layer)`` of ``state_conditions`` at the initial model."""
    return state_conditions(spec, indices)[0]


def beyond_first_order(spec: RunSpec, indices: Sequence[int], params=None, step: int = 0) -> str:
    """What puts the compute dtype's rounding at this state (``state_conditions``) beyond the first-order
    bound (``""`` where nothing does): a softmax whose inputs the compute dtype rounds by more than
    ``SOFTMAX_ROUNDING_MAX`` (bf16 under mixed precision, else the run's dtype: float32 only at logits
    beyond 1.7e7), or under bf16 a normalisation whose inputs nearly agree (kappa above
    ``NORM_CONDITION_MAX``)."""
    if not indices:
        return ""
    bf16 = spec.precision != "fp32"
    (kappa, layer), (logit, where) = state_conditions(spec, indices, params, step)
    if bf16 and kappa > NORM_CONDITION_MAX:
        return (f"the inputs of {layer!r} nearly agree on some sample (max |x| / std = {kappa:.3g} > "
                f"{NORM_CONDITION_MAX:g}), so bf16's rounding of them moves the normalised output up to {kappa:.3g} x "
                "more than the first-order bound allows (it takes every operation's condition number as 1; "
                "docs/precision.md)")
    u = UNIT_ROUNDOFF["bfloat16" if bf16 else spec.dtype]
    if u * logit > SOFTMAX_ROUNDING_MAX:
        return (f"a softmax in {where!r} takes logits up to {logit:.3g}, which {'bf16' if bf16 else spec.dtype} "
                f"rounds by up to u |x| = {u * logit:.3g} > {SOFTMAX_ROUNDING_MAX:g} (ties and swaps them: the "
                "softmax, and its backward through a tie, move by O(1), not by O(u) as the first-order bound takes "
                "it; docs/precision.md)")
    return ""


def state_unjudgeable(spec: RunSpec, indices: Sequence[int], params=None, step: int = 0) -> str:
    """``beyond_first_order`` as a verdict's reason: "not judgeable under <precision or dtype>: ..."."""
    why = beyond_first_order(spec, indices, params, step)
    return f"not judgeable under {spec.precision if spec.precision != 'fp32' else spec.dtype}: {why}" if why else ""


def precision_unjudgeable(spec: RunSpec, indices: Sequence[int]) -> str:
    """Why ``spec``'s bf16 verdict on the processed samples ``indices`` cannot be reached (``""``
    where it can, and always under fp32): more ReLU units within rounding of 0 than the judges
    model (``kinks.Kinks.unjudgeable``), or a state beyond the first-order bound (``state_unjudgeable``:
    a normalisation whose inputs nearly agree, a softmax whose logits bf16 rounds by more than 1; the
    bound takes every operation's condition number as 1)."""
    bound = precision_bound(spec)
    if bound is None:
        return ""
    kinked = precision_kinks(spec, bound).unjudgeable(list(indices))
    if kinked or not indices:
        return kinked
    return state_unjudgeable(spec, indices)


def precision_norm_tolerances(spec: RunSpec, bound: PrecisionBound, indices: Sequence[int],
                              want: torch.Tensor) -> torch.Tensor:
    """Per sample, how far a correct reported norm can be from the reference norm ``want``:
    ``norm_rtol |want|`` plus, for a sample with ambiguous ReLU units, the most any combination of
    its flips moves its norm (``kinks.norm_deviations``)."""
    grads = reference_grads(spec)
    return (bound.norm_rtol * want.abs().to(torch.float64)
            + norm_deviations(precision_kinks(spec, bound), grads, list(indices), sorted(grads)))


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
    ||sum_j c_j g_j||``. Only the samples ``recover_clip_coefficients`` judges (identifiable) count.
    With ambiguous ReLU units (``precision_kinks``) the fit runs off the span of their flip
    directions (``kinks.complement``: the flips a target made do not move the coefficients), the
    dual vectors are the projected basis', and a sample's coefficient may move with its norm by the
    most its flips move that norm (``kinks.norm_deviations``)."""
    indices = list(indices)
    grads = reference_grads(spec)
    names = sorted(grads)
    basis = sample_columns(grads, indices)
    norms = basis.norm(dim=0)
    coef = reference.clip_coefficients(norms, spec.max_grad_norm)
    found = precision_kinks(spec, bound)
    own = norm_deviations(found, grads, indices, names) / norms.clamp_min(1e-300)
    spread = basis.abs() @ coef                              # sum_j c_j |g_j|, coordinate-wise
    fit_basis = project_off(basis, complement(found, indices, names))
    amplified = amplification(fit_basis, spread)             # <|h_i|, spread>, h_i: <h_i, g_j> = [i = j]
    seen = identifiable(fit_basis, IDENTIFIABLE["bfloat16"], norms)
    worst = 0.0
    for i in range(basis.shape[1]):
        if bool(seen[i]):
            worst = max(worst, (bound.norm_rtol + float(own[i])) * float(coef[i])
                        + bound.coordinate * float(amplified[i]))
    released = float((basis @ coef).norm())
    return worst, (bound.norm_rtol + bound.coordinate) * float(spread.norm()) / max(released, 1e-300)


def project_off(x: torch.Tensor, q: Optional[torch.Tensor]) -> torch.Tensor:
    """``x - Q (Q^T x)`` (``x`` unchanged when ``q`` is ``None``)."""
    return x if q is None else x - q @ (q.T @ x)


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


def precision_flip_columns(spec: RunSpec, bound: PrecisionBound, indices: Sequence[int],
                           coefficients: torch.Tensor, names: Sequence[str]) -> torch.Tensor:
    """``[P, k]``: how each ReLU flip a correct computation may make moves the released gradient
    (``kinks.flip_columns``; ``[0, 0]`` when there is none)."""
    return flip_columns(spec, precision_kinks(spec, bound), list(indices), reference_grads(spec), coefficients, names)


__all__ = ["UNIT_ROUNDOFF", "PRECISION_DIMS", "precision_spec", "PrecisionBound", "precision_bound",
           "precision_kinks", "precision_unjudgeable", "precision_norm_tolerances", "precision_coefficient_bounds",
           "project_off", "precision_gradient_bound", "precision_flip_columns", "NORM_CONDITION_MAX",
           "SOFTMAX_ROUNDING_MAX", "state_conditions", "has_softmax", "normalisation_condition", "beyond_first_order",
           "state_unjudgeable"]

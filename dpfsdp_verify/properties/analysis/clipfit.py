"""Clip bounds and clip coefficients: the bound C a property picks (between the middle reference
norms, so some samples are clipped and some not), each sample's clip coefficient recovered from a
noise-0 released gradient (``recover_clip_coefficients``), the coefficient error those fit
(``fit_clip_coefficients``, in words ``describe_clip_fit``), and the clip epsilon a target uses
(``fit_clip_epsilon``, ``at_own_clip_epsilon``: DP-SGD's ``min(1, C/(||g|| + e))`` may carry any
``0 <= e <= MAX_CLIP_EPSILON``).

DP meaning: the clip coefficient is what bounds each sample's contribution by C; a coefficient
error (a wrong bound, a floor, a missing cap) changes the sensitivity the noise is calibrated for.
Plain functions of specs and tensors (docs/clipping.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ...config.defaults import CLIP_EPSILON, MAX_CLIP_EPSILON
from ...lazy import torch

from ...lazy import reference
from ...targets import RunSpec
from .kinks import bf16_kinks, complement
from .compare import (norm_picked, reference_batch, reference_grads, reference_model, reference_norms, sample_columns,
                      tensors_close)


def pick_clip_bound(spec: RunSpec, planning: bool = False) -> Optional[float]:
    """C between the two middle reference norms of step 0's global batch (a Poisson spec: of its
    dataset) (some samples clipped, some not: a missing ``min(1, .)`` or a wrong norm both show);
    ``None`` if they tie or the batch has fewer than two samples; ``compare.PLANNED_CLIP`` when
    ``planning`` (a dry run: ``compare.norm_picked``)."""
    if (spec.dataset_size if spec.poisson else spec.global_batch_size) < 2:
        return None
    return norm_picked(spec, _middle_bound, planning=planning)


def upper_clip(spec: RunSpec, planning: bool = False) -> RunSpec:
    """``spec`` with C between the two largest reference norms of its step-0 batch (Poisson: of its
    dataset): the largest sample clipped, the others not (``spec`` as it is if they tie). Where a
    run's outcome does not depend on C (``deadlock_free``'s scenarios, the gate's noisy long run), its
    noisy releases still feed the release judge (``releases/judge.py``), and a noise scale that
    depends on the batch's norms shows only on batches whose samples are all below C (at C = 1 every
    sample of the gate's models is clipped). ``planning``: as ``pick_clip_bound``'s."""
    c = norm_picked(spec, _between_largest, planning=planning)
    return spec if c is None else spec.with_(max_grad_norm=c)


def _between_largest(norms) -> Optional[float]:
    top = sorted(float(x) for x in norms)
    if len(top) < 2 or top[-1] - top[-2] < 1e-6 * top[-1]:
        return None
    return (top[-1] + top[-2]) / 2


def _middle_bound(norms: torch.Tensor) -> Optional[float]:
    n = torch.sort(norms).values
    lo, hi = float(n[len(n) // 2 - 1]), float(n[len(n) // 2])
    return None if hi - lo < 1e-6 * hi else (lo + hi) / 2


def clip_at_quantile(spec: RunSpec, quantile: float) -> float:
    """C at ``quantile`` in [0, 1] among the reference norms of step 0's global batch (a Poisson
    spec: of its dataset): 0 is half the smallest non-zero norm (every sample clipped), 1 is 1.5x the
    largest (none clipped), in between the midpoint of the two norms around that rank (some clipped,
    some not). What exploration draws C from (docs/explore.md)."""
    n = torch.sort(reference_norms(spec)).values
    positive = n[n > 0]
    if not len(positive):
        return 1.0
    i = round(min(max(quantile, 0.0), 1.0) * len(positive))
    if i == 0:
        return float(positive[0]) / 2
    if i == len(positive):
        return float(positive[-1]) * 1.5
    return (float(positive[i - 1]) + float(positive[i])) / 2


def with_picked_clip(spec: RunSpec, fallback: float = 1.0, planning: bool = False) -> RunSpec:
    """``spec`` with ``max_grad_norm`` set to ``pick_clip_bound(spec, planning)``, or to ``fallback``
    where no bound splits the batch (ties, fewer than two samples, a bound of 0)."""
    return spec.with_(max_grad_norm=pick_clip_bound(spec, planning) or fallback)



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
#: how far above the rounding a target's arithmetic leaves (``rounding_floor``) a coefficient's
#: tolerance and the fit's residual must stay: a coefficient whose estimated rounding error is above
#: ``COEF_TOL / ROUNDING_MARGIN`` is not judged; the residual bound is at least this many times the
#: floor's. The estimate is a typical size, not a bound: a correct target's coefficients on tiny
#: fuzzed models came out up to 0.45x it (float32), the default models' within ~0.5x
ROUNDING_MARGIN = 4.0


def identifiable(basis: torch.Tensor, min_distance: float, norms: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B]`` bool: which columns of ``basis`` (``[P, B]`` per-sample gradients) have a relative
    distance >= ``min_distance`` from the span of the other columns (relative to ``norms``, the
    columns' own norms unless given: a basis projected off other directions is judged against the
    norms before the projection)."""
    norms = basis.norm(dim=0) if norms is None else norms
    ok = norms > 1e-12 * float(norms.max().clamp_min(1e-300))
    for i in range(basis.shape[1]):
        others = torch.cat([basis[:, :i], basis[:, i + 1:]], dim=1)
        if ok[i] and others.shape[1]:
            col = basis[:, i:i + 1]
            proj = others @ torch.linalg.lstsq(others, col, driver="gelsd").solution
            ok[i] = float((col - proj).norm() / norms[i]) >= min_distance
    return ok


def amplification(basis: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """``[B]``: what a coordinate-wise error of at most ``error`` (``[P]``) in a released gradient
    ``sum_j c_j g_j`` does to each least-squares coefficient (``basis``: ``[P, B]`` per-sample
    gradients ``g_j``): it reaches ``c_i`` through the dual vector ``h_i`` (``<h_i, g_j> = [i = j]``)
    as at most ``<|h_i|, error>`` (``precision_bounds`` bounds bf16 compute the same way). Samples
    that are nearly collinear (a tiny model, near-duplicate inputs) have long dual vectors."""
    dual = torch.linalg.pinv(basis.T)
    return dual.abs().T @ error.to(basis.dtype)


_FLOAT32_GRADS: "Dict[tuple, Dict[str, torch.Tensor]]" = {}


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon: the largest relative error of one rounding in ``dtype``."""
    return torch.finfo(dtype).eps / 2


def rounding_floor(spec: RunSpec, indices: Sequence[int], basis: torch.Tensor, coefficients: torch.Tensor,
                   step: int = 0) -> torch.Tensor:
    """``[P]``: the rounding a correct target computing in ``spec.dtype`` typically leaves in each
    coordinate of its released ``sum_j c_j g_j``, measured on this model and batch: its per-sample
    gradients computed in float32 differ from the float64 ones (``basis``) by ``d_j`` -- the model's
    own sensitivity to rounding (a LayerNorm over two features cancels almost everything, so its
    gradients are rounding through and through), scaled to the target's unit roundoff -- so the
    floor is ``sum_j c_j (d_j u/u32 + u |g_j| + r_j |g_j|)``, where ``r_j`` is the relative rounding
    of sample j's norm (measured the same way) wherever it clips or its rounding reaches C: a correct
    target clips with its own rounded norm, so ``c_j = C / ||g_j||`` moves by ``r_j`` and moves every
    coordinate of that sample, also those whose own rounding is nil. A default model's floor is ~u of
    the terms summed; a tiny fuzzed one's can be thousands of times that (gate seed 41086: an mlp with
    a LayerNorm over 2 hidden features, one clipped sample's norm rounded by 1.4e-4, which moved the
    'norm.bias' coordinates of a correct float32 target 20x past their own rounding)."""
    u = unit_roundoff(spec.torch_dtype)
    low = _float32_basis(spec, indices, step)
    c = coefficients.to(torch.float64)
    scale = u / unit_roundoff(torch.float32)
    norms = basis.norm(dim=0)
    rel = (low.norm(dim=0) - norms).abs() * scale / norms.clamp_min(1e-300)
    clips = (norms * (1 + rel) >= float(spec.max_grad_norm)).to(torch.float64)
    return (low - basis).abs() @ c * scale + u * (basis.abs() @ c) + basis.abs() @ (c * rel * clips)


def norm_rounding(spec: RunSpec, indices: Sequence[int], step: int = 0) -> torch.Tensor:
    """``[len(indices)]``: how far rounding alone typically moves each sample's gradient norm when a
    target computes in ``spec.dtype``, measured as ``rounding_floor`` measures it (float32 norms
    against float64 ones on this model and batch, scaled to the dtype's unit roundoff). ~1e-7
    relative on the default models in float32; ~1e-3 on a tiny transformer (d_model=2)."""
    indices = list(indices)
    basis = sample_columns(reference_grads(spec, step), indices)
    u = unit_roundoff(spec.torch_dtype)
    low = _float32_basis(spec, indices, step)
    return (low.norm(dim=0) - basis.norm(dim=0)).abs() * (u / unit_roundoff(torch.float32))


def _float32_basis(spec: RunSpec, indices: Sequence[int], step: int) -> torch.Tensor:
    """``[P, B]``: the per-sample gradients of ``indices`` computed in float32 (cached per model and
    batch), as float64 columns in ``reference_grads``' parameter order."""
    key = (spec.model, spec.model_seed, spec.batch_seed, spec.reduction, spec.model_kwargs, spec.poisson,
           spec.dataset_size if spec.poisson else spec.global_batch_size, 0 if spec.poisson else step)
    grads32 = _FLOAT32_GRADS.get(key)
    if grads32 is None:
        grads32 = reference.per_sample_grads(reference_model(spec), reference_batch(spec, step), spec.reduction,
                                             dtype=torch.float32, own=True)
        if len(_FLOAT32_GRADS) >= 32:
            _FLOAT32_GRADS.clear()
        _FLOAT32_GRADS[key] = grads32
    return sample_columns(grads32, indices)


@dataclass
class RecoveredCoefficients:
    """Per-sample clip coefficients read back from a released (noise 0) gradient."""

    indices: List[int]            # the processed samples, in the order of ``coefficients``
    coefficients: torch.Tensor    # [len(indices)] float64 least-squares c_i
    #: relative residual of the fit: > COEF_TOL (or ``residual_floor``) means not sum_i c_i g_i
    residual: float
    #: [len(indices)] bool: which c_i the data determine (``identifiable``) to within ``COEF_TOL``
    #: (``rounding_error`` <= ``COEF_TOL / ROUNDING_MARGIN``): the only ones a check may judge
    identifiable: torch.Tensor
    #: [len(indices)] each c_i's typical error from the target's rounding (``rounding_floor`` through
    #: ``amplification``); ``None`` under bf16 compute (``precision_bounds`` bounds it)
    rounding_error: Optional[torch.Tensor] = None
    #: the residual the target's rounding alone leaves, relative, times ``ROUNDING_MARGIN``: a residual
    #: bound below it cannot be held
    residual_floor: float = 0.0
    #: the dtype the coefficients' tolerance is read for (``COEF_TOL``)
    dtype: str = "float64"

    @property
    def ill_conditioned(self) -> int:
        """How many coefficients are left unjudged because rounding alone moves them past
        ``COEF_TOL / ROUNDING_MARGIN`` (nearly collinear samples of a tiny model)."""
        if self.rounding_error is None:
            return 0
        return int((self.rounding_error > COEF_TOL.get(self.dtype, COEF_TOL["float64"]) / ROUNDING_MARGIN).sum())

    def residual_bound(self, tol: float) -> float:
        """The residual bound to hold: ``tol``, or the rounding floor where that is higher."""
        return max(tol, self.residual_floor)


def recover_clip_coefficients(spec: RunSpec, indices: Sequence[int], gradient: Dict[str, torch.Tensor],
                              step: int = 0) -> RecoveredCoefficients:
    """With noise 0 the released gradient times the divisor D (``spec.expected_batch_size`` under
    ``mean``, 1 under ``sum``) is ``sum_i c_i g_i`` over the processed samples ``indices``; a
    least-squares fit against the reference per-sample gradients ``g_i`` at the initial parameters
    (far more parameters than samples) recovers each ``c_i``. Step 0 only (later steps are at other
    parameters)."""
    indices = list(indices)
    grads = reference_grads(spec, step)
    names = sorted(grads)
    basis = sample_columns(grads, indices)
    d = spec.divisor
    released = torch.cat([gradient[n].reshape(-1).to(torch.float64) for n in names]) * d
    whole = released.norm().clamp_min(1e-300)
    found = bf16_kinks(spec) if step == 0 else None
    q = complement(found, indices, names) if found is not None else None
    norms = basis.norm(dim=0)
    if q is not None:  # ReLU flips a correct bf16 target may make: fitted off their span (kinks.py)
        basis, released = basis - q @ (q.T @ basis), released - q @ (q.T @ released)
    # gelsd (SVD): torch's default CPU driver (gelsy) returns a wrong solution, with a residual above
    # 1, when samples repeat exactly (measured on a fuzzed transformer with duplicate inputs)
    coef = torch.linalg.lstsq(basis, released.unsqueeze(1), driver="gelsd").solution.squeeze(1)
    residual = float((basis @ coef - released).norm() / whole)
    # bf16 compute rounds each gradient far more than its float32 parameters do
    key = "bfloat16" if spec.precision != "fp32" else spec.dtype
    seen = identifiable(basis, IDENTIFIABLE.get(key, IDENTIFIABLE["float64"]), norms)
    if key == "bfloat16":  # precision_bounds sizes its tolerances from the same dual vectors
        return RecoveredCoefficients(indices, coef, residual, seen, dtype=key)
    # what the target's own rounding does here, with the reference's coefficients (a target's could
    # be anything): coefficients it moves past the tolerance are not judged, nor a residual below it
    floor = rounding_floor(spec, indices, basis, reference.clip_coefficients(basis.norm(dim=0), spec.max_grad_norm),
                           step)
    error = amplification(basis, floor)
    seen = seen & (error <= COEF_TOL.get(key, COEF_TOL["float64"]) / ROUNDING_MARGIN)
    residual_floor = ROUNDING_MARGIN * float(floor.norm() / released.norm().clamp_min(1e-300))
    return RecoveredCoefficients(indices, coef, residual, seen, error, residual_floor, key)


def fit_clip_epsilon(evaluate: Callable[[float], torch.Tensor], got: torch.Tensor) -> float:
    """The clip epsilon ``e`` in ``[0, MAX_CLIP_EPSILON]`` whose reference output
    ``evaluate(e)`` (a flat float64 tensor: coefficients, a gradient, a trajectory's parameters) is
    nearest to ``got``: DP-SGD's ``min(1, C/||g||)`` may carry any epsilon in that range
    (``MAX_CLIP_EPSILON``), so a check compares with the reference at the target's own.
    The output is smooth in ``e`` and the range is tiny: ``got`` projected on the line through
    ``evaluate(0)`` and ``evaluate(MAX_CLIP_EPSILON)``, clamped to the range. A looser clip (``e < 0``)
    or a far larger epsilon comes out at an end of the range, where the caller's comparison fails."""
    top = MAX_CLIP_EPSILON
    low, high = evaluate(0.0), evaluate(top)
    step = high - low
    span = float(step @ step)
    if span == 0.0:  # no sample is near or above C: the epsilon changes nothing
        return CLIP_EPSILON
    t = float((got.to(torch.float64) - low) @ step) / span
    return min(max(t, 0.0), 1.0) * top


def at_own_clip_epsilon(make: Callable[[float], "reference.Trajectory"], got: Dict[str, torch.Tensor],
                        rtol: float, atol: float) -> Tuple["reference.Trajectory", float]:
    """``(reference trajectory, epsilon)``: ``make(e)`` (the reference at clip epsilon ``e``) at
    opacus' epsilon, or -- where the parameters ``got`` after the last step differ from it -- at the
    accepted epsilon nearest to them (``fit_clip_epsilon``) if they match that one. A caller then
    compares with the trajectory returned; a target outside the accepted range still differs."""
    ref = make(CLIP_EPSILON)
    if tensors_close(got, ref.parameters, rtol, atol):
        return ref, CLIP_EPSILON
    names = sorted(n for n in ref.parameters if n in got and got[n].shape == ref.parameters[n].shape)
    if len(names) != len(ref.parameters):
        return ref, CLIP_EPSILON

    def flat(params: Dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([params[n].reshape(-1).to(torch.float64) for n in names])

    eps = fit_clip_epsilon(lambda e: flat(make(e).parameters), flat(got))
    own = make(eps)
    return (own, eps) if tensors_close(got, own.parameters, rtol, atol) else (ref, CLIP_EPSILON)


def spec_trajectory_at_own_epsilon(spec: RunSpec, batches: Sequence, got: Dict[str, torch.Tensor], rtol: float,
                                   atol: float, **extra) -> Tuple["reference.Trajectory", float]:
    """``at_own_clip_epsilon`` of the reference DP-SGD trajectory of ``spec`` (its model, lr, C,
    reduction and expected batch size) over ``batches``; ``extra``: ``dp_sgd_trajectory``'s other
    keywords (``momentum``, ``empty_steps``)."""
    return at_own_clip_epsilon(lambda e: reference.dp_sgd_trajectory(
        reference_model(spec), batches, lr=spec.lr, max_grad_norm=spec.max_grad_norm, reduction=spec.reduction,
        expected_batch_size=spec.expected_batch_size, clip_epsilon=e, **extra), got, rtol, atol)


@dataclass(frozen=True)
class CoefficientFit:
    """A clip-coefficient error that reproduces measured coefficients: ``kind`` is ``bound`` (clips
    at ``value`` x C), ``floor`` (``max(min(1, C/n), value)``), ``cap`` (``min(value, C/n)``: the
    cap of ``min(1, .)`` is ``value``; ``inf``: no cap at all), ``epsilon`` (``min(1, C/(n +
    value))`` instead of opacus' ``n + 1e-6``) or ``scale`` (``value`` x ``min(1, C/n)``)."""

    kind: str
    value: float
    max_error: float


def epsilon_rounding(coef: torch.Tensor, norms: torch.Tensor, c: float,
                     coef_error: Optional[torch.Tensor] = None) -> float:
    """How far from 0 rounding alone can put a clip epsilon fitted to the clipped samples' measured
    coefficients ``coef`` (true norms ``norms``, bound ``c``), as ``fit_clip_coefficients`` fits it:
    ``e = C/c_i - ||g_i||``, so an error ``dc_i`` in a coefficient moves ``e`` by
    ``C dc_i / c_i^2`` -- the coefficient's own rounding (``coef_error``, e.g.
    ``RecoveredCoefficients.rounding_error``: the target's rounding amplified by the fit's
    conditioning; else one float64 unit roundoff of it) through that amplification -- and the
    subtraction from ``||g_i||`` rounds once more (``u ||g_i||``). The largest over the clipped
    samples, times ``ROUNDING_MARGIN`` (the estimates are typical sizes, not bounds). An epsilon
    of the wrong sign this small is float64 rounding of ``min(1, C/||g_i||)`` exactly (measured:
    -8.9e-16 and 1.8e-15 at norms ~4, against a scale of ~1e-14), not a looser clip."""
    coef, norms = coef.to(torch.float64), norms.to(torch.float64)
    clipped = (coef > 0) & (coef < 1)
    if not bool(clipped.any()):
        return 0.0
    u = unit_roundoff(torch.float64)
    err = coef_error.to(torch.float64)[clipped] if coef_error is not None else torch.zeros(int(clipped.sum()),
                                                                                           dtype=torch.float64)
    k = coef[clipped]
    err = torch.maximum(err, u * k)
    scale = c * err / k.pow(2) + u * (norms[clipped] + c / k)
    return ROUNDING_MARGIN * float(scale.max())


def fit_clip_coefficients(coef: torch.Tensor, norms: torch.Tensor, c: float, tol: float,
                          coef_error: Optional[torch.Tensor] = None) -> Optional[CoefficientFit]:
    """The first coefficient error (``CoefficientFit`` kinds, in that order) whose one parameter,
    estimated from ``coef`` (measured per-sample coefficients) and ``norms`` (the true norms),
    predicts every coefficient within ``tol`` (relative to max(1, the prediction)); ``None`` if
    none fits. Only called for coefficients that differ from ``min(1, C/(n + 1e-6))``. A fitted
    epsilon within rounding of 0 (``epsilon_rounding``, from ``coef_error``: each coefficient's
    rounding error) counts as 0; an epsilon the gate accepts (``0 <= e <= MAX_CLIP_EPSILON``) is
    no error, so never the fit returned."""
    coef, norms = coef.to(torch.float64), norms.to(torch.float64)
    if not len(coef) or not bool(torch.isfinite(coef).all()):
        return None
    eps = CLIP_EPSILON
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
        if abs(e) <= epsilon_rounding(coef, norms, c, coef_error):
            e = 0.0  # rounding of an exact min(1, C/||g_i||), not an epsilon of either sign
        if 0.0 <= e <= MAX_CLIP_EPSILON:
            pass  # an accepted clip form: not the error sought
        elif e > -float(norms.min()):
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
                f"{MAX_CLIP_EPSILON:g} the gate accepts (opacus: {CLIP_EPSILON:g}): every clipped "
                "sample is over-clipped (utility loss)")
    return f"{fit.value:.6g} x min(1, C/||g_i||): every coefficient scaled by one factor"


__all__ = ["clip_at_quantile", "pick_clip_bound", "upper_clip", "with_picked_clip", "COEF_TOL", "IDENTIFIABLE",
           "identifiable", "ROUNDING_MARGIN",
           "amplification", "rounding_floor", "epsilon_rounding", "norm_rounding", "RecoveredCoefficients",
           "recover_clip_coefficients", "fit_clip_epsilon", "at_own_clip_epsilon", "spec_trajectory_at_own_epsilon",
           "CoefficientFit", "fit_clip_coefficients", "describe_clip_fit"]

"""clipped_step: with noise 0, one DP step's gradient and parameters equal the reference DP-SGD step.

DP meaning: the released gradient must be exactly ``(sum_i min(1, C/||g_i||) g_i) / D`` before
noise; any other scale changes the signal-to-noise ratio the privacy accounting assumed (a smaller
signal is relatively more noise: utility lost; a sample scaled up beyond its clip is a bigger
influence than analysed).

The clip bound C is set between the middle two reference norms of the global batch, so some
samples are clipped and some are not: a missing ``min(1, .)`` or a wrong norm both show. Split
data by default (opacus defines the FSDP step for a ``DistributedSampler`` over the global data).
Under Poisson sampling (the sampling axis, ``Point.spec``) the step is one step of DP-SGD's own
Poisson sampling: the reference recomputes it on the realised batch (the union of what
the ranks drew) with the normalisation opacus defines for ``"mean"``, the expected batch size
``int(q * N)``, not the realised one. With the option ``physical_batch_size`` p (CLI
``--physical-batch-size``) the step is computed by gradient accumulation in physical passes of at
most p samples (fixed local batches of 4 and p = 3: two passes of 2, each smaller than p) and must
still equal the unsplit reference step (noise 0). A failure tests simple explanations against the numbers (a constant factor such as 1/world_size,
an uncapped clip coefficient, different norms) and says which one fits; the diagnosis is
``mismatch``.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from .. import reference
from ..targets import RunSpec
from ..verdict import Verdict
from .compare import (fmt, max_rel_diff, pick_clip_bound, processed_indices, reference_batch,
                      reference_grads, reference_model, rows, tensors_close, tolerance)
from .contract import Case, FuzzRecipe, Outputs, Point, Prepared, Property

FIT_RTOL = 1e-6


def prepare(spec: RunSpec) -> Prepared:
    """``spec`` clipped between its two middle reference norms, or why that is impossible."""
    c = pick_clip_bound(spec)
    if c is None:
        return "reference norms tie: no clip bound separates clipped from unclipped samples"
    return spec.with_(max_grad_norm=c)


def cases(point: Point):
    spec = point.spec(global_batch_size=4 * point.world_size)
    if point.param("physical_batch_size"):
        spec = spec.with_(physical_batch_size=point.param("physical_batch_size"))
    ready = prepare(spec)
    case = point.case(ready if isinstance(ready, RunSpec) else spec, doing="one DP step with noise 0")
    yield case.verdict("skip", None, ready) if isinstance(ready, str) else case


def reference_step(spec: RunSpec, indices: List[int], coefficients=None):
    """``(DPStep, expected parameters)`` for the samples ``indices`` of step 0."""
    model = reference_model(spec)
    step = reference.dp_sgd_gradient(model, reference_batch(spec).select(indices), max_grad_norm=spec.max_grad_norm,
                                     reduction=spec.reduction, expected_batch_size=spec.expected_batch_size)
    # a frozen parameter has no gradient: it stays as it was
    params = {n: p.detach() - spec.lr * step.gradient[n] if n in step.gradient else p.detach()
              for n, p in model.named_parameters()}
    return step, params


def judge(case: Case, runs: Outputs) -> Verdict:
    spec, ws, outputs = case.spec, case.world_size, runs[0][0]
    rtol, atol = tolerance(spec.dtype)
    if any(not o.steps for o in outputs):
        return case.verdict("fail", "mismatch", "a rank reported no step")
    indices = processed_indices(outputs, 0, spec)
    step, params = reference_step(spec, indices)
    clipped = int((step.coefficients < 1).sum())
    evidence = {"max_grad_norm": spec.max_grad_norm, "samples": len(indices), "clipped": clipped}
    for r, o in enumerate(outputs):
        s = o.steps[0]
        g_err, g_name = max_rel_diff(s.gradient, step.gradient)
        p_err, p_name = max_rel_diff(s.parameters, params)
        evidence.update({f"rank{r}_grad_rel_err": g_err, f"rank{r}_param_rel_err": p_err})
        if not tensors_close(s.gradient, step.gradient, rtol, atol):
            return case.verdict("fail", "mismatch", explain(case, s, step, indices, r, g_err, g_name), evidence)
        if not tensors_close(s.parameters, params, rtol, atol):
            return case.verdict("fail", "mismatch", (
                f"rank {r}: the gradient is right but the parameters after the step differ from "
                f"p - lr * grad (lr={spec.lr}) by up to {fmt(p_err)} relative (worst {p_name!r}): the "
                "optimizer does not apply the DP gradient it computed"), evidence)
    return case.verdict("pass", None, (
        f"DP step equals the reference at world_size={ws} ({clipped} of {len(indices)} samples clipped at "
        f"C={spec.max_grad_norm:.4g}; max relative error {fmt(max(v for k, v in evidence.items() if 'err' in k))})"),
        evidence)


def _flat(d: Dict[str, torch.Tensor], names) -> torch.Tensor:
    return torch.cat([d[n].reshape(-1).to(torch.float64) for n in names])


def explain(case: Case, s, step, indices, rank: int, err: float, name: str) -> str:
    """Which simple hypothesis the wrong gradient fits."""
    spec, ws = case.spec, case.world_size
    head = (f"rank {rank}: the DP gradient (noise 0) differs from the reference by up to {fmt(err)} relative "
            f"(worst {name!r}) at world_size={ws}, reduction={spec.reduction}")
    names = [n for n in step.gradient if n in s.gradient and s.gradient[n].shape == step.gradient[n].shape]
    if len(names) != len(step.gradient):
        missing = sorted(set(step.gradient) - set(names))
        return f"{head}: parameters missing or of the wrong shape: {missing}"
    got, want = _flat(s.gradient, names), _flat(step.gradient, names)
    k = float(got @ want / (want @ want))
    if float((got - k * want).abs().max()) <= FIT_RTOL * float(want.abs().max()):
        why = ""
        if ws > 1 and abs(k - 1 / ws) < FIT_RTOL:
            why = (f" = 1/world_size: the cross-rank gradient reduction averages over the {ws} ranks (FSDP "
                   "reduce-scatter AVG) and nothing compensates; the signal is 1/N of the DP-SGD sum, so the "
                   "noise is relatively N times too large (utility loss)")
        elif ws > 1 and abs(k - ws) < FIT_RTOL * ws:
            why = " = world_size: the gradient is summed over ranks where it should be averaged"
        elif spec.physical_batch_size and abs(k * spec.physical_batch_size * ws - spec.expected_batch_size) < \
                FIT_RTOL * spec.expected_batch_size:
            why = (f" = expected batch {spec.expected_batch_size} / ({spec.physical_batch_size} x {ws}): the step is "
                   "normalised by the physical batch, not the expected logical batch (clipped signal and noise "
                   "scaled alike: not the DP-SGD step the accounting describes)")
        return f"{head}: it is exactly {k:.6g} x the reference{why}."
    # clip coefficients without min(1, .)
    grads = rows(reference_grads(spec), indices)
    uncapped = spec.max_grad_norm / (step.norms + reference.CLIP_EPSILON)
    d = float(spec.expected_batch_size) if spec.reduction == "mean" else 1.0
    alt = {n: v / d for n, v in reference.clipped_sum(grads, uncapped).items()}
    if float((got - _flat(alt, names)).abs().max()) <= FIT_RTOL * float(want.abs().max()):
        n_up = int((step.norms < spec.max_grad_norm).sum())
        return (f"{head}: it equals the step with clip coefficients C/||g_i|| *not capped at 1*: the {n_up} "
                "sample(s) with norm below C are scaled up to norm C instead of being left alone.")
    if s.norms is not None and len(s.norms) == len(s.indices):
        ref_own = step.norms[[indices.index(i) for i in s.indices]]
        nerr = float(((s.norms.to(torch.float64) - ref_own).abs() / ref_own).max())
        if nerr > 1e-6:
            return (f"{head}: the per-sample norms this rank clipped with are off by up to {fmt(nerr)} "
                    "relative (see norm_fidelity), so its clip coefficients are wrong.")
    return f"{head}: no simple explanation (constant factor, uncapped clipping, wrong norms) fits."


PROPERTY = Property(
    id="clipped_step",
    meaning=("with noise 0 the DP step equals sum_i min(1, C/||g_i||) g_i / D: the signal the privacy "
             "accounting assumes, neither scaled nor with unclipped samples"),
    cases=cases, judge=judge, models=("mlp", "transformer"), layouts=("split",), reductions=("mean", "sum"),
    dtypes=("float64", "float32"), samplings=("fixed", "poisson"), params=(("physical_batch_size", 0),),
    # split data (the layout opacus defines a DP step for), >= 2 samples so a clip bound separates them
    fuzz=FuzzRecipe(draw=(("layouts", ("split",)), ("min_global_batch", 2)), prepare=prepare))

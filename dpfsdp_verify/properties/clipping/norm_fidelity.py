"""norm_fidelity: the per-sample norms a target clips with equal the reference, in each data layout.

DP meaning: the clip coefficient ``min(1, C/||g_i||)`` bounds each sample's influence only if
``||g_i||`` is that sample's true gradient norm. Inflated norms over-clip (utility lost, silently);
under-counted norms under-clip (a sample can contribute more than C: the privacy guarantee is void).

Cases: a local batch of 4 at every point, and once per world size (mlp, split, float64) a local
batch of ``LARGE_LOCAL_BATCH`` = 33 as a second spec of the same case, judged once the first
passes (one verdict: a failure says "at a local batch of 33 per rank"): a fork that computes per-sample
gradients in chunks (to bound memory) and gets a later chunk wrong is right on every batch of
one chunk.

Each rank reports, per step, the global indices it processed and the norms it clipped them with;
they are compared with float64 per-sample norms of the same samples on one process. A failure is
explained by testing the known bug shapes against the numbers, in this order:

* ``sqrt_n_inflation`` -- every norm is sqrt(N) times the truth: complete norms all-reduced (SUM
  of norm^2) across N ranks that each already held the whole sample;
* ``sample_mixing`` -- on split data, each reported norm is the root-sum-square of the true norms
  of the samples at the same position on every rank: norm^2 all-reduced across ranks holding
  *different* samples; or some rank reports (clips with) exactly another rank's true norms: norms
  gathered across ranks and read back at the wrong index (``LOCAL_RANK``, ``rank % 2``), which
  shows from the third rank on (the wide case, ``horizon.py``: one split step at 3 ranks; the same
  step at the node world size, 4 ranks as 2 nodes x 2, where a path that all-reduces the norms only
  from 4 ranks on shows);
* ``undercount`` -- every reported norm is below the truth (e.g. computed over the local parameter
  shard only; the message says when the ranks' squares add up to the truth);
* ``mismatch`` -- anything else (wrong samples, wrong shapes, unexplained values).

What a target *reports* is not trusted to be what it *clips with*: with noise 0 the released
gradient is ``sum_i c_i g_i / D`` over the processed samples, so a least-squares fit against the
reference per-sample gradients (far more parameters than samples) recovers each sample's clip
coefficient ``c_i``; they are compared with ``min(1, C/(||g_i|| + e))``, e the target's own epsilon
if it lies in ``[0, MAX_CLIP_EPSILON]`` (``clipfit.fit_clip_epsilon``: ``C/max(||g||, C)``
and opacus' ``+ 1e-6`` are both DP-SGD's clip), and explained by the same bug shapes ("reports X, clips with Y" when the
two differ). C lies between the middle
reference norms, so some samples are clipped and some not: one factor on every coefficient is the
gradient's overall scale (``clipped_step``'s business), not a norm. A target that reports no norms
is judged on the norms it clips with.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any, Dict, NamedTuple, Tuple

from ...config.defaults import CLIP_EPSILON
from ...lazy import reference, torch
from ...targets.mesh import replica_positions, split_norm_sq, world_summed_norms
from ...targets import RunSpec
from ...targets.base import PRECISIONS
from ...verdict import Verdict
from ..analysis.clipfit import (COEF_TOL, ROUNDING_MARGIN, fit_clip_epsilon, norm_rounding, recover_clip_coefficients,
                      with_picked_clip)
from ..analysis.compare import (fmt, norm_ratios, processed_indices, reference_grads, reference_model,
                                reference_norms, tolerance)
from ..engine.contract import Case, FuzzRecipe, Outputs, Point, Property
from .norm_hypotheses import (HYPOTHESIS_RTOL, batch_summed_norms, borrowed_norms, close as _close,
                                        finetune_norms, omitted_layer_norms, phantom_bias_norms, right_prefix,
                                        sequence_weights)
from .param_shares import clip_share_diagnosis, norm_share_diagnosis, unnamed_reason
from ..analysis.precision_bounds import (precision_bound, precision_coefficient_bounds, precision_kinks,
                                         precision_norm_tolerances, precision_spec, precision_unjudgeable)



def prepare(spec: RunSpec, planning: bool = False) -> RunSpec:
    """C between the middle norms: some samples clipped, some not, so the clip coefficients
    recovered from the released gradient tell an overall gradient scale from norms that are off.
    A mixed-precision spec runs at ``precision_bounds.PRECISION_DIMS`` (where bf16 accumulation shows).
    ``planning``: a dry run's (``clipfit.pick_clip_bound``)."""
    spec = precision_spec(spec)
    return with_picked_clip(spec, planning=planning)


#: the local batch of the one large case (``cases``): every default local batch is <= 8, so a fork that
#: computes per-sample gradients in chunks (to bound vmap's memory) is only right on its first chunk
#: unless a batch spans several chunks; 33 = one past 32 spans every chunk size up to 32
LARGE_LOCAL_BATCH = 33


def cases(point: Point):
    spec = prepare(point.spec(global_batch_size=4 * point.world_size), point.planning)
    if not large_point(point):
        yield point.case(spec, doing="per-sample norms")
        return
    # the large batch rides in the same case (one job, one verdict): judged after the small one passes
    large = prepare(point.spec(global_batch_size=LARGE_LOCAL_BATCH * point.world_size), point.planning)
    yield point.case(spec, specs=(spec, large), doing=f"per-sample norms (local batches of 4 and {LARGE_LOCAL_BATCH})")
    if point.options.models is None:
        # every layer type ghost clipping samples, once per world size, beside the property's own models
        # (a --models selection runs just those): a layer type missing from a target's norm registry
        # shows, named (models.LayerZoo; docs/properties.md)
        zoo = prepare(point.spec(global_batch_size=4 * point.world_size).with_(model="zoo", model_kwargs=()),
                      point.planning)
        yield point.case(zoo, doing="per-sample norms of every layer type (the layer zoo)")


def wide(point: Point):
    """At the wide world size (``horizon.py``): one step of the first model on split data, so that a rank
    clipping with another rank's norms (gathered and read at ``LOCAL_RANK`` or ``rank % 2``) shows
    from the third rank on."""
    if point.sampling == "fixed":
        spec = point.spec(global_batch_size=4 * point.world_size).with_(data_layout="split")
        yield point.case(prepare(spec, point.planning), doing="per-sample norms")


def large_point(point: Point) -> bool:
    """Whether ``point`` also runs the large local batch (``LARGE_LOCAL_BATCH``): once per world size
    and mode, on the cheap point -- the mlp, split data, float64, fp32, fixed batches, the first
    reduction -- where a chunking bug shows as plainly as anywhere (it is in the per-sample gradient
    code, not in the model, the layout or the dtype)."""
    return (not point.mesh and point.sampling == "fixed" and point.precision == "fp32" and point.model == "mlp"
            and point.data_layout == "split" and point.dtype == "float64"
            and point.reduction == (point.options.reductions or PROPERTY.reductions)[0])


def judge(case: Case, runs: Outputs) -> Verdict:
    """The verdict for one case: its spec's (``judge_spec``), then -- once that passes -- the large
    local batch's where the case carries one (``LARGE_LOCAL_BATCH``), whose failure is the verdict."""
    first = judge_spec(case, runs[0][0])
    if len(case.specs) < 2 or first.status != "pass":
        return first
    large = case.specs[1]
    local = large.global_batch_size // case.world_size
    sub = replace(case, spec=large, specs=(large,))
    second = judge_spec(sub, runs[0][1])
    evidence = {**first.evidence, "large_local_batch": local,
                "large_local_batch_evidence": {k: v for k, v in second.evidence.items() if k not in case.facts}}
    if second.status != "pass":
        return replace(second, evidence={**second.evidence, "large_local_batch": local},
                       message=f"at a local batch of {local} per rank (a local batch of 4 passes): {second.message}")
    return replace(first, evidence=evidence,
                   message=f"{first.message}; so at a local batch of {local} per rank too")


def judge_spec(case: Case, outputs) -> Verdict:
    """The verdict on ``case.spec`` from every rank's ``RankOutput`` (step 0): the norms it reports,
    and the norms it clips with (recovered from the released gradient)."""
    spec = case.spec
    rtol, atol = tolerance(spec.dtype)
    bound = precision_bound(spec)
    ref = reference_norms(spec)
    steps = [o.steps[0] for o in outputs]
    want = [ref[list(s.indices)] for s in steps]
    if bound is not None:  # bf16 compute: the bound derived from its unit roundoff, not the dtype's
        rtol, atol = bound.norm_rtol, 0.0
        unjudged = precision_unjudgeable(spec, [i for s in steps for i in s.indices])
        if unjudged:  # too many ReLU units within rounding of 0 for a bf16 verdict (kinks.py)
            return case.verdict("skip", None, unjudged, {})
    evidence: Dict[str, Any] = {"rtol": rtol, "atol": atol}
    if bound is not None:
        evidence["precision_bound"] = bound.describe()
    failed, reported = _reported_norms(case, steps, want, (rtol, atol), bound, evidence)
    if failed is not None:
        return failed
    clips, clips_msg, fit = clipped_with(case, outputs, ref, want, steps)
    evidence.update(fit)
    return _both_verdict(case, reported, (clips, clips_msg), bound, evidence)


def _reported_norms(case: Case, steps, want, tols: tuple, bound, evidence: Dict[str, Any]):
    """The norms the target reports against the reference ``want``: ``(failed verdict or None, reported)``,
    ``reported`` ``None`` where it reports none, else ``(diagnosis or None, message)``; fills ``evidence``."""
    spec, ws = case.spec, case.world_size
    rtol, atol = tols
    if not all(s.norms is not None for s in steps):
        return None, None
    for r, s in enumerate(steps):
        if s.norms.numel() != len(s.indices):
            return case.verdict("fail", "mismatch", f"rank {r} reported {s.norms.numel()} norms for "
                                f"{len(s.indices)} samples", {"rank": r})
    got = [s.norms.to(torch.float64).reshape(-1) for s in steps]
    # what rounding in the target's dtype alone does to a norm of this model (a LayerNorm over two
    # features: ~1e-3 relative in float32, against ~1e-7 on the default models)
    # under bf16 compute: the derived bound, plus what flipping a ReLU unit within rounding of 0 can do
    # to the norm of a sample that has one (kinks.py)
    floors = ([ROUNDING_MARGIN * norm_rounding(spec, s.indices) for s in steps] if bound is None
              else [precision_norm_tolerances(spec, bound, s.indices, w) for s, w in zip(steps, want)])
    ratios = torch.cat([norm_ratios(g, w) for g, w in zip(got, want)])
    evidence.update({"max_abs_error": max(float((g - w).abs().max()) for g, w in zip(got, want)),
                     "ratio_min": float(ratios.min()), "ratio_max": float(ratios.max()),
                     "mean_ratio": float(ratios.mean())})
    processed = [i for s in steps for i in s.indices]
    found = None if bound is None else precision_kinks(spec, bound)
    kinked = "" if found is None else found.describe(processed)
    if found is not None and kinked:
        evidence["ambiguous_relu_units"] = found.count(processed)
    elif max(float((f - rtol * w.abs()).max()) for f, w in zip(floors, want)) > atol:
        evidence["norm_rounding_floor"] = max(float(f.max()) for f in floors)
    if all(bool(((g - w).abs() <= atol + torch.maximum(rtol * w.abs(), f)).all())
           for g, w, f in zip(got, want, floors)):
        reported = (None, f"per-sample norms equal the float64 reference on all {ws} rank(s) (max abs error "
                          f"{fmt(evidence['max_abs_error'])}"
                          + (f"; within the {spec.precision} bound {fmt(rtol)} relative: ratio "
                             f"{evidence['ratio_min']:.4g}..{evidence['ratio_max']:.4g}"
                             + (f"; {kinked}, and the norms are judged with what those flips can do" if kinked
                                else "") + ")" if bound else ")")
                          + (f" -- within what rounding in {spec.dtype} alone does to this model's norms "
                             f"({fmt(evidence['norm_rounding_floor'])})" if "norm_rounding_floor" in evidence
                             else ""))
    else:
        reported = diagnose(case, got, want, steps, ratios)
        if bound is not None:
            reported = (reported[0], f"{reported[1]} That is beyond the error bf16 compute explains: "
                        f"{bound.describe()}" + (f"; {kinked}, and the norms are judged with what those flips "
                                                 "can do" if kinked else "") + ".")
    return None, reported


def _both_verdict(case: Case, reported, clipping, bound, evidence: Dict[str, Any]) -> Verdict:
    """The verdict from what the target reports (``reported``: ``_reported_norms``') and the norms it
    clips with (``clipping``: ``clipped_with``'s diagnosis and message)."""
    spec, (clips, clips_msg) = case.spec, clipping
    if reported is None:
        status = "pass" if clips is None else "fail"
        return case.verdict(status, clips, "the target reports no per-sample norms (StepOutput.norms is None); "
                            f"judged on the norms it clips with instead: {clips_msg}", evidence)
    said, said_msg = reported
    if said is None and clips is None:
        return case.verdict("pass", None, f"{said_msg}, and it clips with them: {clips_msg}", evidence)
    if clips is None and bound is not None:
        return case.verdict("fail", said, f"{said_msg} The clip coefficients recovered from its released gradient "
                            f"are within their own {spec.precision} bound ({clips_msg}), which is too wide to tell "
                            "which norms it clips with.", evidence)
    if clips is None:
        return case.verdict("fail", said, f"{said_msg} It clips with the true norms, though ({clips_msg}): only "
                            "what it reports is wrong.", evidence)
    if said is None:
        return case.verdict("fail", clips, f"reports the true per-sample norms but clips with other ones: {clips_msg}",
                            evidence)
    if said == clips:
        return case.verdict("fail", said, f"{said_msg} It clips with the same wrong norms.", evidence)
    return case.verdict("fail", clips, f"reports wrong norms and clips with other wrong ones. Reports: {said_msg} "
                        f"Clips with: {clips_msg}", evidence)


class Factor(NamedTuple):
    """One overall factor fitted between recovered clip coefficients and a shape (``fit_factor``)."""
    k: float  #: the factor (least squares): ``coef ~ k * shape``
    error: float  #: the largest ``|coef - k * shape|``

    @property
    def relative(self) -> float:
        """``error`` relative to the factor where it exceeds 1 (a shape matched up to a scale)."""
        return self.error / max(1.0, abs(self.k))

    def relative_pair(self) -> Tuple[float, float]:
        """``(k, relative)``."""
        return self.k, self.relative


def fit_factor(coef: torch.Tensor, shape: torch.Tensor) -> Factor:
    """The one factor that brings ``shape`` nearest to ``coef`` (least squares; 1 for a zero shape) and
    what it leaves: every reading of the recovered coefficients as a known shape up to the gradient's
    overall scale (the scale is ``clipped_step``'s business) goes through here."""
    den = float(shape @ shape)
    k = float(coef @ shape) / den if den else 1.0
    return Factor(k, float((coef - k * shape).abs().max()) if coef.numel() else 0.0)


def _scaled_to(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """``expected`` times the factor that brings it nearest to ``got`` (least squares)."""
    return expected * fit_factor(got, expected).k


def clipped_with(case: Case, outputs, ref: torch.Tensor, want, steps):
    """``(diagnosis or None, message, evidence)`` for the norms the target *clips with*: each
    sample's ``c_i`` recovered from the released gradient (``clipfit.recover_clip_coefficients``),
    compared with ``min(1, C/(||g_i|| + eps))``."""
    spec, ws = case.spec, case.world_size
    c = spec.max_grad_norm
    got = recover_clip_coefficients(spec, processed_indices(outputs, 0, spec), outputs[0].steps[0].gradient)
    indices, coef, residual, seen = got.indices, got.coefficients, got.residual, got.identifiable
    tol = res_tol = COEF_TOL.get(spec.dtype, COEF_TOL["float64"])
    bound = precision_bound(spec)
    if bound is not None:  # bf16 compute: coefficient and residual bounds derived from its unit roundoff
        tol, res_tol = precision_coefficient_bounds(spec, bound, indices)
    fit = {"clip_fit_residual": residual, "identifiable_samples": int(seen.sum()), "max_grad_norm": c,
           "ill_conditioned_samples": got.ill_conditioned}
    # samples so nearly collinear that the target's rounding alone moves their coefficients past the
    # tolerance: not judged, and said
    unjudged = (f"; {got.ill_conditioned} of {len(indices)} sample(s) not judged: their gradients are so nearly "
                f"collinear that rounding in {spec.dtype} alone moves their coefficients by more than "
                f"{fmt(tol / ROUNDING_MARGIN)}" if got.ill_conditioned else "")
    floored = got.residual_floor > res_tol  # the target's own rounding leaves more residual than the tolerance
    res_tol = got.residual_bound(res_tol)
    if bound is not None or floored:
        fit.update({"coefficient_bound": tol, "residual_bound": res_tol})
    where = f"at world_size={ws} ({spec.data_layout} data)"
    if not residual <= res_tol:
        return "mismatch", (f"the released gradient is not a combination of the processed samples' gradients "
                            f"{where} (relative least-squares residual {fmt(residual)} > {fmt(res_tol)}): it holds "
                            "other samples, "
                            "or is not sum_i c_i g_i at all."), fit
    if not bool(seen.any()):
        return None, (f"no sample's clip coefficient can be recovered {where} (their gradients are zero or "
                      f"collinear{unjudged}): nothing to compare"), fit
    indices = [i for i, ok in zip(indices, seen.tolist()) if ok]
    coef = coef[seen]
    # DP-SGD's min(1, C/||g_i||) with the target's own epsilon in the denominator, if it is one the
    # gate accepts (MAX_CLIP_EPSILON); else the nearest accepted one, and the comparison fails
    # fitted up to the gradient's overall scale (clipped_step's business, below), so that a scale is
    # never read as an epsilon
    def coefficients(e):
        return reference.clip_coefficients(ref[indices], c, e)

    # opacus' epsilon first, then the nearest accepted one as it stands and up to a scale: the one
    # whose coefficients are nearest (a fit over few, ill-conditioned coefficients can stray)
    candidates = (CLIP_EPSILON, fit_clip_epsilon(coefficients, coef),
                  fit_clip_epsilon(lambda e: _scaled_to(coef, coefficients(e)), coef))
    eps = min(candidates, key=lambda e: float((coef - coefficients(e)).abs().max()))
    expected = coefficients(eps)
    err = float((coef - expected).abs().max())
    clipped = int((expected < 1).sum())
    fit.update({"clip_coefficient_max_error": err, "clipped_samples": clipped, "clip_epsilon": eps})
    if err <= tol:
        return None, (f"the clip coefficients recovered from the released gradient equal min(1, C/||g_i||) "
                      f"(max error {fmt(err)}{f' <= bound {fmt(tol)}' if bound is not None else ''}; {clipped} of "
                      f"{len(indices)} samples clipped at C={c:.4g}; "
                      f"epsilon in the denominator {eps:.3g}{unjudged})"), fit
    return _off_clip(case, want, steps, (indices, coef, expected), (candidates, coefficients), ref[indices], tol,
                     where, fit)


def _off_clip(case: Case, want, steps, samples, fitted, ref_norms: torch.Tensor, tol: float, where: str, fit: Dict):
    """``clipped_with``'s answer where the recovered coefficients are not ``min(1, C/||g_i||)``: one overall
    factor (clipped_step's), a known bug shape, another sample's clip, or the direction they are off in.
    ``samples``: the judged ``(indices, recovered coefficients, expected ones)``; ``fitted``: the candidate
    epsilons and the coefficients at an epsilon."""
    (indices, coef, expected), (candidates, coefficients), c = samples, fitted, case.spec.max_grad_norm
    # the overall scale at the epsilon that fits best up to a scale
    eps_scaled = min(candidates, key=lambda e: fit_factor(coef, coefficients(e)).error)
    scale, error = fit_factor(coef, coefficients(eps_scaled))
    if error <= tol:
        fit["gradient_scale"] = scale
        return None, (f"the clip coefficients recovered from the released gradient are min(1, C/||g_i||) times "
                      f"one factor {scale:.6g} for every sample: clipped with the true norms; the factor is the "
                      f"gradient's overall scale (clipped_step judges it)"), fit
    matched = _matched_hypothesis(case, want, steps, indices, coef, tol)
    uncapped = _uncapped(coef, expected, ref_norms, c, tol)
    # both fit: a known bug shape is named, unless the uncapped clip fits it far better (under a loose
    # bf16 bound a norm hypothesis can fit within it by chance); where they are one shape up to a
    # factor (a norm bug that clips every sample) the hypothesis, which also explains the norms
    if uncapped is not None and (matched is None or uncapped[3] < DECISIVELY_BETTER * matched[3]):
        fit["gradient_scale"] = uncapped[2]
        return uncapped[0], uncapped[1], fit
    if matched is not None:
        diagnosis, message, k, _ = matched
        if abs(k - 1) > tol:
            fit["gradient_scale"] = k
            message += f" (The released gradient also carries one overall factor {k:.6g}: see clipped_step.)"
        return diagnosis, message, fit
    shared = clip_share_diagnosis(case.spec, indices, coef, expected, tol, where)  # one parameter's share off
    if shared:
        return shared + (fit,)
    borrowed = _borrowed_clip(case, want, steps, indices, coef, tol)
    if borrowed:
        return "sample_mixing", _borrowed_message("it clips with", borrowed, where), fit
    changed, low, high, direction = _direction(coef, expected, ref_norms, c, tol)
    return _direction_message(changed, low, high, direction, where) + (fit,)


#: one reading of the recovered coefficients is named over an earlier one that also fits only when
#: its residual (relative to the factor) is below this fraction of the earlier one's: the uncapped
#: clip over a fitting hypothesis (``_off_clip``), a later hypothesis over an earlier
#: (``_matched_hypothesis``). Under a loose bound (bf16) a wrong shape can fit within it by chance;
#: a near tie keeps the earlier, more specific reading
DECISIVELY_BETTER = 0.1


def _uncapped(coef: torch.Tensor, expected: torch.Tensor, true_norms: torch.Tensor, c: float, tol: float):
    """``(diagnosis, message, factor, residual)`` when the recovered coefficients ``coef`` are ``C/||g_i||`` for
    every sample, those below C too (times one factor, as ``_matched_hypothesis``): a clip without its
    ``min(1, .)``, which scales every sample to norm C. ``None`` otherwise, or when no judged sample is
    below C (``expected``: the true coefficients; all clipped, the two shapes are one). Read up to a
    factor, as this property reads every coefficient, the shape is also that of a C below every norm
    (every sample clipped) with the gradient rescaled: both are said, and the factor."""
    below = expected >= 1
    if not bool(below.any()):
        return None
    k, residual = fit_factor(coef, c / (true_norms + CLIP_EPSILON)).relative_pair()
    if residual > tol:
        return None
    return "mismatch", (f"the clip coefficients recovered from the released gradient are C/||g_i|| for every sample, "
                        f"uncapped, times one factor {k:.6g}: the {int(below.sum())} judged sample(s) below C={c:.4g} "
                        "are scaled up to norm C instead of left as they are -- a clip without its min(1, .) (each "
                        "sample's contribution is still at most C, but small gradients are inflated: a biased update), "
                        "or, up to that factor, a C below every norm."), k, residual


def _matched_hypothesis(case: Case, want, steps, indices, coef: torch.Tensor, tol: float):
    """``(diagnosis, message, factor, residual)`` of the known bug shape (``hypotheses``) whose clip
    coefficients are the recovered ones ``coef`` (of samples ``indices``) times one factor; ``None``.
    The gradient's overall scale is not this property's business (and is not 1 where a target
    normalises replicated data its own way): each bug shape is matched up to one free factor. Of
    several that fit, the first in ``hypotheses``' order, unless a later one fits decisively better
    (``DECISIVELY_BETTER``)."""
    c = case.spec.max_grad_norm
    pos = {i: j for j, i in enumerate(indices)}
    best = None
    for diagnosis, norms, message, weights in hypotheses(case, want, steps, subject="the norms it clips with"):
        flat = torch.zeros(len(indices), dtype=torch.float64)
        scale = torch.ones(len(indices), dtype=torch.float64)
        for r, (s, n) in enumerate(zip(steps, norms)):
            for j, (i, value) in enumerate(zip(s.indices, n.tolist())):
                if i in pos:
                    flat[pos[i]] = value
                    if weights is not None:
                        scale[pos[i]] = float(weights[r][j])
        # a target whose per-sample loss is w_i l_i clips w_i g_i: read against g_i, its coefficient is
        # w_i min(1, C/(w_i ||g_i||))
        k, residual = fit_factor(coef, reference.clip_coefficients(flat, c) * scale).relative_pair()
        if residual <= tol and (best is None or residual < DECISIVELY_BETTER * best[3]):
            best = (diagnosis, message, k, residual)
    return best


#: ranks up to which every assignment of another rank's norms is tried (``_borrowed_clip``: ws^ws fits)
BORROWED_MAX_RANKS = 4


def _borrowed_clip(case: Case, want, steps, indices, coef: torch.Tensor, tol: float) -> dict:
    """``{rank: other rank}`` when the recovered coefficients ``coef`` are those of some ranks clipping
    with another rank's true norms (up to one overall factor, as ``_matched_hypothesis``); ``{}``."""
    ws, c = case.world_size, case.spec.max_grad_norm
    if not 1 < ws <= BORROWED_MAX_RANKS:
        return {}
    pos = {i: j for j, i in enumerate(indices)}
    for mapping in itertools.product(range(ws), repeat=ws):
        if all(j == r for r, j in enumerate(mapping)) or any(len(want[j]) != len(want[r])
                                                               for r, j in enumerate(mapping)):
            continue
        shape = torch.ones(len(indices), dtype=torch.float64)
        for s, j in zip(steps, mapping):
            for i, value in zip(s.indices, want[j].tolist()):
                if i in pos:
                    shape[pos[i]] = float(reference.clip_coefficients(torch.tensor([value]), c)[0])
        # a cause is named at the hypotheses' looser tolerance (the clip form's epsilon is not the point)
        if fit_factor(coef, shape).relative <= max(tol, HYPOTHESIS_RTOL):
            return {r: j for r, j in enumerate(mapping) if j != r}
    return {}


def _direction(coef: torch.Tensor, expected: torch.Tensor, true_norms: torch.Tensor, c: float, tol: float):
    """``(samples clipped differently, min and max effective/true norm of the clipped ones or None,
    "less" | "more" | "both")``: how the recovered coefficients ``coef`` differ from ``expected``,
    read against the scale of the least-clipped sample: the one with the smallest true norm is
    below C (C is between the middle norms), so unclipped unless inflated."""
    coef = coef / (float(coef.max()) / float(expected.max()))
    changed = (coef - expected).abs() > tol
    effective = c / coef.clamp_min(1e-300) - CLIP_EPSILON
    shown = changed & (coef < 1 - tol)
    low = float((effective / true_norms)[shown].min()) if bool(shown.any()) else None
    high = float((effective / true_norms)[shown].max()) if bool(shown.any()) else None
    if bool((coef[changed] > expected[changed]).all()):
        return int(changed.sum()), low, high, "less"
    if bool((coef[changed] < expected[changed]).all()):
        return int(changed.sum()), low, high, "more"
    return int(changed.sum()), low, high, "both"


def _direction_message(changed: int, low, high, direction: str, where: str):
    """``(diagnosis, message)`` for ``_direction``'s finding."""
    ratio = f" (effective/true norm {low:.4g}..{high:.4g})" if low is not None else ""
    ratio += (". No parameter is named: the clip coefficients carry the norms of the clipped samples only, and no "
              "parameter, module or pair of parameters at a fixed factor explains them")
    if direction == "less":
        return "undercount", (f"the norms it clips with undercount the true norms {where}: {changed} "
                              f"sample(s) clipped less than min(1, C/||g_i||){ratio}. A sample can then contribute "
                              "more than C: a privacy violation.")
    if direction == "more":
        return "mismatch", (f"the norms it clips with are inflated {where}: {changed} sample(s) clipped "
                            f"more than min(1, C/||g_i||){ratio}: over-clipped (utility loss).")
    return "mismatch", (f"the norms it clips with differ from the true norms {where}: {changed} "
                        f"sample(s) clipped differently from min(1, C/||g_i||), some more, some less{ratio}.")


def hypotheses(case: Case, want, steps, subject: str):
    """``(diagnosis, per-rank norms, message, per-rank loss weights or None)`` for each known bug
    shape that applies here. The weights are for bugs in the per-sample *loss* (a sequence's loss
    normalised wrongly): the target's per-sample gradient is ``w_i g_i``, so it also clips that."""
    ws, layout = case.world_size, case.spec.data_layout
    where = f"at world_size={ws} ({layout} data)"
    if case.spec.mesh and case.spec.layout.tensor_parallel:
        yield from tensor_parallel_hypotheses(case, steps, subject)
        return
    if case.spec.mesh:
        where = f"on mesh {case.spec.mesh} ({layout} data)"
    sq = math.sqrt(ws)
    if ws > 1:
        yield "sqrt_n_inflation", [w * sq for w in want], (
            f"{subject} are inflated by sqrt({ws}) = {sq:.4g} {where}: norms (their squares) all-reduced "
            "across ranks although each rank's norm is already complete (FSDP un-shards parameters for "
            "backward). Clipping then uses norms sqrt(N) too large: every sample is over-clipped."), None
    if ws > 1 and layout == "split" and len({len(w) for w in want}) == 1 and len(want[0]):
        mixed = torch.sqrt(sum(w.pow(2) for w in want))  # position-wise root-sum-square over ranks
        yield "sample_mixing", [mixed] * ws, (
            f"{subject} mix different samples {where}: sample {steps[0].indices[0]}'s norm is taken as "
            f"{float(mixed[0]):.4g}, the root-sum-square of the true norms of samples "
            f"{[s.indices[0] for s in steps]} (position 0 on each rank), not its own {float(want[0][0]):.4g}. "
            "Norm^2 is all-reduced across ranks that hold different samples; each sample is clipped by other "
            "samples' norms."), None
    # fine-tuned models: frozen parameters in the norm, a tied parameter's uses not summed
    for diagnosis, norms, what in finetune_norms(case.spec):
        shown = [norms[list(s.indices)] for s in steps]
        consequence = ("some samples' norms come out below their true norm: such a sample can contribute more "
                       "than C, a privacy violation" if diagnosis == "undercount" else
                       "the norms are too large: samples are over-clipped (utility loss)")
        yield diagnosis, shown, f"{subject} {where} {what}; {consequence}.", None
    # a layer type (or its biases) missing from the target's norm registry: trained, never in the norm
    for diagnosis, norms, what in omitted_layer_norms(case.spec):
        shown = [norms[list(s.indices)] for s in steps]
        yield diagnosis, shown, (f"{subject} undercount the true norms {where}: they {what}. A sample's "
                                 "norm then misses those parameters' share, so it can contribute more than C: a "
                                 "privacy violation."), None
    for diagnosis, norms, what in phantom_bias_norms(case.spec):  # a bias term for a bias-free layer
        yield diagnosis, [norms[list(s.indices)] for s in steps], (f"{subject} are inflated {where}: they {what}. "
                                                                   "Every sample is over-clipped (utility loss)."), None
    for diagnosis, shown, what in batch_summed_norms(case.spec, steps):  # a model of its own: by parameter name
        yield diagnosis, shown, f"{subject} {where} {what}.", None
    # padded sequences: the per-sequence loss normalised over the wrong token count
    for diagnosis, weights, what in sequence_weights(case.spec):
        w = [weights[list(s.indices)] for s in steps]
        yield diagnosis, [a * b for a, b in zip(want, w)], f"{subject} {where} {what}.", w


def tensor_parallel_hypotheses(case: Case, steps, subject: str):
    """The aggregation bugs of a data x tensor-parallel mesh (``mesh.world_summed_norms``), from the
    reference's squared norms of each sample's TP-sharded parameters (every ``nn.Linear``:
    ``targets.util.tensor_parallel_plan``) and of the parameters every TP peer holds whole."""
    spec = case.spec
    layout = spec.layout
    linear = {name for name, m in reference_model(spec).named_modules() if isinstance(m, torch.nn.Linear)}
    grads = reference_grads(spec)
    sharded, whole = split_norm_sq(grads, [n for n in grads if n.rsplit(".", 1)[0] in linear])
    rows = [list(s.indices) for s in steps]
    if len({len(r) for r in rows}) != 1:
        return
    pairs = replica_positions(layout, rows)
    where = f"on mesh {spec.mesh} (data x tensor parallel)"
    t = layout.shape[1]
    told = ", ".join(str(tuple(p)) for p in pairs[:4]) + (" ..." if len(pairs) > 4 else "")
    mix = (f"{subject} mix the samples of different data replicas {where}: the squared norms of the TP-sharded "
           f"parameters are all-reduced over the whole world, so the samples at one position on the {layout.shape[0]} "
           f"data replicas -- {told} -- are clipped with one norm between them. Tensor-parallel peers must sum "
           "their shards' squares; data replicas hold other samples and must not.")
    yield "sample_mixing", world_summed_norms(layout, sharded, whole, rows), mix, None
    yield "sample_mixing", world_summed_norms(layout, sharded, whole, rows, "rank0", t), (
        mix + f" Besides, each of the {t} TP peers adds the squares of the whole TP-sharded layers (not of its "
        f"shard: its hooks see the all-gathered activations and gradients), counted {t} times; and the parameters "
        "every TP peer holds whole (not DTensors: norms, embeddings) are counted from global rank 0's sample "
        "alone: every other replica's samples lose them (opacus' merge_flag=False)."), None
    yield "replicated_counted", [(sharded[r] + t * whole[r]).sqrt() for r in rows], (
        f"{subject} count the parameters every TP peer holds whole {t} times {where}: each of the {t} tensor-parallel "
        "peers adds the squares of its whole (replicated) parameters before the sum over the TP group; a "
        "replicated parameter is one parameter and must be counted once. Every sample is over-clipped."), None


def diagnose(case: Case, got, want, steps, ratios):
    """``(diagnosis, message)`` for reported norms that do not match."""
    ws, layout = case.world_size, case.spec.data_layout
    where = f"at world_size={ws} ({layout} data)"
    for diagnosis, norms, message, _ in hypotheses(case, want, steps, subject="per-sample norms"):
        if all(_close(g, n) for g, n in zip(got, norms)):
            return diagnosis, message
    borrowed = borrowed_norms(got, want)
    if borrowed:
        return "sample_mixing", _borrowed_message("it reports", borrowed, where)
    shared = norm_share_diagnosis(case.spec, got, steps, max(HYPOTHESIS_RTOL, tolerance(case.spec.dtype)[0]),
                                  "per-sample norms", where)  # one parameter's (or module's) share off, named
    if shared:
        return shared
    unnamed = unnamed_reason(sum(len(s.indices) for s in steps))
    if bool((ratios < 1).all()):
        note = ""
        if layout == "replicated" and ws > 1 and len({len(g) for g in got}) == 1:
            if _close(torch.sqrt(sum(g.pow(2) for g in got)), want[0]):
                note = (" The ranks' squared norms add up to the true ones: each rank's norm covers only its "
                        "local parameter shard.")
        return "undercount", (
            f"per-sample norms undercount the true norms {where}: ratio reported/true between "
            f"{float(ratios.min()):.4g} and {float(ratios.max()):.4g}.{note} Clipping with too small a norm "
            "lets a sample contribute more than C: a privacy violation." + unnamed)
    if bool((ratios > 1).all()):
        k = float(ratios.mean())
        kind = f"inflated (ratio {float(ratios.min()):.4g}..{float(ratios.max()):.4g})"
        if _close(ratios, torch.full_like(ratios, k)):
            kind = f"inflated by a constant factor {k:.4g}"
        return "mismatch", (f"per-sample norms {kind} {where}: every sample is over-clipped (utility loss)."
                            + ("" if kind.startswith("inflated by a constant") else unnamed))
    worst = max(range(len(got)), key=lambda r: float(((got[r] - want[r]).abs() / want[r].clamp_min(1e-300)).max()))
    k = right_prefix(got, want)
    prefix = (f" The first {k} sample(s) of every rank's local batch are right and the rest are not: per-sample "
              f"gradients computed in chunks of {k}, a later chunk paired with the wrong samples' activations or "
              "backprops?" if k else "")
    return "mismatch", (f"per-sample norms differ from the reference {where}: ratio reported/true between "
                        f"{float(ratios.min()):.4g} and {float(ratios.max()):.4g} (worst on rank {worst}), "
                        f"some above and some below the truth.{prefix}" + ("" if k else unnamed))


def _borrowed_message(what: str, borrowed: dict, where: str) -> str:
    """``what`` ("it reports" / "it clips with") another rank's norms on the ranks of ``borrowed``."""
    pairs = "; ".join(f"rank {r} uses rank {j}'s" for r, j in borrowed.items())
    return (f"{what} another rank's per-sample norms {where}: {pairs} (the true norms of the samples that "
            "rank processed), the other ranks their own. Norms gathered across ranks and read back at the wrong "
            "index -- LOCAL_RANK or rank % 2 where the global rank is meant -- are right on the first node or at 2 "
            "ranks only. A sample clipped with another sample's norm can contribute more than C: a privacy "
            "violation.")


PROPERTY = Property(
    id="norm_fidelity", diagnoses=("mismatch", "sqrt_n_inflation", "sample_mixing", "undercount",
                                   "replicated_counted"), meshes=True,
    meaning=("the per-sample norms the target clips with are the true per-sample gradient norms; if not, "
             "clipping does not bound each sample's influence by C (privacy) or over-clips (utility)"),
    cases=cases, judge=judge, models=("mlp", "transformer"), layouts=("replicated", "split"),
    reductions=("mean", "sum"), dtypes=("float64", "float32"),
    precisions=PRECISIONS, wide=wide, nodes=wide,
    # any shape, layout, reduction and global batch, one step
    fuzz=FuzzRecipe(prepare=prepare))


__all__ = ["HYPOTHESIS_RTOL", "prepare", "LARGE_LOCAL_BATCH", "cases", "wide", "large_point", "judge", "judge_spec",
           "clipped_with", "BORROWED_MAX_RANKS", "hypotheses", "tensor_parallel_hypotheses", "diagnose",
           "borrowed_norms", "right_prefix", "PROPERTY"]

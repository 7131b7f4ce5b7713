"""clipped_step: with noise 0, one DP step's gradient and parameters equal the reference DP-SGD step.

DP meaning: the released gradient must be exactly ``(sum_i min(1, C/||g_i||) g_i) / D`` before
noise (an epsilon ``e`` in the coefficient's denominator, ``C/(||g_i|| + e)``, is accepted for any
``0 <= e <= MAX_CLIP_EPSILON``: opacus' 1e-6 and ``C/max(||g_i||, C)`` alike); any other scale changes the
signal-to-noise ratio the privacy accounting assumed (a smaller
signal is relatively more noise: utility lost; a sample scaled up beyond its clip is a bigger
influence than analysed).

The clip bound C is set between the middle two reference norms of the global batch, so some
samples are clipped and some are not: a missing ``min(1, .)`` or a wrong norm both show. The tiny
models' norms lie within ~10x of each other, so one extra run per world size (fixed sampling, the
first model, reduction and dtype) clips at C = min norm/100: every sample at >= 100 C, where a
floored coefficient (``max(coef, f)``, any f >= 0.01) or a wrong bound shows; that run's local batch
is ``WIDE_LOCAL_BATCH`` = 64 (the largest exploration draws), so a clip that goes wrong only far
down a batch (rows >= 40 left unclipped) fails every gate run, not only a lucky draw. Split data by default
(opacus defines the FSDP step for a ``DistributedSampler`` over the global data). Under Poisson
sampling (the sampling axis, ``Point.spec``) the step is one step of DP-SGD's own Poisson sampling:
the reference recomputes it on the realised batch (the union of what the ranks drew) with the
normalisation opacus defines for ``"mean"``, the expected batch size ``int(q * N)``, not the
realised one (and not q * N: the default dataset makes q * N fractional, ``poisson_dataset_size``).
One step's realised batch is a few samples, often all clipped or all unclipped (at run seed 1 the
1-rank case draws one clipped sample), so each Poisson case also runs ``SHORT_POISSON_STEPS`` = 8
steps of the same sampling at lr 0 and the same C in its job (``short_poisson_spec``), each step
judged on its realised batch as the long run is. With the option
``physical_batch_size`` p (CLI ``--physical-batch-size``) the step
is computed by gradient accumulation in physical passes of at most p samples (fixed local batches
of p + 1: two passes, the last one shorter than p for p >= 2 -- local 3 at p = 2 is [2, 1], local 4
at p = 3 is [2, 2] -- whether the target splits evenly or in chunks of p) and must still equal the
unsplit reference step (noise 0). An empty logical batch is ``trajectory``'s to check (one step
cannot be made to draw one). A failure tests simple explanations against the numbers and says which one fits: a
constant factor (1/world_size; int(q*N)/realised batch: a realised-batch normaliser; a physical-batch normaliser), a
clip
coefficient error fitted to the coefficients recovered from the released gradient (a bound k*C,
a floor, a cap such as a missing ``min(1, .)``, the norm's epsilon, a scale:
``clipfit.fit_clip_coefficients``), or wrong norms. The diagnosis is ``mismatch``. Once per world
size > 1 the transformer also runs with a 1-row ``mlp_in`` (``d_ff = 1``, the short-layer case,
``SHORT_LAYER_DIMS``): a parameter with fewer rows than ranks, which every default model avoids;
a target that releases its gradient in another placement than the parameter's crashes there,
``error`` / ``placement_mismatch`` (upstream opacus 1.6.0 does: docs/findings.md, finding 3).

The long run (``horizon.py``, once per run at the largest world size): ``Options.horizon`` steps of
Poisson sampling at noise 0 and lr 0, each step's released gradient against the reference step on
its realised batch (each sample's gradient computed once: the parameters never move); a failure
names the first wrong step ("from step k (epoch e) on"), how many followed, and step k's fit.
"""

from __future__ import annotations

import math
import dataclasses
from typing import Any, Dict, List, Optional

from ...config.defaults import CLIP_EPSILON, MAX_CLIP_EPSILON
from ...lazy import torch

from ...lazy import reference
from ...config.space import integer
from ...targets import RunSpec
from ...targets.base import PRECISIONS, capped_epochs
from ...verdict import Verdict
from ..analysis.clipfit import (COEF_TOL, ROUNDING_MARGIN, clip_at_quantile, describe_clip_fit, fit_clip_coefficients,
                                fit_clip_epsilon, pick_clip_bound, recover_clip_coefficients, rounding_floor)
from ..analysis.compare import (flat, fmt, max_rel_diff, norm_picked, processed_indices, reference_batch,
                                reference_grads, reference_model, sample_columns, smallest_norm, tensors_close,
                                tolerance, unflat)
from ..engine.contract import (DEFAULT_PRECISION_FACT, Case, ExploreRecipe, FuzzRecipe, Outputs, Point, Prepared,
                               Property)
from ..engine.horizon import horizon_labels, horizon_point, horizon_spec
from .norm_hypotheses import sequence_weights
from ..analysis.kinks import nearest_with_flips
from ..analysis.precision_bounds import (precision_bound, precision_coefficient_bounds, precision_flip_columns,
                                         precision_gradient_bound, precision_kinks, precision_norm_tolerances,
                                         precision_spec, precision_unjudgeable)

FIT_RTOL = 1e-6


def prepare(spec: RunSpec, planning: bool = False) -> Prepared:
    """``spec`` clipped between its two middle reference norms, or why that is impossible
    (``planning``: a dry run's, ``clipfit.pick_clip_bound``)."""
    c = pick_clip_bound(spec, planning)
    if c is None:
        return "reference norms tie: no clip bound separates clipped from unclipped samples"
    return spec.with_(max_grad_norm=c)


def explore_prepare(spec: RunSpec, knobs: Dict[str, Any]) -> Prepared:
    """An explored configuration (docs/explore.md) with C at its drawn quantile of the reference
    norms (``clipfit.clip_at_quantile``), noise 0."""
    return spec.with_(max_grad_norm=clip_at_quantile(spec, float(knobs.get("clip_quantile", 0.5))),
                      noise_multiplier=0.0)


def explore_labels(spec: RunSpec) -> Dict[str, object]:
    """A drawn run of more than one step is a long run (lr 0), judged step by step (``judge_horizon``)."""
    return horizon_labels(spec) if spec.steps > 1 else {}


#: the property's default axes (``Point.first_of_axes`` picks the point that runs the wide case)
MODELS, REDUCTIONS, DTYPES = ("mlp", "transformer"), ("mean", "sum"), ("float64", "float32")
#: the wide case clips at this fraction of the smallest reference norm: every sample's norm is at
#: least 100 C, so a clip coefficient floored at f >= 0.01 (or any other error that only shows far
#: above C) changes every sample's weight
WIDE_CLIP = 0.01
#: the wide case's local batch (no accumulation, fp32): the largest exploration draws
#: (``space`` axis ``local_batch``), so every row index a drawn batch can reach is in every gate run
WIDE_LOCAL_BATCH = integer("local_batch").drawn[1]
#: the lr-0 steps each Poisson case runs beside its one step (``short_poisson_spec``)
SHORT_POISSON_STEPS = 8
#: the short-layer case: the transformer with a 1-row ``mlp_in`` (``d_ff = 1``), run once per world
#: size > 1. Every default model's dim 0 is at least 8 (``models``), so this case alone holds a
#: parameter with fewer rows than ranks: FSDP2 leaves all but one rank an empty shard of it, where
#: opacus 1.6.0 releases a gradient whose placement differs from its parameter's
#: (``placement_mismatch``, docs/findings.md, finding 3)
SHORT_LAYER_MODEL, SHORT_LAYER_DIMS = "transformer", (("d_ff", 1),)
#: a mixed-precision point's third bound: this many times the largest reference norm, so no sample
#: is clipped and the coefficient is min(1, .)'s cap alone (a missing cap scales every sample by >= 2)
BF16_LOOSE_CLIP = 2.0
#: the tags of a case's specs' evidence: the mid-norm C, C = min norm/100, the loose C (bf16)
TAGS = ("", "wide_", "loose_")


def poisson_dataset_size(world_size: int) -> int:
    """The dataset of a Poisson point when the options name none: ``12 * world_size - 2`` samples,
    so that q * N at the default q = 1/4 is not an integer (2.5 at one rank, 5.5 at two) and the
    ``"mean"`` divisor's truncation ``int(q * N)`` is seen (at the gate's other Poisson points
    q * N is an integer, where a divisor of q * N is right by accident); opacus can configure
    q = 1/4 on it at 1 and 2 ranks."""
    return 12 * world_size - 2


def cases(point: Point):
    p = 0 if point.mesh else point.param("physical_batch_size")  # a 2-D mesh runs without accumulation
    # under accumulation, local batches of p + 1: two passes, the last shorter than p (p >= 2)
    spec = precision_spec(point.spec(global_batch_size=(p + 1 if p else 4) * point.world_size))
    if spec.poisson and point.options.dataset_size is None and point.options.sample_rate is None:
        spec = spec.with_(dataset_size=poisson_dataset_size(point.world_size))
    if p:
        spec = spec.with_(physical_batch_size=p)
    ready = prepare(spec, point.planning)
    if isinstance(ready, str):
        yield point.case(spec, doing="one DP step with noise 0").verdict("skip", None, ready)
        return
    specs = [ready]
    # the mid-norm bound leaves every norm within a few C; one extra run at a bound 100x below the
    # smallest norm (fixed sampling, the first model/reduction/dtype: the coefficient's shape does
    # not depend on them) shows what the coefficient does far above C
    if point.sampling == "fixed" and point.first_of_axes(MODELS, REDUCTIONS, DTYPES):
        # at the largest local batch exploration draws (WIDE_LOCAL_BATCH): a row of the clip that only
        # goes wrong far down a batch (a kernel's second tile) is in the floor, not left to a draw
        wide = ready if p or spec.precision != "fp32" else ready.with_(
            global_batch_size=WIDE_LOCAL_BATCH * point.world_size)
        specs.append(wide.with_(max_grad_norm=norm_picked(wide, _wide_clip, planning=point.planning)))
    elif point.sampling == "fixed" and spec.precision != "fp32" and _first_bf16(point):
        # bf16 compute runs in float32 only, so the first_of_axes point above is never a bf16 one: its
        # first point runs the small C too, and a C no sample reaches (BF16_LOOSE_CLIP x the largest
        # norm): at the mid-norm C the unclipped samples' norms are within a few % of C on the
        # PRECISION_DIMS models, where a missing min(1, .) moves the step less than bf16's derived
        # bound (0.7x it on the mlp); with every sample below C/2 it scales each by >= 2
        specs.append(ready.with_(max_grad_norm=norm_picked(ready, _wide_clip, planning=point.planning)))
        specs.append(ready.with_(max_grad_norm=norm_picked(ready, _loose_clip, planning=point.planning)))
    elif spec.poisson and not p and spec.precision == "fp32":
        specs.append(short_poisson_spec(ready))
    yield point.case(ready, specs, doing="one DP step with noise 0" + (
        f" and {SHORT_POISSON_STEPS} at lr 0" if len(specs) > 1 and specs[1].steps > 1 else
        " at a mid-norm C and at C = min norm/100" if len(specs) > 1 else "")
                     + (f" and C = {BF16_LOOSE_CLIP:g} x max norm" if len(specs) > 2 else ""))
    if horizon_point(point, MODELS, REDUCTIONS, DTYPES):
        # the long run (horizon.py): every step of a long Poisson run against the reference step on its
        # batch (lr 0: the same parameters at every step), so a clip changed from step k shows at step k
        long = horizon_spec(point, noise_multiplier=0.0, lr=0.0)
        long = long.with_(max_grad_norm=pick_clip_bound(long, point.planning) or 1.0)
        yield point.case(long, doing=f"{long.steps} DP steps with noise 0 (long run)", labels=horizon_labels(long),
                         isolate=True)
    if _runs_default_bf16(point, spec):
        # the default gate (no --precisions) judges the bf16 forms too, once, where the target declares
        # them: a bug only on the path users fine-tune with is otherwise outside every default run
        for form in PRECISIONS[1:]:
            for item in cases(dataclasses.replace(point, precision=form, dtype="float32")):
                if isinstance(item, Case):
                    item.facts = {**item.facts, DEFAULT_PRECISION_FACT: True}
                yield item
    if _runs_short_layer(point, spec):
        short = prepare(spec.with_(model_kwargs=SHORT_LAYER_DIMS), point.planning)
        if not isinstance(short, str):
            # a job of its own: a crash re-runs every run of a shared job one by one
            yield point.case(short, doing="one DP step with noise 0 on a layer with fewer rows than ranks",
                             labels={"model_kwargs": dict(SHORT_LAYER_DIMS)}, isolate=True)


def short_poisson_spec(ready: RunSpec) -> RunSpec:
    """Beside a Poisson point's one step: ``SHORT_POISSON_STEPS`` steps of the same sampling at lr
    0 and the same C, each judged against the reference step on its realised batch (as the long run
    is). One step's realised batch is a few samples (2.5 expected at one rank), often all on one
    side of C, where a missing ``min(1, .)`` or a wrong bound cannot show; over these steps every
    sample of the dataset is drawn about twice (a sample below C is never drawn with probability
    ~(1-q)^steps = 1e-1 each, all five of the mid-norm split's with ~1e-5)."""
    per_epoch = ready.steps_per_epoch
    # twice the epochs the steps need: every rank stops after SHORT_POISSON_STEPS steps, and a
    # sampler that skips an empty local batch (upstream opacus: docs/findings.md) still has draws
    # left, so its ranks take the same steps instead of one ending early (a hang that is the
    # sampling checks' finding, not this one's: the long run avoids it with 64 samples per rank)
    return ready.with_(steps=SHORT_POISSON_STEPS, epochs=capped_epochs(SHORT_POISSON_STEPS, per_epoch), lr=0.0)


def _wide_clip(norms: torch.Tensor) -> float:
    return WIDE_CLIP * smallest_norm(norms)


def _loose_clip(norms: torch.Tensor) -> float:
    return BF16_LOOSE_CLIP * float(norms.max())


def _first_bf16(point: Point) -> bool:
    """Whether ``point`` is its world size's first mixed-precision point along the model and
    reduction axes (its dtype is float32, the one bf16 compute runs in)."""
    o = point.options
    return point.model == (o.models or MODELS)[0] and point.reduction == (o.reductions or REDUCTIONS)[0]


def _runs_default_bf16(point: Point, spec: RunSpec) -> bool:
    """Whether ``point`` adds the bf16 forms' cases of a run that selected no precision: the first
    point (fixed sampling, first model, reduction and dtype, fp32, no accumulation) of the smallest
    1-D world size; not when the run's dtypes leave float32 out (bf16 compute runs over
    float32)."""
    o = point.options
    return (o.precisions is None and (o.dtypes is None or "float32" in o.dtypes) and bool(o.world_sizes)
            and point.world_size == min(o.world_sizes)
            and not point.mesh and point.sampling == "fixed" and spec.precision == "fp32"
            and not spec.physical_batch_size and point.first_of_axes(MODELS, REDUCTIONS, DTYPES))


def _runs_short_layer(point: Point, spec: RunSpec) -> bool:
    """Whether ``point`` runs the short-layer case: at world sizes > 1, on the transformer's first
    point (fixed sampling, the first reduction and dtype, fp32, no accumulation)."""
    o = point.options
    return (point.world_size > 1 and point.model == SHORT_LAYER_MODEL and point.sampling == "fixed"
            and point.reduction == (o.reductions or REDUCTIONS)[0] and point.dtype == (o.dtypes or DTYPES)[0]
            and spec.precision == "fp32" and not spec.physical_batch_size and not spec.mesh)


def reference_step(spec: RunSpec, indices: List[int], clip_epsilon: float = CLIP_EPSILON):
    """``(DPStep, expected parameters)`` for the samples ``indices`` of step 0, clipped with
    ``min(1, C/(||g_i|| + clip_epsilon))``. An empty (Poisson) batch releases a zero gradient at
    noise 0 and leaves the parameters as they are."""
    model = reference_model(spec)
    if not indices:
        zero = {n: torch.zeros_like(p.detach()) for n, p in model.named_parameters() if p.requires_grad}
        empty = torch.zeros(0, dtype=torch.float64)
        return (reference.DPStep(empty, empty, zero, zero, zero, float("nan")),
                {n: p.detach() for n, p in model.named_parameters()})
    step = reference.dp_sgd_gradient(model, reference_batch(spec).select(indices), max_grad_norm=spec.max_grad_norm,
                                     reduction=spec.reduction, expected_batch_size=spec.expected_batch_size,
                                     clip_epsilon=clip_epsilon)
    # a frozen parameter has no gradient: it stays as it was
    params = {n: p.detach() - spec.lr * step.gradient[n] if n in step.gradient else p.detach()
              for n, p in model.named_parameters()}
    return step, params


def judge(case: Case, runs: Outputs) -> Verdict:
    if "horizon" in case.labels:
        return judge_horizon(case, runs[0][0])
    ws = case.world_size
    evidence: Dict[str, Any] = {}
    passed = []
    for j, (spec, outputs) in enumerate(zip(case.specs, runs[0])):
        if j and spec.steps > 1:  # a Poisson case's lr-0 steps (short_poisson_spec)
            v = judge_horizon(case, outputs, spec)
            evidence["short_run"] = v.evidence
            if v.status != "pass":
                return case.verdict("fail", "mismatch", (
                    f"the one step passes; in the {spec.steps} lr-0 steps run beside it (every sample drawn "
                    f"about twice, some clipped and some not): {v.message}"), evidence)
            passed.append(f"{spec.steps} more steps at lr 0 each equal the reference")
            continue
        tag = TAGS[j]
        unjudged = (precision_unjudgeable(spec, processed_indices(outputs, 0, spec))
                    if spec.precision != "fp32" and all(o.steps for o in outputs) else "")
        if unjudged:  # too many ReLU units within rounding of 0 for a bf16 verdict (kinks.py)
            return case.verdict("skip", None, unjudged, evidence)
        problem = judge_spec(case, spec, outputs, evidence, tag)
        if problem:
            if j == 1:
                problem = (f"at C = min norm/100 = {spec.max_grad_norm:.4g} (every sample's norm >= 100 C; the "
                           f"mid-norm C = {case.spec.max_grad_norm:.4g} passes): {problem}")
            elif j == 2:
                problem = (f"at C = {BF16_LOOSE_CLIP:g} x max norm = {spec.max_grad_norm:.4g} (no sample reaches C: "
                           f"every coefficient must be 1; the mid-norm C = {case.spec.max_grad_norm:.4g} and C = min "
                           f"norm/100 pass): {problem}")
            return case.verdict("fail", "mismatch", problem, evidence)
        own = f" with epsilon {evidence[tag + 'clip_epsilon']:.3g}" if tag + "clip_epsilon" in evidence else ""
        passed.append(f"{evidence[tag + 'clipped']} of {evidence[tag + 'samples']} samples clipped at "
                      f"C={spec.max_grad_norm:.4g}{own}")
    if "gradient_error_bound" in evidence:  # mixed precision: judged against its derived bound
        ratio = max(v / evidence["gradient_error_bound"] for k, v in evidence.items()
                    if k.endswith("_grad_error") and not k.startswith(TAGS[1:]))
        return case.verdict("pass", None, (
            f"DP step equals the reference within its {case.spec.precision} bound at world_size={ws} "
            f"({'; '.join(passed)}; distance {fmt(ratio)} x the bound)"), evidence)
    errs = [v for k, v in evidence.items() if k.endswith("_rel_err") or k.endswith("_max_abs_error")]
    return case.verdict("pass", None, (
        f"DP step equals the reference at world_size={ws} ({'; '.join(passed)}; max relative error "
        f"{fmt(max(errs))})"), evidence)


def judge_horizon(case: Case, outputs, spec: Optional[RunSpec] = None) -> Verdict:
    """The long run (or a Poisson case's short lr-0 run, ``spec``): each step's released gradient
    (noise 0, lr 0) against the reference DP-SGD step on that step's realised batch; a failure
    names the first wrong step and how many followed."""
    spec, ws = spec or case.spec, case.world_size
    rtol, atol = tolerance(spec.dtype)
    steps = min(len(o.steps) for o in outputs)
    per_epoch = spec.steps_per_epoch
    wrong = []  # (step, rank, error, tensor, reference step, indices)
    # lr 0: every step's parameters are the initial ones, so each sample's gradient is computed once
    grads = reference_grads(spec)  # shared with the other judges (compare._GRADS_CACHE): read only below
    norms = reference.per_sample_norms(grads)
    epsilons = set()  # the clip epsilons the steps were judged at, where not opacus'
    for k in range(steps):
        indices = processed_indices(outputs, k, spec)
        step = _dataset_step(spec, grads, norms, indices)
        first = outputs[0].steps[k].gradient
        scale = None  # float32, past the tolerance: the measured rounding (as judge_spec)
        if indices and spec.dtype == "float32" and not all(tensors_close(o.steps[k].gradient, step.gradient, rtol,
                                                                         atol) for o in outputs):
            scale = rounding_allowance(spec, indices, step.coefficients)
        if indices and not tensors_close(first, step.gradient, rtol, atol, scale):
            # as judge_spec does: any epsilon in [0, MAX_CLIP_EPSILON] is DP-SGD's clip (C/max(||g||, C)
            # is e = 0), so the step is judged against the reference at the target's own
            names = sorted(step.gradient)
            if all(n in first and first[n].shape == step.gradient[n].shape for n in names):
                def at(e: float, i=indices, n=names) -> torch.Tensor:
                    return flat(_dataset_step(spec, grads, norms, i, e).gradient, n)

                eps = fit_clip_epsilon(at, flat(first, names))
                own = _dataset_step(spec, grads, norms, indices, eps)
                if tensors_close(first, own.gradient, rtol, atol, scale):
                    step = own
                    epsilons.add(eps)
        for r, o in enumerate(outputs):
            if not tensors_close(o.steps[k].gradient, step.gradient, rtol, atol, scale):
                err, name = max_rel_diff(o.steps[k].gradient, step.gradient)
                wrong.append((k, r, err, name, step, indices))
                break
    evidence = {"steps": steps, "max_grad_norm": spec.max_grad_norm, "wrong_steps": [w[0] for w in wrong],
                "steps_per_epoch": per_epoch}
    if epsilons:
        evidence["clip_epsilon"] = max(epsilons)
    where = (f"{steps}-step run of Poisson sampling q={spec.sample_rate:g} over N={spec.dataset_size} "
             f"({spec.epochs} epochs of {per_epoch}) at world_size={ws}, C={spec.max_grad_norm:.4g}")
    if wrong:
        k, r, err, name, step, indices = wrong[0]
        why = explain(case, spec, outputs[r].steps[k], step, indices, r, err, name)
        return case.verdict("fail", "mismatch", (
            f"from step {k} (counted from 0; epoch {k // per_epoch + 1}) on, the DP step differs from the reference "
            f"in a {where}: {len(wrong)} of the {steps - k} steps from step {k} differ"
            + (f", the {k} before it equal the reference" if k else "")
            + f". At step {k}: {why.rstrip('.')}." + (" A step that is right at first and wrong later (a flag flipped "
                                                      "after a warm-up, an epoch counter, a schedule) passes every "
                                                      "short run." if k else " It is wrong from the first step on.")),
            evidence)
    own_note = (f" (at the target's own clip epsilon, {min(epsilons):.3g}..{max(epsilons):.3g}, inside the accepted "
                f"0..{MAX_CLIP_EPSILON:g})" if epsilons else "")
    return case.verdict("pass", None, f"every one of the {steps} steps equals the reference DP-SGD step (noise 0) "
                        f"on its realised batch{own_note} in a {where}", evidence)


def _dataset_step(spec: RunSpec, grads, norms: torch.Tensor, indices: List[int],
                  clip_epsilon: float = CLIP_EPSILON) -> reference.DPStep:
    """The reference DP-SGD step (noise 0) on the samples ``indices`` of the dataset whose per-sample
    gradients ``grads`` and norms ``norms`` are given (``reference.dp_sgd_gradient``'s arithmetic),
    clipped with ``min(1, C/(||g_i|| + clip_epsilon))``."""
    idx = torch.tensor(indices, dtype=torch.long)
    mine = {n: g[idx] for n, g in grads.items()}
    coef = reference.clip_coefficients(norms[idx], spec.max_grad_norm, clip_epsilon)
    summed = reference.clipped_sum(mine, coef)
    divisor = float(spec.expected_batch_size) if spec.reduction == "mean" else 1.0
    zero = {n: torch.zeros_like(g) for n, g in summed.items()}
    return reference.DPStep(norms[idx], coef, summed, zero, {n: g / divisor for n, g in summed.items()},
                            float("nan"))


def judge_spec(case: Case, spec: RunSpec, outputs, evidence: dict, tag: str):
    """The failure message for one spec's run (``None`` if it equals the reference); fills ``evidence``."""
    rtol, atol = tolerance(spec.dtype)
    if any(not o.steps for o in outputs):
        return "a rank reported no step"
    indices = processed_indices(outputs, 0, spec)
    step, params = reference_step(spec, indices)
    evidence.update({tag + "max_grad_norm": spec.max_grad_norm, tag + "samples": len(indices),
                     tag + "clipped": int((step.coefficients < 1).sum())})
    if spec.poisson:
        evidence.update({"realised_batch": len(indices), "expected_batch": spec.expected_batch_size})
    bound = precision_bound(spec)
    if bound is not None:  # bf16 compute: elementwise bounds derived from its unit roundoff
        evidence["precision_bound"] = bound.describe()
        return judge_precision(case, spec, outputs, evidence, tag, bound, step, params, indices)
    first = outputs[0].steps[0].gradient
    # float32 (below float64's 1e-9, nothing needs it): past the tolerance, each coordinate may be off by
    # the rounding a correct target is measured to leave there (rounding_allowance), computed only then
    scale = None
    if indices and spec.dtype == "float32" and not all(tensors_close(o.steps[0].gradient, step.gradient, rtol, atol)
                                                       for o in outputs):
        scale = rounding_allowance(spec, indices, step.coefficients)
    if indices and not tensors_close(first, step.gradient, rtol, atol, scale):
        # DP-SGD's clip is min(1, C/||g_i||): any epsilon in [0, MAX_CLIP_EPSILON] in the denominator
        # is accepted (MAX_CLIP_EPSILON); judged against the reference at the target's own
        own = own_epsilon_step(spec, indices, first, step)
        if own is not None and tensors_close(first, own[0].gradient, rtol, atol, scale):
            (step, params), evidence[tag + "clip_epsilon"] = own[:2], own[2]
    # the parameters p - lr * grad carry the gradient's allowed rounding times lr (float32 draws that need it)
    moved = None if scale is None else {n: abs(spec.lr) * a for n, a in scale.items()}
    for r, o in enumerate(outputs):
        s = o.steps[0]
        g_err, g_name = max_rel_diff(s.gradient, step.gradient)
        p_err, p_name = max_rel_diff(s.parameters, params)
        evidence.update({f"{tag}rank{r}_grad_rel_err": g_err, f"{tag}rank{r}_param_rel_err": p_err})
        if not tensors_close(s.gradient, step.gradient, rtol, atol, scale):
            return explain(case, spec, s, step, indices, r, g_err, g_name)
        if not tensors_close(s.parameters, params, rtol, atol, moved):
            return (f"rank {r}: the gradient is right but the parameters after the step differ from "
                    f"p - lr * grad (lr={spec.lr}) by up to {fmt(p_err)} relative (worst {p_name!r}): the "
                    "optimizer does not apply the DP gradient it computed")
    return None


def rounding_allowance(spec: RunSpec, indices: List[int], coefficients) -> Dict[str, Any]:
    """Per tensor and coordinate, ``ROUNDING_MARGIN`` x the rounding a correct target computing in
    ``spec.dtype`` leaves in the released ``sum_i c_i g_i / D`` (``clipfit.rounding_floor``: this model's
    per-sample gradients computed in float32 against float64, plus ``u sum_i |c_i g_i|``). ~u of the
    summed terms on the default models; on a tiny one, whose gradients flow back through a normalisation
    over two features (the component along the input removed: a difference of nearly equal terms), up to
    ~1e-2 of the gradient: gate seed 40404's d_model-2 transformer in float32, where a correct target was
    6e-4 relative off the reference, 7 x inside this floor (a fixed 1e-4 called it a mismatch)."""
    grads = reference_grads(spec, 0)
    floor = rounding_floor(spec, indices, sample_columns(grads, indices), coefficients)
    floor = floor * ROUNDING_MARGIN / (float(spec.expected_batch_size) if spec.reduction == "mean" else 1.0)
    out, offset = {}, 0
    for n in sorted(grads):
        shape = grads[n].shape[1:]
        size = int(math.prod(shape))
        out[n] = floor[offset:offset + size].reshape(shape)
        offset += size
    return out


def own_epsilon_step(spec: RunSpec, indices: List[int], gradient, step):
    """``(DPStep, parameters, epsilon)``: the reference step at the clip epsilon in
    ``[0, MAX_CLIP_EPSILON]`` nearest to the released ``gradient``
    (``clipfit.fit_clip_epsilon``); ``None`` if the gradient lacks a parameter."""
    names = sorted(step.gradient)
    if any(n not in gradient or gradient[n].shape != step.gradient[n].shape for n in names):
        return None
    eps = fit_clip_epsilon(lambda e: flat(reference_step(spec, indices, e)[0].gradient, names),
                           flat(gradient, names))
    return (*reference_step(spec, indices, eps), eps)


def judge_precision(case: Case, spec: RunSpec, outputs, evidence: dict, tag: str, bound, step, params, indices):
    """``judge_spec`` under mixed precision: the released gradient within its derived norm-wise
    bound (``precision_bounds.precision_gradient_bound``), the parameters within ``lr`` times it plus
    their float32 rounding."""
    if not indices:  # an empty (Poisson) batch releases exactly zero at noise 0, in any precision
        for r, o in enumerate(outputs):
            largest = max((float(torch.as_tensor(g).abs().max()) for g in o.steps[0].gradient.values() if g.numel()),
                          default=0.0)
            evidence[f"{tag}rank{r}_grad_max_abs_error"] = largest
            if largest != 0.0:
                return f"rank {r}: the realised batch is empty, so the gradient must be zero (noise 0); it is not"
        return None
    limit = precision_gradient_bound(spec, bound, indices, step.coefficients)
    names = sorted(step.gradient)
    want = flat(step.gradient, names)
    p_names = sorted(params)
    p_want = flat(params, p_names)
    evidence[f"{tag}gradient_error_bound"] = limit
    # ReLU units within rounding of 0: a correct bf16 forward may flip them (kinks.py); the gradient is
    # judged from the nearest reference-with-flips, the bound then as derived
    columns = precision_flip_columns(spec, bound, indices, step.coefficients, names)
    found = precision_kinks(spec, bound)
    kinked = found.describe(indices)
    if kinked:
        evidence[f"{tag}ambiguous_relu_units"] = found.count(indices)
    for r, o in enumerate(outputs):
        s = o.steps[0]
        if any(n not in s.gradient or s.gradient[n].shape != step.gradient[n].shape for n in names):
            missing = sorted(n for n in names if n not in s.gradient or s.gradient[n].shape != step.gradient[n].shape)
            return f"rank {r}: parameters missing or of the wrong shape in the released gradient: {missing}"
        diff = flat(s.gradient, names) - want
        _, rest = nearest_with_flips(diff, columns)
        err = float(rest.norm())
        evidence[f"{tag}rank{r}_grad_error"] = err
        if kinked:
            evidence[f"{tag}rank{r}_grad_error_before_flips"] = float(diff.norm())
        if not err <= limit:
            g_err, g_name = max_rel_diff(s.gradient, step.gradient)
            return (explain(case, spec, s, step, indices, r, g_err, g_name, bound)
                    + f" Its distance from the reference step, {err:.4g} (2-norm), is {err / limit:.3g} x the "
                    f"{spec.precision} bound {limit:.4g} = (norm bound + K u) sum_i c_i ||g_i|| / D, where "
                    f"{bound.describe()}" + (f"; {kinked} (the distance is from the nearest such combination)"
                                             if kinked else "") + ".")
        if any(n not in s.parameters for n in p_names):
            return f"rank {r}: parameters missing after the step: {sorted(set(p_names) - set(s.parameters))}"
        moved = unflat(diff - rest, names, step.gradient)  # what the flips moved the gradient by
        p_err = float((flat(s.parameters, p_names) - p_want
                       + spec.lr * flat({n: moved.get(n, torch.zeros_like(params[n])) for n in p_names},
                                         p_names)).norm())
        p_limit = spec.lr * limit + bound.u_accumulate * float(p_want.norm())
        evidence[f"{tag}rank{r}_param_error"] = p_err
        if not p_err <= p_limit:
            return (f"rank {r}: the gradient is within its {spec.precision} bound but the parameters after the step "
                    f"are {p_err:.4g} from p - lr * grad (lr={spec.lr}; bound {p_limit:.4g}): the optimizer does not "
                    "apply the DP gradient it computed")
    return None


def _factor_why(spec: RunSpec, ws: int, k: float, realised: int) -> str:
    """What a gradient exactly ``k`` x the reference's is, where ``k`` is a factor the step math names
    (expected/realised batch under Poisson, 1/world_size, world_size, the physical batch's share); "" if none."""
    expected = spec.expected_batch_size
    if (spec.poisson and spec.reduction == "mean" and realised != expected
            and abs(k - expected / realised) < FIT_RTOL):
        return (f" = int(q*N)/realised batch = {expected}/{realised}: the step is normalised by the batch it "
                f"happened to draw ({realised} samples) instead of opacus' expected batch size int(q*N) = "
                f"{expected}. The divisor then depends on which samples were drawn: the released mean is not "
                "the clipped sum over a fixed divisor whose sensitivity (C/int(q*N)) the accounting assumes")
    if ws > 1 and abs(k - 1 / ws) < FIT_RTOL:
        return (f" = 1/world_size: the cross-rank gradient reduction averages over the {ws} ranks (FSDP "
                "reduce-scatter AVG) and nothing compensates; the signal is 1/N of the DP-SGD sum, so the "
                "noise is relatively N times too large (utility loss)")
    if ws > 1 and abs(k - ws) < FIT_RTOL * ws:
        return " = world_size: the gradient is summed over ranks where it should be averaged"
    if spec.physical_batch_size and abs(k * spec.physical_batch_size * ws - spec.expected_batch_size) < \
            FIT_RTOL * spec.expected_batch_size:
        return (f" = expected batch {spec.expected_batch_size} / ({spec.physical_batch_size} x {ws}): the step is "
                "normalised by the physical batch, not the expected logical batch (clipped signal and noise "
                "scaled alike: not the DP-SGD step the accounting describes)")
    return ""


def explain(case: Case, spec: RunSpec, s, step, indices, rank: int, err: float, name: str, bound=None) -> str:
    """Which simple hypothesis the wrong gradient fits: one constant factor (named when it is
    1/world_size, world_size, or -- under Poisson -- expected/realised batch size), a clip
    coefficient error fitted to the coefficients recovered from the gradient
    (``clipfit.fit_clip_coefficients``), a per-sequence loss normalised over padding
    (``norm_hypotheses.sequence_weights``), or wrong norms."""
    ws = case.world_size
    head = (f"rank {rank}: the DP gradient (noise 0) differs from the reference by up to {fmt(err)} relative "
            f"(worst {name!r}) at world_size={ws}, reduction={spec.reduction}")
    names = [n for n in step.gradient if n in s.gradient and s.gradient[n].shape == step.gradient[n].shape]
    if len(names) != len(step.gradient):
        missing = sorted(set(step.gradient) - set(names))
        return f"{head}: parameters missing or of the wrong shape: {missing}"
    got, want = flat(s.gradient, names), flat(step.gradient, names)
    if not indices:
        return f"{head}: the realised batch is empty, so the gradient must be zero (noise 0); it is not."
    k = float(got @ want / (want @ want))
    # a factor of 1 explains nothing: the difference is below FIT_RTOL (a clip epsilon off by 1e-6)
    if abs(k - 1) > FIT_RTOL and float((got - k * want).abs().max()) <= FIT_RTOL * float(want.abs().max()):
        why = _factor_why(spec, ws, k, len(indices))
        return f"{head}: it is exactly {k:.6g} x the reference{why}."
    tol = res_tol = COEF_TOL.get(spec.dtype, COEF_TOL["float64"])
    if bound is not None:
        tol, res_tol = precision_coefficient_bounds(spec, bound, indices)
    rec = recover_clip_coefficients(spec, indices, s.gradient)
    seen = rec.identifiable
    # under bf16 compute the coefficients are known only to a coarse bound: fitting the exact
    # coefficient-error shapes to them would name a cause the numbers cannot tell apart
    fits = bound is None and rec.residual <= rec.residual_bound(res_tol) and bool(seen.any())
    if fits:
        # a per-sequence loss normalised wrongly (padding counted): the target clips w_i g_i, so the
        # coefficient read against g_i is w_i min(1, C/(w_i ||g_i||))
        for _, weights, what in sequence_weights(spec):
            w = weights[indices]
            pred = w * reference.clip_coefficients(w * step.norms, spec.max_grad_norm)
            if float((rec.coefficients[seen] - pred[seen]).abs().max()) <= tol:
                return f"{head}: its per-sample losses {what}."
    # wrong norms before a coefficient fit: a norm that leaves a layer out is often near one constant
    # fraction of the true one, which a wrong bound C' fits too -- the norms the rank reports say which
    wrong_norms = _norms_off(spec, s, step, indices, bound)
    if wrong_norms:
        return f"{head}: {wrong_norms}"
    if fits:
        fit = fit_clip_coefficients(rec.coefficients[seen], step.norms[seen], spec.max_grad_norm, tol,
                                    None if rec.rounding_error is None else rec.rounding_error[seen])
        if fit is not None:
            return (f"{head}: the clip coefficients recovered from its gradient are "
                    f"{describe_clip_fit(fit, spec.max_grad_norm)} (fits {int(seen.sum())} samples to "
                    f"{fmt(fit.max_error)}).")
    return (f"{head}: no simple explanation (constant factor; clip coefficient with a wrong bound, floor, cap, "
            "epsilon or scale; wrong norms) fits.")


def _norms_off(spec: RunSpec, s, step, indices, bound) -> str:
    """The per-sample norms rank output ``s`` reports (the ones it clips with), where they are off the
    reference's beyond rounding (``bound``: bf16 compute's), in words with their direction; ``""``."""
    if s.norms is None or len(s.norms) != len(s.indices) or not all(i in indices for i in s.indices):
        return ""
    ref_own = step.norms[[indices.index(i) for i in s.indices]]
    off = s.norms.to(torch.float64) - ref_own
    rel = off / ref_own.clamp_min(1e-300)
    nerr = float(rel.abs().max())
    if bound is None and not nerr > 1e-6:
        return ""
    # under bf16: the derived bound plus what flipping a ReLU unit within rounding of 0 does (kinks.py)
    if bound is not None and bool((off.abs() <= precision_norm_tolerances(spec, bound, s.indices, ref_own)).all()):
        return ""
    if bool((rel <= 0).all()):
        what = (f"undercount the true norms (by up to {fmt(nerr)} relative): an undercounted norm (a layer left out "
                "of the norm, see norm_fidelity, which names it) clips too little, and a sample can contribute more "
                "than C")
    elif bool((rel >= 0).all()):
        what = f"overcount the true norms (by up to {fmt(nerr)} relative): over-clipped (see norm_fidelity)"
    else:
        what = f"are off by up to {fmt(nerr)} relative, some above, some below (see norm_fidelity)"
    return f"the per-sample norms this rank clipped with {what}, so its clip coefficients are wrong."


PROPERTY = Property(
    id="clipped_step",
    meaning=("with noise 0 the DP step equals sum_i min(1, C/||g_i||) g_i / D: the signal the privacy "
             "accounting assumes, neither scaled nor with unclipped samples"),
    cases=cases, judge=judge, models=MODELS, layouts=("split",), reductions=REDUCTIONS,
    dtypes=DTYPES, samplings=("fixed", "poisson"), params=(("physical_batch_size", 0),),
    precisions=PRECISIONS, meshes=True,
    # split data (the layout opacus defines a DP step for), >= 2 samples so a clip bound separates them
    fuzz=FuzzRecipe(draw=(("layouts", ("split",)), ("min_global_batch", 2)), prepare=prepare),
    # every axis of the space it judges: world size, model variants, local batch, C among the norms, lr,
    # dtype and bf16 forms, Poisson sampling with runs up to 200 steps, accumulation
    explore=ExploreRecipe(prepare=explore_prepare, labels=explore_labels))


__all__ = ["FIT_RTOL", "prepare", "explore_prepare", "explore_labels", "MODELS", "REDUCTIONS", "DTYPES", "WIDE_CLIP",
           "BF16_LOOSE_CLIP", "TAGS",
           "SHORT_LAYER_MODEL", "SHORT_LAYER_DIMS", "poisson_dataset_size", "cases", "reference_step", "judge",
           "judge_horizon",
           "judge_spec", "own_epsilon_step", "judge_precision", "explain", "PROPERTY"]

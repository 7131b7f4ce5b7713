"""sensitivity_bound: each sample's clipped contribution to the summed gradient has norm <= C.

DP meaning: this *is* the sensitivity the Gaussian mechanism is calibrated to. If one sample can
move the summed gradient by more than C, the noise sigma*C hides less than the analysis claims:
the stated (epsilon, delta) does not hold -- a privacy violation, whatever the other checks say.

Measured by leave-one-out on the target itself (noise 0): the step on the global batch minus the
step on the batch without sample j, times the divisor D, is sample j's contribution. The expected
batch size (the divisor under ``mean``) stays the global batch size in both runs (an explicit
``rank_batches`` split with sample j removed), so the difference is the contribution alone. C is
1/100 of the smallest non-zero reference norm, so *every* sample with a gradient is clipped, every
such norm is >= 100 C, and each contribution should have norm C (up to opacus' 1e-6 clip
epsilon; a sample with none, e.g. an all-padding sequence, contributes nothing): an under-count of
the norms shows at once, and so does a clip coefficient that is floored (``max(coef, f)`` for any f >= 0.01
lets a sample of norm 100 C contribute 100 f C) or clips at a bound above C. A failure names the
coefficient error the measured coefficients (contribution / true norm) fit
(``clipfit.fit_clip_coefficients``).

Extreme and rare samples (one case per world size, ``extreme_spec``): the ``extreme`` model in
float32 (``models.ExtremeMLP``: per-sample norms ~1 to ~1e20, one whose square overflows float32),
noise 0, lr 0, three steps whose local batches are exactly 1, an odd 3 and 6 samples, C at
1/1.005 of one sample's norm. No leave-one-out (an empty local batch would crash upstream opacus,
finding 4): each sample's contribution is read back from the released gradient by least squares
on the reference gradient *directions* (``contributions``) and must be at most C -- correct
behaviour for a norm beyond float32's range is a clipped contribution of norm C, finite -- and
equal to the reference's ``min(1, C/||g||) ||g||`` (a dropped or over-clipped sample is a
``mismatch`` without the privacy violation). A failure names each sample: its norm over C, its
rank's local batch (of one; last of an odd batch), a squared norm beyond float32.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

from ...lazy import torch

from ...lazy import reference
from ...models.catalog import EXTREME_SCALES
from ...targets import RunSpec
from ...verdict import Verdict
from ..analysis.clipfit import describe_clip_fit, fit_clip_coefficients
from ..analysis.postprocessing import UNIT_ROUNDOFF, coarse_grid, grid_rounding
from ..analysis.compare import (flat, norm_picked, reference_grads, reference_norms, sample_columns, smallest_norm,
                                tolerance)
from ..engine.contract import Case, Outputs, Point, Property
from ..wording.postprocessing import rounded_sensitivity_message


def leave_one_out_specs(spec: RunSpec, world_size: int) -> List[RunSpec]:
    """The full split, then one spec per sample with that sample removed from its rank's batch."""
    split = tuple(tuple(spec.rank_indices(0, r, world_size)) for r in range(world_size))
    out = [spec.with_(rank_batches=(split,))]
    for j in range(spec.global_batch_size):
        out.append(spec.with_(rank_batches=(tuple(tuple(i for i in part if i != j) for part in split),)))
    return out


#: C as a fraction of the smallest reference norm: every sample is clipped, at >= 100 x C
CLIP_FRACTION = 0.01
#: how close measured coefficients must be to a fitted coefficient error to name it (it only names a
#: cause; pass/fail is the slack below): float64 leave-one-out differences carry ~1e-12 relative error
NAME_TOL = 1e-6


def cases(point: Point):
    spec = point.spec(global_batch_size=3 * point.world_size)
    spec = spec.with_(max_grad_norm=norm_picked(spec, _clip_below_all, planning=point.planning))
    specs = leave_one_out_specs(spec, point.world_size) if spec.data_layout == "split" else [spec]
    yield point.case(spec, specs, doing="leave-one-out DP steps")
    # beside the property's own models only (a --models selection runs just those)
    if point.options.models is None and point.sampling == "fixed" and point.data_layout == "split" and \
            point.first_of_axes(PROPERTY.models, PROPERTY.reductions, PROPERTY.dtypes):
        yield point.case(extreme_spec(point.spec(), point.world_size, point.planning),
                         doing="extreme and rare samples (norms ~1 to ~1e20 C, local batches of 1 and 3)",
                         facts={"extreme": True})


#: the extreme case's steps: each rank's positions in its block of the global batch (``EXTREME_SCALES``
#: holds the scale of each position): a local batch of exactly 1 (a ~1e2 sample), an odd local batch
#: of 3 (its last sample ~1e2), and all six (~1, a sample at 1.005 C, ~1e6 and ~1e20: its squared
#: norm overflows float32)
EXTREME_STEPS = ((2,), (0, 1, 2), (0, 1, 2, 3, 4, 5))
#: where C sits in the extreme case: the first sample of step 2 has norm 1.005 C (within 1% of C)
EXTREME_NEAR_C = 1.005


def extreme_spec(base: RunSpec, ws: int, planning: bool = False) -> RunSpec:
    """The extreme case (``EXTREME_STEPS``) at ``base``'s world size and reduction: the ``extreme``
    model in float32 (where a squared norm of 1e40 overflows), 3 steps at lr 0 (every step at the
    initial parameters, so each is read back against the reference), noise 0; C 1/1.005 of step 2's
    first norm (``compare.PLANNED_CLIP`` when ``planning``: a dry run's)."""
    block = len(EXTREME_SCALES)
    batches = tuple(tuple(tuple(block * r + k for k in step) for r in range(ws)) for step in EXTREME_STEPS)
    spec = base.with_(model="extreme", model_kwargs=(), dtype="float32", global_batch_size=block * ws,
                      steps=len(EXTREME_STEPS), lr=0.0, noise_multiplier=0.0, rank_batches=batches)
    return spec.with_(max_grad_norm=norm_picked(spec, _near_first, step=len(EXTREME_STEPS) - 1,
                                                     planning=planning))


def _clip_below_all(norms: torch.Tensor) -> float:
    return CLIP_FRACTION * smallest_norm(norms)


def _near_first(norms: torch.Tensor) -> float:
    """C with the step's first sample at ``EXTREME_NEAR_C`` x C."""
    return float(norms[0]) / EXTREME_NEAR_C


def judge(case: Case, outputs: Outputs) -> Verdict:
    if case.facts.get("extreme"):
        return judge_extreme(case, outputs[0][0])
    spec, ws, runs = case.spec, case.world_size, outputs[0]
    if spec.data_layout != "split":
        return case.verdict("skip", None, "leave-one-out needs split data (removing a sample from one rank); "
                            f"layout {spec.data_layout!r} is not measured")
    rtol, atol = tolerance(spec.dtype)
    c = spec.max_grad_norm
    d = spec.divisor  # fixed sampling only: the global batch size under "mean"
    full = flat(runs[0][0].steps[0].gradient)
    withouts = [flat(runs[1 + j][0].steps[0].gradient) for j in range(spec.global_batch_size)]
    contributions = [float(((full - without) * d).norm()) for without in withouts]
    # two gradients of magnitude ~|full| are subtracted: their rounding is an absolute error
    slack = c * rtol + d * float(full.abs().max()) * rtol * full.numel() ** 0.5 + atol
    ratios = [x / c for x in contributions]
    norms = reference_norms(spec)
    evidence = {"max_grad_norm": c, "contribution_norms": contributions, "max_ratio_to_C": max(ratios),
                "min_norm_over_C": smallest_norm(norms) / c, "max_norm_over_C": float(norms.max()) / c}
    worst = max(range(len(contributions)), key=lambda j: contributions[j])
    if contributions[worst] <= c + slack:
        return case.verdict("pass", None, (
            f"every sample's clipped contribution has norm <= C={c:.4g} at world_size={ws} (largest "
            f"{max(ratios):.6f} C, leave-one-out over {len(contributions)} samples with norms "
            f"{evidence['min_norm_over_C']:.4g}..{evidence['max_norm_over_C']:.4g} C)"), evidence)
    owner = next(r for r in range(ws) if worst in spec.rank_indices(0, r, ws))
    reported = runs[0][owner].steps[0]
    cause = ""
    diagnosis = "mismatch"
    if reported.norms is not None and worst in reported.indices:
        true = float(reference_norms(spec)[worst])
        said = float(reported.norms[reported.indices.index(worst)])
        if said < true * (1 - 1e-6):
            diagnosis = "undercount"
            cause = (f" Rank {owner} clipped it with norm {said:.4g} but its true gradient norm is {true:.4g} "
                     f"(ratio {said / true:.4g}): the norms undercount, so the clip coefficient is too large.")
    rounded = _rounded_release(case, full, withouts, contributions, slack, evidence) if not cause else None
    if rounded is not None:
        return rounded
    if diagnosis == "mismatch":
        # each contribution is c_j g_j: its norm over the true norm is the coefficient sample j got
        # (a sample with a zero gradient, e.g. an all-padding sequence, got none to measure)
        live = norms > 0
        measured = torch.tensor(contributions, dtype=torch.float64)[live] / norms[live]
        fit = fit_clip_coefficients(measured, norms[live], c, NAME_TOL)
        if fit is not None:
            evidence["clip_fit"] = {"kind": fit.kind, "value": fit.value}
            cause = f" The coefficients the samples got (contribution / true norm) are {describe_clip_fit(fit, c)}."
    return case.verdict("fail", diagnosis, (
        f"PRIVACY VIOLATION: sample {worst}'s clipped contribution has norm {contributions[worst]:.4g} = "
        f"{ratios[worst]:.4g} x C (C={c:.4g}) at world_size={ws}; {sum(r > 1 + 1e-6 for r in ratios)} of "
        f"{len(ratios)} samples exceed C. The noise sigma*C is calibrated to a sensitivity of C, so the "
        f"stated privacy guarantee does not hold.{cause}"), evidence)


def _rounded_release(case: Case, full, withouts, contributions: List[float], slack: float,
                     evidence: Dict[str, Any]) -> Optional[Verdict]:
    """The verdict when every contribution above C is within what a rounding of the released gradient to
    a coarse grid explains (``analysis.postprocessing.grid_rounding``): both readings (wording), never a
    bare violation; ``None`` where there is no such grid or some contribution exceeds what it explains."""
    spec, c = case.spec, case.spec.max_grad_norm
    found = grid_rounding(full, withouts, spec.divisor, spec.dtype)
    if found is None or any(x > c + slack + b for x, b in zip(contributions, found.bounds)):
        return None
    worst = max(range(len(contributions)), key=lambda j: contributions[j])
    evidence["rounded_to"] = {"grid": found.grid, "share": found.share, "bounds": found.bounds}
    return case.verdict("fail", "mismatch", rounded_sensitivity_message(
        found.grid, found.share, worst, contributions[worst] / c, sum(x > c + slack for x in contributions),
        len(contributions), c, f"at world_size={case.world_size}"), evidence)


#: float32: a contribution read back from a float32 gradient carries ~1e-7 relative rounding
EXTREME_RTOL = 1e-4


def contributions(spec: RunSpec, step: int, indices, gradient, roundoff: float = 0.0
                  ) -> Tuple[torch.Tensor, torch.Tensor, float]:
    """``(contribution norms, their uncertainty [len(indices)], relative residual)``: with noise 0 the
    released gradient times D is ``sum_i d_i u_i``, ``u_i`` sample i's reference gradient direction
    (unit norm) and ``d_i`` the norm of its clipped contribution; a least-squares fit on the unit
    directions (norms from 1 to 1e20 would leave the small samples below a solver's rank cut-off)
    reads each ``d_i``. Its uncertainty: the released gradient's rounding in its dtype (eps x its
    norm) through the fit's dual vector -- a contribution of 1e17 C swamps a neighbour's C in float32; a
    release rounded to a coarse grid carries that grid's ``roundoff`` instead."""
    grads = reference_grads(spec, step)
    names = sorted(grads)
    basis = sample_columns(grads, indices)
    basis = basis / basis.norm(dim=0, keepdim=True).clamp_min(1e-300)
    released = torch.cat([gradient[n].reshape(-1).to(torch.float64) for n in names]) * spec.divisor
    d = torch.linalg.lstsq(basis, released.unsqueeze(1), driver="gelsd").solution.squeeze(1)
    rounding = 4 * max(torch.finfo(spec.torch_dtype).eps, roundoff) * float(released.norm())
    uncertainty = rounding * torch.linalg.pinv(basis).norm(dim=1)
    return d, uncertainty, float((basis @ d - released).norm() / released.norm().clamp_min(1e-300))


def _extreme_step(spec: RunSpec, ranks, k: int, roundoff: float, evidence: Dict[str, Any]) -> List[tuple]:
    """The findings of step ``k`` of the extreme case: ``(contribution / C, step, sample, words)`` per sample
    above C or below the reference's contribution, or one for a release that is no combination of the
    samples' gradients; ``roundoff``: the relative rounding of a release on a coarse grid (0: none)."""
    c = spec.max_grad_norm
    owner = {i: o.rank for o in ranks for i in o.steps[k].indices}
    local = {o.rank: len(o.steps[k].indices) for o in ranks}
    indices = sorted(owner)
    norms = reference_norms(spec, k)[indices]
    d, uncertainty, residual = contributions(spec, k, indices, ranks[0].steps[k].gradient, roundoff)
    want = reference.clip_coefficients(norms, c) * norms
    evidence["steps"][k] = {"norms_over_C": [float(n / c) for n in norms],
                            "contributions_over_C": [float(x / c) for x in d], "residual": residual}
    if not residual <= max(EXTREME_RTOL, 2 * roundoff):
        return [(math.inf, k, None, f"step {k}: the released gradient is not a combination of the processed "
                 f"samples' gradients (relative residual {residual:.3g})")]
    found = []
    for j, i in enumerate(indices):
        r = owner[i]
        x, n, slack = float(d[j]), float(norms[j]), max(EXTREME_RTOL * c, float(uncertainty[j]))
        where = (f"sample {i} (norm {n / c:.4g} C) on rank {r} at step {k}, " + (
            "its rank's local batch of exactly 1" if local[r] == 1 else
            f"the last of an odd local batch of {local[r]}" if local[r] % 2
            and i == ranks[r].steps[k].indices[-1] else
            f"in a local batch of {local[r]}"))
        if n > 1.8e19:  # its square exceeds float32's largest value
            where += " (its squared norm overflows float32)"
        if x > c + slack:
            found.append((x / c, k, i, f"{where} contributes {x / c:.6g} x C (clip coefficient {x / n:.4g})"))
        elif x < float(want[j]) - slack:
            found.append((0.0, k, i, f"{where} contributes {x / c:.6g} x C, not the {float(want[j]) / c:.6g} x C "
                          "of min(1, C/||g||) ||g|| (over-clipped or dropped)"))
    return found


def judge_extreme(case: Case, ranks) -> Verdict:
    """Each step of the extreme case: every sample's clipped contribution (read back,
    ``contributions``) is at most C, and is the reference's ``min(1, C/(||g|| + 1e-6)) ||g||``: no
    sample is left unclipped, however large, alone, or last in an odd batch, and none is dropped. A
    release rounded to a coarse grid (``analysis.postprocessing.coarse_grid``) is read back within that
    rounding, and failed with both readings (before or after the noise: this run has none)."""
    spec, ws = case.spec, case.world_size
    c = spec.max_grad_norm
    grid = coarse_grid(torch.cat([flat(o.steps[k].gradient) for o in ranks for k in range(spec.steps)]), spec.dtype)
    roundoff = UNIT_ROUNDOFF[grid[0]] if grid else 0.0
    evidence: Dict[str, Any] = {"max_grad_norm": c, "steps": {}}
    found = [f for k in range(spec.steps) for f in _extreme_step(spec, ranks, k, roundoff, evidence)]
    if grid and not found:
        most = max(max(s["contributions_over_C"]) for s in evidence["steps"].values())
        over = sum(x > 1 for s in evidence["steps"].values() for x in s["contributions_over_C"])
        total = sum(len(s["contributions_over_C"]) for s in evidence["steps"].values())
        evidence["rounded_to"] = {"grid": grid[0], "share": grid[1]}
        return case.verdict("fail", "mismatch", rounded_sensitivity_message(
            grid[0], grid[1], -1, most, over, total, c, f"at world_size={ws} (extreme and rare samples, float32, "
            "noise 0)"), evidence)
    if not found:
        return case.verdict("pass", None, (
            f"every sample's clipped contribution is min(1, C/||g||) ||g|| <= C at world_size={ws} over "
            f"{spec.steps} steps: norms up to {max(max(s['norms_over_C']) for s in evidence['steps'].values()):.3g} C "
            "(one's square overflows float32), a sample at 1.005 C, local batches of exactly 1 and of 3 (float32)"),
            evidence)
    found.sort(key=lambda f: -f[0])  # the largest contribution first
    worst = found[0]
    over = [f for f in found if f[0] > 1]
    text = "; ".join(f[3] for f in (over or found)[:4])
    if over:
        return case.verdict("fail", "mismatch", (
            f"PRIVACY VIOLATION: {len(over)} sample(s) contribute more than C={c:.4g} at world_size={ws} (extreme "
            f"and rare samples, float32, noise 0): {text}. The largest contributes {worst[0]:.4g} x C; the noise "
            "sigma*C is calibrated to a sensitivity of C, so the stated guarantee does not hold for them."), evidence)
    return case.verdict("fail", "mismatch", (
        f"{len(found)} sample(s) are clipped more than min(1, C/||g||) at world_size={ws} (extreme and rare samples, "
        f"float32, noise 0): {text}. Privacy holds (no contribution above C), but those samples are under-weighted "
        "or lost (utility)."), evidence)


PROPERTY = Property(
    id="sensitivity_bound", diagnoses=("mismatch", "undercount"),
    meaning=("no single sample moves the summed gradient by more than C: the sensitivity the noise is "
             "calibrated to; a violation voids the privacy guarantee"),
    cases=cases, judge=judge, models=("mlp", "transformer"), layouts=("split",), reductions=("mean",))


__all__ = ["leave_one_out_specs", "CLIP_FRACTION", "NAME_TOL", "cases", "EXTREME_STEPS", "EXTREME_NEAR_C",
           "extreme_spec", "judge", "EXTREME_RTOL", "contributions", "judge_extreme", "PROPERTY"]

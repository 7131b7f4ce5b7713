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
(``compare.fit_clip_coefficients``).
"""

from __future__ import annotations

from typing import Dict, List

import torch

from ..targets import RunSpec
from ..verdict import Verdict
from .compare import describe_clip_fit, fit_clip_coefficients, reference_norms, smallest_norm, tolerance
from .contract import Case, Outputs, Point, Property


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
    spec = spec.with_(max_grad_norm=CLIP_FRACTION * smallest_norm(reference_norms(spec)))
    specs = leave_one_out_specs(spec, point.world_size) if spec.data_layout == "split" else [spec]
    yield point.case(spec, specs, doing="leave-one-out DP steps")


def _flat(grads: Dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([grads[n].reshape(-1).to(torch.float64) for n in sorted(grads)])


def judge(case: Case, outputs: Outputs) -> Verdict:
    spec, ws, runs = case.spec, case.world_size, outputs[0]
    if spec.data_layout != "split":
        return case.verdict("skip", None, "leave-one-out needs split data (removing a sample from one rank); "
                            f"layout {spec.data_layout!r} is not measured")
    rtol, atol = tolerance(spec.dtype)
    c = spec.max_grad_norm
    d = spec.divisor  # fixed sampling only: the global batch size under "mean"
    full = _flat(runs[0][0].steps[0].gradient)
    contributions = []
    for j in range(spec.global_batch_size):
        without = _flat(runs[1 + j][0].steps[0].gradient)
        contributions.append(float(((full - without) * d).norm()))
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


PROPERTY = Property(
    id="sensitivity_bound", diagnoses=("mismatch", "undercount"),
    meaning=("no single sample moves the summed gradient by more than C: the sensitivity the noise is "
             "calibrated to; a violation voids the privacy guarantee"),
    cases=cases, judge=judge, models=("mlp", "transformer"), layouts=("split",), reductions=("mean",))

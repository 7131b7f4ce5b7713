"""The sentence of a post-processed release (``analysis/postprocessing.py``): the noise is there, the
update was changed after it -- utility wrong, privacy intact. Never "PRIVACY VIOLATION": a function of
a correctly-noised release costs no privacy, and the user must look for a wrong update, not a leak."""

from __future__ import annotations

from ..analysis.postprocessing import MIN_RELEASES, PostProcessing

#: the diagnosis of every verdict this module words
DIAGNOSIS = "post_processed"


def post_processing_message(f: PostProcessing, where: str) -> str:
    """The message of finding ``f`` in the run(s) ``where`` describes."""
    lead = "UTILITY LOSS (privacy intact): the noisy gradient was changed AFTER the noise was added " + where + ": "
    if f.kind == "norm_pinned":
        few = f.releases < MIN_RELEASES  # matched to the run's C or a norm pinned in a longer run
        what = (f"{'its' if few else 'every one of the'} {f.releases} noisy release(s) "
                f"{'have' if few else 'has'} global norm {f.value:.6g} ({'within' if few else 'relative spread'} "
                f"{f.spread:.1e}{' relative of C or of the norm the longer runs pin' if few else ''}; a noisy "
                "gradient's norm varies between draws by ~1/sqrt(2d) of d coordinates), "
                "so the noisy gradient was clipped (or rescaled) to that norm after the noise, and the "
                "update is shrunk with it. The noise went in before the clip")
    elif f.kind == "rescaled":
        what = (f"its noise-0 release is exactly {f.value:.4g} x the reference's clipped gradient, and its noise std "
                f"is {f.spread:.4g} x sigma*C/D: the signal and the noise are scaled alike, so the noisy gradient was "
                f"multiplied by {f.value:.4g} after the noise (the noise relative to the sensitivity, {f.value:.4g} "
                "C, is what the accounting states). The noise went in before the rescaling")
    else:
        noise = f", while only {f.spread:.1%} of the noise (released minus the noise-0 run's) is on that grid"
        what = (f"{f.value:.1%} of the values released in its {f.releases} noisy release(s) are exactly "
                f"representable in {f.grid}{noise}, so the noisy gradient was rounded to {f.grid} after the "
                "noise (noise drawn on a grid and added to the full-precision gradient leaves the release off it). "
                "The noise went in before the rounding")
    return (lead + what + ": the release is a deterministic function of a noisy release (post-processing), which "
            "costs no privacy beyond the noise's own accounting, but the model trained is not DP-SGD's (a utility "
            "bug: move the transformation before the noise, or drop it).")


def rounded_sensitivity_message(grid: str, share: float, worst: int, ratio: float, exceed: int, total: int,
                                c: float, where: str) -> str:
    """Contributions above C by no more than the rounding of the released gradient to ``grid`` explains
    (``analysis.postprocessing.grid_rounding``, ``coarse_grid``), in a run without noise: both readings, never
    a bare "PRIVACY VIOLATION" (the noise-0 run cannot tell whether the rounding is before or after where the
    noise goes). ``worst``: the sample of the largest contribution (-1: contributions read back, not left out)."""
    how = "leave-one-out contributions" if worst >= 0 else "contributions read back from the released gradient"
    who = f"sample {worst}: " if worst >= 0 else "largest "
    return (f"the released gradient is rounded to {grid} {where}: {share:.1%} of the released values are exactly "
            f"representable in {grid}, and the {how} exceed C={c:.4g} at most by what that rounding explains ({who}"
            f"{ratio:.6g} x C; {exceed} of {total} samples above C). Two readings, which this noise-0 run cannot "
            "tell apart: if the rounding is applied to the noisy gradient AFTER the noise, it is post-processing "
            "(privacy intact; a utility bug: the update loses precision); if the clipped sum is rounded BEFORE the "
            f"noise, the sensitivity is {max(ratio, 1.0):.6g} C instead of C, a privacy violation of that size (the "
            "noise sigma*C is calibrated to C). noise_calibration's noisy releases say which (post_processed there: "
            "after the noise).")


def rounded_grid_message(grid: str, share: float, where: str) -> str:
    """A release judge's grid finding in a run whose released values themselves lie on the ``grid`` (the
    noisy gradient rounded, or noise on the grid added to a clean part on it too): both readings, since the
    run alone (no noise-0 twin in the judge) cannot tell them apart; never a bare "PRIVACY VIOLATION"."""
    return (f"the released gradient lies on the {grid} grid {where}: {share:.1%} of the released values (not only "
            f"the noise) are exactly representable in {grid}, in a run of a finer dtype. Two readings, which this "
            f"run alone cannot tell apart: the noisy gradient was rounded to {grid} AFTER the noise (post-processing: "
            "privacy intact, a utility bug), or noise drawn on that grid was added to a clean gradient on it too (a "
            "discrete noise, which the Gaussian accounting does not cover: a privacy violation). noise_calibration's "
            "statistical cases, which compare the release with its noise-0 twin, say which (post_processed there: "
            "rounded after the noise).")

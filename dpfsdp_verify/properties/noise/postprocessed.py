"""noise_calibration's post-processing verdict: a noisy run whose releases were changed after the
noise (``analysis/postprocessing.py``) fails as ``post_processed`` -- the update is wrong, privacy is
intact -- before any noise test reads the transformed noise as too little, missing, low-rank or
non-Gaussian noise (a privacy violation it is not)."""

from __future__ import annotations

from typing import Dict, Optional, Sequence

from ...lazy import torch
from ...verdict import Verdict, config_label
from ...lazy import reference
from ..analysis.compare import processed_indices, reference_grads, rows
from ..analysis.postprocessing import (PostProcessing, mostly_nonzero, noisy_finding, pinned_norm, post_processing,
                                       rescaled)
from ..engine.contract import Case
from ..releases.wording import where as run_where
from ..wording.postprocessing import DIAGNOSIS, post_processing_message


def post_processed(case: Case, runs, names: Sequence[str], where: str, evidence: Dict) -> Optional[Verdict]:
    """The ``post_processed`` verdict of ``runs`` (``outputs[0]``: the noise-0 run, then the noisy
    ones; rank 0's full tensors are read), or ``None`` when no signature shows."""
    clean = runs[0][0].steps
    # no noise at all is no post-processing: an unnoised sum of one clipped sample has norm C too
    releases = [st.gradient for run in runs[1:] for st in run[0].steps]
    noise = torch.cat([(st.gradient[n] - c.gradient[n]).reshape(-1).to(torch.float64)
                       for run in runs[1:] for st, c in zip(run[0].steps, clean) for n in names])
    dtype = case.spec.dtype if getattr(case.spec, "precision", "fp32") == "fp32" else "mixed"
    f = post_processing(releases, names, dtype, noise) if noise.numel() and mostly_nonzero(noise) else None
    if f is None and noise.numel() and mostly_nonzero(noise):
        f = rescaled_release(case, runs, names, noise, len(releases), dtype)
    if f is None:
        return None
    evidence.update(post_processing=f.kind, post_processing_value=f.value, post_processing_spread=f.spread)
    return case.verdict("fail", DIAGNOSIS, post_processing_message(f, where), evidence)


def rescaled_release(case: Case, runs, names: Sequence[str], noise, releases: int, dtype: str = "float64"
                     ) -> Optional[PostProcessing]:
    """``rescaled`` (``analysis.postprocessing.rescaled``) from the noise-0 run's first step with samples at
    the initial parameters (step 0; at lr 0 any step: a Poisson round whose batch was empty reads nothing)
    -- the reference's clipped gradient of the samples it processed -- and the noise's std ratio."""
    spec = case.spec
    s = spec.noise_multiplier * spec.max_grad_norm / spec.divisor
    steps = range(len(runs[0][0].steps) if not spec.lr else min(1, len(runs[0][0].steps)))
    j = next((j for j in steps if processed_indices(runs[0], j, spec)), None)
    if j is None or not s > 0:  # no batch with samples at the initial parameters: no signal to read a factor from
        return None
    grads = rows(reference_grads(spec, j), processed_indices(runs[0], j, spec))
    coef = reference.clip_coefficients(reference.per_sample_norms(grads), spec.max_grad_norm)
    want = torch.cat([torch.einsum("b,b...->...", coef, grads[n]).reshape(-1) / spec.divisor for n in names])
    clean = torch.cat([runs[0][0].steps[j].gradient[n].reshape(-1).to(torch.float64) for n in names])
    return rescaled(clean, want, float(noise.pow(2).mean().sqrt()) / s, releases, dtype)  # "mixed": bf16's rounding


def pinned_release(case: Case, ranks, run, finding, evidence: Dict) -> Optional[Verdict]:
    """The ``post_processed`` verdict of one run's releases (``ranks``: its rank outputs, ``run``: their
    decomposition, ``finding``: what its noise tests found) when their global norms are pinned (a norm
    clip after the noise) and the noise is there (``noisy_finding``), or ``None``."""
    steps = ranks[0].steps if ranks and noisy_finding(finding) else []
    dtype = case.spec.dtype if getattr(case.spec, "precision", "fp32") == "fp32" else "mixed"
    f = pinned_norm([st.gradient for st in steps], sorted(steps[0].gradient), dtype) if steps else None
    if f is None:
        return None
    evidence.update(post_processing=f.kind, post_processing_value=f.value, post_processing_spread=f.spread)
    where = run_where(case.property, config_label(case.config()), run)
    return case.verdict("fail", DIAGNOSIS, post_processing_message(f, where), evidence)

"""The noise scale of each parameter with fewer dim-0 rows than ranks, in ``noise_calibration``'s one-row
exact case (``FEW_ROWS_DIMS``: the mlp with a one-row output layer, one noisy step beside its noise-0 twin).

DP meaning: FSDP gives such a parameter's rows to some ranks only (the others hold empty shards), so a
target that derives its noise from the shard -- skips empty shards, or divides the noise among the ranks
that would have held a share -- can release those few coordinates with too little noise (privacy) or too
much (utility), while every larger tensor is right. Pooled with the rest (tens of thousands of
coordinates) their scale is invisible; tested on their own it is not: the one-row layer's 65
coordinates at half the std give a chi-square p of ~2e-10 (``FewRowsNoiseDividedByRanks`` at 2 ranks).

The test: per such tensor, ``sum (noise / s)^2`` over its coordinates and draws is chi^2(its count) for
Gaussian noise of std ``s``; two-sided, Bonferroni over the tensors at ``ALPHA`` (the false-alarm bound of
the case). Power of the case's one draw (``tests/properties/test_review_r6.py``): a std ratio of 0.5 on the
64 weights of the one-row layer is found in 94 % of draws (1880 of 2000); a ratio of 2 always; 0.75 not
(p ~ 3e-3). Correct noise: 0 of 2000 draws below the bound.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ...lazy import torch

from ...verdict import Verdict
from ..analysis.stats import chi2_two_sided_p
from ..engine.contract import Case
from ..releases.signal import EITHER_LEAD

#: the one-row case's false-alarm bound (all its few-row tensors together)
ALPHA = 1e-7


def few_row_scales(noise, names: Sequence[str], s: float, world_size: int) -> List[Tuple[str, int, float, float]]:
    """``(tensor, coordinates, std ratio, p)`` for every tensor of ``names`` with fewer dim-0 rows than
    ``world_size`` (``noise[run][step][name]``: released minus noise-0 gradient; ``s``: the expected std)."""
    out = []
    for n in names:
        shape = noise[0][0][n].shape
        if not len(shape) or shape[0] >= world_size:
            continue
        z = torch.cat([step[n].reshape(-1) for run in noise for step in run]) / s
        if not z.numel():
            continue
        ss = float(z.pow(2).sum())
        out.append((n, int(z.numel()), (ss / z.numel()) ** 0.5, chi2_two_sided_p(ss, z.numel())))
    return out


def whole_release(noise, names: Sequence[str], s: float, world_size: int) -> Optional[Tuple[int, float, float]]:
    """``(coordinates, std ratio, p)`` of the noise on every other tensor (those with at least
    ``world_size`` rows), pooled; ``None`` without any."""
    zs = [torch.cat([step[n].reshape(-1) for run in noise for step in run]) / s for n in names
          if len(noise[0][0][n].shape) and noise[0][0][n].shape[0] >= world_size]
    z = torch.cat(zs) if zs else None
    if z is None or not z.numel():
        return None
    ss = float(z.pow(2).sum())
    return int(z.numel()), (ss / z.numel()) ** 0.5, chi2_two_sided_p(ss, z.numel())


def scale_failure(case: Case, noise, names: Sequence[str], s: float, where: str, evidence: Dict,
                  runs=None) -> Optional[Verdict]:
    """The ``mismatch`` verdict of a few-row tensor whose noise std is not ``s`` (module doc); ``None``.
    ``runs`` (``outputs[0]``: the noise-0 run first): where its release is zero -- no signal a rescale
    after the noise would have shown on (``postprocessed.py`` reads it first) -- and every tensor's noise
    is short alike, the run cannot tell too little noise from the whole noisy release rescaled after it
    (post-processing): the message says both. ``None``: the signal is taken to be there."""
    if case.world_size < 2:
        return None
    signal = runs is None or any(bool(st.gradient[n].any()) for st in runs[0][0].steps for n in names)
    found = few_row_scales(noise, names, s, case.world_size)
    evidence["few_row_tensors"] = {n: {"coordinates": k, "std_ratio": r, "p": p} for n, k, r, p in found}
    bad = [f for f in found if not f[3] >= ALPHA / len(found)]
    if not bad:
        return None
    n, k, ratio, p = min(bad, key=lambda f: f[3])
    lead = "PRIVACY VIOLATION: too little noise" if ratio < 1 else "UTILITY LOSS: too much noise"
    rest = whole_release(noise, names, s, case.world_size) if ratio < 1 and not signal else None
    others = ", ".join(f"{m!r} {r:.3f} x" for m, _, r, _ in found if m != n)
    tail = (". The noise of a parameter must not depend on how FSDP shards it: every coordinate needs std "
            "sigma*C/D, whichever rank holds its row.")
    if rest is not None and not rest[2] >= ALPHA and all(
            chi2_two_sided_p(c * (r / rest[1]) ** 2, c) >= ALPHA / len(found) for _, c, r, _ in found):
        evidence["whole_release"] = {"coordinates": rest[0], "std_ratio": rest[1], "p": rest[2]}
        lead = EITHER_LEAD
        tail = (f". Every other tensor's noise is short alike ({rest[1]:.3f} x over {rest[0]} coordinates, p = "
                f"{rest[2]:.2g}): the whole release is scaled, as noise too small everywhere (privacy violated) or the "
                "noisy gradient multiplied after the noise (post-processing, privacy intact, a wrong update) gives; "
                "this case's noise-0 release is zero (no signal to read the factor from), so it cannot tell them "
                "apart -- noise_calibration's cases with a signal decide.")
    return case.verdict("fail", "mismatch", (
        f"{lead} on {n!r}, a parameter with fewer rows than the {case.world_size} ranks (FSDP leaves some ranks "
        f"an empty shard of it), {where}: its noise std is {ratio:.3f} x sigma*C/D over its {k} coordinates "
        f"(two-sided chi-square p = {p:.2g} < {ALPHA / len(found):.2g})" + (f"; the other few-row tensors: {others}"
                                                                            if others else "") + tail), evidence)


__all__ = ["ALPHA", "few_row_scales", "whole_release", "scale_failure"]

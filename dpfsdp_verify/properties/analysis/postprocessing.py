"""Post-processing of a noisy release: evidence that a released gradient is a deterministic function
of a noisy release, i.e. that it was changed AFTER the noise was added.

DP meaning: whatever is computed from a correctly-noised release alone costs no privacy (the Gaussian
mechanism's guarantee holds for any function of its output). A target that clips, rescales or rounds
its *noisy* gradient trains a wrong model (utility), not a leaky one; the checks that fail it must not
call it a privacy violation. The signatures here are ones honest noise leaves with probability ~0:

* ``norm_pinned`` -- every release's global norm is the same value (to rounding): a norm clip of the
  noisy gradient. A noisy gradient's norm varies between draws by ~ 1/sqrt(2d) relative (d
  coordinates), never by < 1e-6.
* ``rounded`` -- every value released in a float32/float64 run is exactly representable in a
  coarser format (bfloat16, float16) while the noise is not on that grid: the noisy gradient was
  rounded. A Gaussian float32 value has bfloat16's 8-bit significand with probability ~2^-16.

Pure functions of tensors: findings, no sentences (``wording/postprocessing.py`` words them).
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from ...lazy import torch

#: relative spread of the releases' global norms below which they are one pinned value: a clip to C
#: with a stabilising epsilon (``C / (norm + 1e-6)``) pins the norm to ~1e-6 relative; honest noise
#: spreads the norms of d coordinates by ~1/sqrt(2d) (three draws within 1e-6 of each other: < 1e-9)
PINNED_SPREAD = {"float64": 1e-6, "float32": 1e-5}
#: fewest releases a pinned norm is judged on (two equal norms could be a coincidence of a tiny model)
MIN_RELEASES = 3
#: share of a run's nonzero released values that must lie on a coarse grid for ``rounded``
ON_GRID = 0.999
#: fewest nonzero values the grid share is measured on
MIN_VALUES = 256
COARSE = {"bfloat16": "bfloat16", "float16": "float16"}


class PostProcessing(NamedTuple):
    """What was done to the noisy gradient after the noise: ``kind`` ``"norm_pinned"`` (``value``:
    the pinned norm, ``spread``: the norms' relative spread) or ``"rounded"`` (``grid``: the format,
    ``value``: the share of released values on it, ``spread``: the share of the noise on it);
    ``releases``: how many releases show it."""

    kind: str
    value: float
    spread: float
    releases: int
    grid: str = ""


def _flat(release: Dict[str, "torch.Tensor"], names: Sequence[str]) -> "torch.Tensor":
    return torch.cat([release[n].reshape(-1).to(torch.float64) for n in names if n in release])


def on_grid(values: "torch.Tensor", fmt: str) -> float:
    """Share of the nonzero ``values`` exactly representable in ``fmt`` (``nan`` when none)."""
    v = values[values != 0]
    if not v.numel():
        return float("nan")
    back = v.to(getattr(torch, fmt)).to(torch.float64)
    return float((back == v).to(torch.float64).mean())


def release_norms(releases: Sequence[Dict[str, "torch.Tensor"]], names: Sequence[str]) -> List[float]:
    """The global norm of each release (one dict of full tensors per draw)."""
    return [float(_flat(r, names).norm()) for r in releases]


def pinned_norm(releases: Sequence[Dict[str, "torch.Tensor"]], names: Sequence[str], dtype: str
                ) -> Optional[PostProcessing]:
    """``norm_pinned`` when the noisy ``releases`` (one dict of full tensors per draw) all have one
    global norm, to ``PINNED_SPREAD[dtype]`` relative; ``None`` otherwise."""
    return pinned(release_norms(releases, names), dtype)


def pinned(norms: Sequence[float], dtype: str, values: Sequence[float] = ()) -> Optional[PostProcessing]:
    """``norm_pinned`` when the release ``norms`` are one value (>= ``MIN_RELEASES`` of them) or, fewer,
    each equal to one of ``values`` (a norm pinned in another run of the gate, or the run's C), to
    ``PINNED_SPREAD[dtype]`` relative; ``None`` otherwise."""
    norms = [n for n in norms if n > 0]
    tol = PINNED_SPREAD.get(dtype, PINNED_SPREAD["float32"])
    if not norms:
        return None
    spread = (max(norms) - min(norms)) / max(norms)
    if len(norms) >= MIN_RELEASES and spread <= tol:
        return PostProcessing("norm_pinned", max(norms), spread, len(norms))
    for v in values:
        if v > 0 and all(abs(n - v) <= tol * v for n in norms):
            return PostProcessing("norm_pinned", v, max(abs(n - v) / v for n in norms), len(norms))
    return None


def rounded(releases: Sequence[Dict[str, "torch.Tensor"]], names: Sequence[str], dtype: str,
            noise: Optional["torch.Tensor"] = None) -> Optional[PostProcessing]:
    """``rounded`` when a float32/float64 run's released values all (``ON_GRID``) lie on bfloat16's or
    float16's grid and the ``noise`` (release minus the noise-0 release) does not:
    noise drawn on that grid and added to a full-precision gradient leaves the release off it, so
    this is the noisy gradient rounded, not coarse noise. ``None`` otherwise, and without ``noise``
    (a release alone cannot tell a rounded noisy gradient from coarse noise on a zero gradient)."""
    if dtype not in ("float32", "float64") or not releases or noise is None:
        return None
    values = torch.cat([_flat(r, names) for r in releases])
    if int((values != 0).sum()) < MIN_VALUES:
        return None
    for fmt in COARSE:
        share = on_grid(values, fmt)
        if share >= ON_GRID:
            noisy = on_grid(noise, fmt)
            if not noisy < ON_GRID:
                return None  # the noise itself is on the grid: coarse noise, the noise checks' finding
            return PostProcessing("rounded", share, noisy, len(releases), fmt)
    return None


def post_processing(releases: Sequence[Dict[str, "torch.Tensor"]], names: Sequence[str], dtype: str,
                    noise: Optional["torch.Tensor"] = None) -> Optional[PostProcessing]:
    """The first post-processing signature the noisy ``releases`` show (module doc), or ``None``."""
    return pinned_norm(releases, names, dtype) or rounded(releases, names, dtype, noise)


def mostly_nonzero(noise: "torch.Tensor") -> bool:
    """Whether most coordinates of ``noise`` (release minus the noise-0 release) are noised at all: a
    post-processing verdict needs the noise to be there (a release with no noise whose norm is pinned
    -- an unnoised sum of one clipped sample has norm C -- is missing noise, a privacy violation)."""
    return float((noise != 0).to(torch.float64).mean()) > 0.5


def noisy_finding(finding) -> bool:
    """Whether a release-judge ``finding`` (``releases.analysis.Finding``) measured noise at all: a scale
    finding with a std ratio above ``1e-3`` (none, or only rounding, is missing noise, never post-processing)."""
    return finding is not None and finding.kind == "scale" and finding.ratio > 1e-3


#: a value rounded to nearest in each coarse format is within this relative error of the exact one
#: (half a unit in the last place of a significand of 8 (bfloat16) or 11 (float16) bits)
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


class GridRounding(NamedTuple):
    """Released gradients of a float32/float64 run that all lie on a coarser format's grid: ``grid``
    the format, ``share`` the share of the nonzero values on it, ``bounds`` per leave-one-out
    difference the largest norm rounding to that grid can add to it (``roundoff`` x the norms of the
    two releases subtracted, times the divisor)."""

    grid: str
    share: float
    bounds: List[float]


def grid_rounding(full: "torch.Tensor", withouts: Sequence["torch.Tensor"], divisor: float,
                  dtype: str) -> Optional[GridRounding]:
    """``GridRounding`` when the noise-0 release ``full`` and each leave-one-out release in ``withouts``
    (flat float64) all lie (``ON_GRID``) on bfloat16's or float16's grid in a float32/float64 run; ``None``
    otherwise. A clipped sum computed in float32/float64 lands on bfloat16's grid with probability
    ~2^-16 per value: the released gradient was rounded after the sum. Without noise the release cannot
    tell whether the rounding came before or after the noise would have been added."""
    found = coarse_grid(torch.cat([full, *withouts]), dtype)
    if found is None:
        return None
    u, n = UNIT_ROUNDOFF[found[0]], float(full.norm())
    return GridRounding(found[0], found[1], [divisor * u * (n + float(w.norm())) for w in withouts])


def coarse_grid(values: "torch.Tensor", dtype: str) -> Optional[Tuple[str, float]]:
    """``(format, share)``: the coarse format (bfloat16, then float16) on whose grid ``ON_GRID`` of the nonzero
    released ``values`` of a float32/float64 run lie (at least ``MIN_VALUES`` of them), or ``None``."""
    if dtype not in ("float32", "float64") or int((values != 0).sum()) < MIN_VALUES:
        return None
    for fmt in COARSE:
        share = on_grid(values, fmt)
        if share >= ON_GRID:
            return fmt, share
    return None


#: ``rescaled``: the noise-0 release is the reference's clipped gradient times one factor to this relative
#: residual (a clip-epsilon variant moves it by ~1e-6), the factor off 1 by at least ``RESCALE_OFF``, and the
#: noise's std ratio within ``RESCALE_MATCH`` (relative) of the same factor
RESCALE_RESIDUAL, RESCALE_OFF, RESCALE_MATCH = 1e-3, 0.05, 0.15
#: the residual under bf16 compute (``precision`` not fp32): the noise-0 release went through bf16's
#: forward and backward (8 significant bits, unit roundoff 2^-9 ~ 2e-3 a rounding); review r6's
#: ``RescalesNoisyGradient`` at 2 ranks, bf16-fsdp, left 6.0e-3 against the float64 reference
RESCALE_RESIDUAL_MIXED = 0.02


def rescaled(clean: "torch.Tensor", want: "torch.Tensor", noise_ratio: float, releases: int,
             dtype: str = "float64") -> Optional[PostProcessing]:
    """``rescaled`` when the noise-0 release ``clean`` is ``f`` x the reference's clipped gradient ``want``
    (flat, one step) with ``f`` off 1, and the noise's std ratio (measured over sigma*C/D) is ``f`` too: the
    signal and the noise scaled alike, i.e. the noisy gradient multiplied by ``f`` after the noise (``value``:
    ``f``, ``spread``: the noise ratio). A noise ratio off ``f`` is a noise finding, not this."""
    denom = float(want.pow(2).sum())
    if not denom > 0:
        return None
    f = float((clean * want).sum()) / denom
    resid = float((clean - f * want).norm()) / max(float(clean.norm()), 1e-300)
    residual = RESCALE_RESIDUAL_MIXED if dtype == "mixed" else RESCALE_RESIDUAL  # ``post_processing``'s dtype
    if not (f > 0 and resid <= residual and abs(f - 1) >= RESCALE_OFF
            and abs(noise_ratio / f - 1) <= RESCALE_MATCH):
        return None
    return PostProcessing("rescaled", f, noise_ratio, releases)

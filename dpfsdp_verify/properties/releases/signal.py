"""Too little noise, or a noisy release rescaled after the noise? The release judge's std test reads
the noise off the span of the batch's per-sample gradients and finds it ``r`` x sigma*C/D. Two bugs
give that: noise ``r`` x too small (the signal, the reference's clipped sum, released as it is: a
privacy violation) or the whole noisy release multiplied by ``r`` after the noise (the signal
released ``r`` x too: post-processing, privacy intact, a wrong update). The noise-free twin
``noise_calibration`` reads the factor from is not there for most runs; the release itself holds
it, in its component along the clipped sum::

    f = sum_t <release_t x D, clean_t> / sum_t |clean_t|^2

is 1 for the first bug and ``r`` for the second, with a standard error of ``r / sqrt(sum |clean|^2)``
(``clean`` in units of sigma*C: the noise's projection on it). Each reading is named only where the
other is ``Z`` standard errors away (a false reading: < 1e-4 a finding); otherwise the message says
it cannot tell them apart -- at sigma 4 and a batch of 2 the signal is a fraction of the noise, and a
run of a few steps does not decide. Pure arithmetic on ``RunReleases.signal``; no tensors kept.
"""

from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional, Tuple

#: standard errors a reading must be from the other to be named (two-sided ~6e-5)
Z = 4.0


def signal_terms(acc: Tuple[float, float], released, clean, unit: float) -> Tuple[float, float]:
    """``acc`` plus one step's ``(<released, clean>, |clean|^2)`` in units of ``unit`` = sigma C squared
    (``released``: the release x D; ``clean``: the reference's clipped sum, both flat float64)."""
    return acc[0] + float(released @ clean) / unit ** 2, acc[1] + float(clean @ clean) / unit ** 2


class Reading(NamedTuple):
    """``kind``: ``"noise"`` (the signal released whole: the noise is short), ``"rescaled"`` (the signal
    scaled like the noise: rescaled after it) or ``"either"``; ``factor`` f and its standard error."""

    kind: str
    factor: float
    error: float


def reading(signal: Tuple[float, float], ratio: float) -> Reading:
    """Which bug a whole-run std ratio ``ratio`` < 1 comes from, by the release's factor on the signal."""
    num, den = signal
    if not den > 0 or not ratio > 0:
        return Reading("either", float("nan"), float("inf"))
    f, se = num / den, ratio / math.sqrt(den)
    from_one, from_ratio = abs(f - 1.0) / se, abs(f - ratio) / se
    kind = ("rescaled" if from_one > Z >= from_ratio else "noise" if from_ratio > Z >= from_one else "either")
    return Reading(kind, f, se)


#: the opening of a std finding whose run cannot tell the two bugs apart
EITHER_LEAD = "too little noise, OR the noisy gradient rescaled after the noise (this run cannot tell them apart)"


def either_tail(r: Reading, ratio: float) -> str:
    """The closing sentence of a std finding whose run cannot tell the two bugs apart."""
    return (" Which one: the release's factor on the reference's clipped sum is "
            + (f"{r.factor:.3f} +- {r.error:.3f}" if math.isfinite(r.factor) else "unreadable (no signal)")
            + f", consistent with both 1 (the noise itself too small: privacy violated) and {ratio:.3f} (the noisy "
            "gradient multiplied by it after the noise: post-processing, privacy intact, a wrong update); a run with "
            "a larger batch or more steps, or noise_calibration's noise-free twin, decides.")


def rescaled_message(r: Reading, ratio: float, where: str) -> str:
    """The post-processing message of a run whose signal is scaled like its noise."""
    return ("UTILITY LOSS (privacy intact): the noisy gradient was rescaled AFTER the noise was added " + where
            + f": its noise std is {ratio:.3f} x sigma*C/D, and its component along the float64 reference's clipped "
            f"sum is {r.factor:.3f} +- {r.error:.3f} x that sum -- {abs(r.factor - 1) / r.error:.1f} standard errors "
            "from 1, within reach of the noise's factor: the signal and the noise are scaled alike, so the release "
            f"was multiplied by ~{ratio:.3f} after the noise (the noise relative to the sensitivity is what the "
            "accounting states). A function of a noisy release costs no privacy beyond the noise's own accounting, "
            "but the model trained is not DP-SGD's (a utility bug: move the scaling before the noise, or drop it).")


def read_finding(signal: Tuple[float, float], kind: str, ratio: float, scope: str) -> Optional[Reading]:
    """The reading of a release-judge finding (``analysis.Finding``'s kind, ratio, scope) where it applies:
    too little noise on the whole run (one ratio for every step and rank, as a rescale gives); else ``None``."""
    return reading(signal, ratio) if kind == "scale" and ratio < 1 and scope == "run" else None


def finding_words(r: Optional[Reading], ratio: float) -> Dict[str, str]:
    """``finding_message``'s ``lead`` / ``tail`` for a reading (``{}`` for none; a ``rescaled`` one has its
    own message, ``rescaled_message``)."""
    if r is None or r.kind == "rescaled":
        return {}
    return {"lead": EITHER_LEAD, "tail": either_tail(r, ratio)} if r.kind == "either" else {"tail": noise_note(r)}


def noise_note(r: Reading) -> str:
    """The sentence a proven too-little-noise message ends with: the signal is released whole."""
    return (f" The release's factor on the reference's clipped sum is {r.factor:.3f} +- {r.error:.3f} (1: the signal "
            "is released whole, so this is not a rescale after the noise).")


__all__ = ["Z", "signal_terms", "Reading", "reading", "EITHER_LEAD", "either_tail", "rescaled_message", "noise_note",
           "read_finding", "finding_words"]

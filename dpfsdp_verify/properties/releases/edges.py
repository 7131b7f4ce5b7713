"""A contrast confounded with sigma: "only the float32 runs are off" (``analysis.contrasts``,
``wording.cause``) says nothing about the dtype where the failing run's noise multiplier is also above
(below) every sigma of the runs it is contrasted with -- a bug confined to high sigma (a noise std capped
at some sigma) shows in that run only too. ``sigma_edge`` tells a cause's wording so; the message then
names both and says the runs cannot tell them apart (an explored draw at sigma 3.9, the gate's only
bf16-autocast run at its world size, was blamed on its dtype: run seed 5101, 2026-11-29)."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple


def sigma_edge(sigma: float, group: Sequence[Any]) -> Optional[Tuple[str, float]]:
    """``("above every one of theirs (sigma lo..hi)", sigma)`` where ``sigma`` is above (below) the sigma of
    every run of ``group`` (``RunReleases``), else ``None``."""
    lo, hi = min((r.sigma for r in group), default=sigma), max((r.sigma for r in group), default=sigma)
    side = "above" if sigma > hi else "below" if sigma < lo else ""
    return (f"{side} every one of theirs (sigma {lo:g}..{hi:g})", sigma) if side else None


__all__ = ["sigma_edge"]

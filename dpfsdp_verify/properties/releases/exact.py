"""The exact checks of a noisy run's raw residuals (``analysis.decompose``'s ``D g_t - G_t c_t`` in units
of sigma C, per (step, rank) shard): values on a coarse float grid (``count_on_grid``), coordinates
released with no noise (``silent``) and a shard's noise repeated at another step or rank (``repeats``).
No alpha: each is a count a correct run reaches with a stated, negligible probability (the module
docstring of ``analysis``)."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

from ...lazy import torch

#: significand bits of the coarse float formats whose grid the noise must not sit on
GRIDS = {"bfloat16": 8, "float16": 11}
#: a grid is named when more than this fraction of the noise values lie on it (continuous noise: < 5 %)
GRID_FRACTION = 0.5
#: the clip epsilon latitude the gate accepts (``MAX_CLIP_EPSILON``, relative to a norm of >=
#: ~1): the raw residual carries up to this relative part of the clean sum
CLIP_LATITUDE = 2e-5
#: repeats: values compared per shard pair, and "equal" as a fraction of sigma C
REPEAT_MIN, REPEAT_EQUAL = 8, 1e-3
#: silent coordinates: |raw residual| below this many sigma C is "no noise there" ...
SILENT = 1e-3
#: ... which a N(0, 1) value is with this probability (erf(SILENT / sqrt 2))
SILENT_P0 = math.erf(SILENT / math.sqrt(2))
#: ... and a count of such values is named when a correct run reaches it with probability below this
#: (per count; a gate run makes < 1e6 counts: a tensor shard's per step, a coordinate's per run)
SILENT_LEVEL = 1e-12
#: the fewest silent values named in one release (and the fewest steps for one coordinate)
SILENT_MIN = 4


def count_on_grid(released: torch.Tensor, clean: torch.Tensor, raw: torch.Tensor, eps: float,
                   grid_on: Dict[str, int]) -> int:
    """Adds to ``grid_on`` the raw residual values on each of ``GRIDS`` (within what rounding and the
    clip-epsilon latitude leave), among the values the grid test can resolve; returns how many those are."""
    tol = 16 * eps * (released.abs() + clean.abs()) + CLIP_LATITUDE * clean.abs()
    keep = raw.abs() > 64 * tol  # values the grid test can resolve
    v = raw[keep]
    for name, bits in GRIDS.items():
        grid_on[name] += int(((v - _round_bits(v, bits)).abs() <= tol[keep]).sum())
    return int(v.numel())


def _round_bits(v: torch.Tensor, bits: int) -> torch.Tensor:
    """``v`` rounded to ``bits`` significand bits (the nearest value of a float format with that
    precision and an unbounded exponent)."""
    m, e = torch.frexp(v)
    scale = float(2 ** bits)
    return torch.ldexp(torch.round(m * scale) / scale, e)


def _too_many(k: torch.Tensor, n: int) -> torch.Tensor:
    """Whether each count ``k`` of values within ``SILENT`` of 0 among ``n`` N(0, 1) values is one a
    correct run reaches with probability < ``SILENT_LEVEL``: the Chernoff bound ``P(K >= k) <= (e n
    p0 / k)^k`` for ``K ~ Binomial(n, p0)`` (an upper bound: never more false alarms than stated)."""
    kf = k.to(torch.float64).clamp(min=1)
    log_tail = kf * torch.log(math.e * n * SILENT_P0 / kf)
    return (k >= SILENT_MIN) & (kf > n * SILENT_P0) & (log_tail < math.log(SILENT_LEVEL))


def silent(cells: List[Tuple[int, int, torch.Tensor]], layout: List[List[Tuple[str, int]]]
           ) -> Optional[Tuple[str, int, Tuple[int, ...], int, int, Tuple[str, ...], Tuple[int, ...]]]:
    """Coordinates released with no noise (module docstring), from the raw residual cells (``(step,
    rank, values in sigma C)``): per rank and tensor, the steps whose shard of the tensor has too many
    values within ``SILENT`` of 0, and its coordinates silent at too many steps. For the (rank, tensor) with
    the most: ``(tensor, rank, steps where most of its silent coordinates are silent, its silent
    coordinates, its shard's coordinates, the other tensors with some, every rank with some)``;
    ``None`` if none."""
    by_rank: Dict[int, List[Tuple[int, torch.Tensor]]] = {}
    for t, r, v in cells:
        by_rank.setdefault(r, []).append((t, v))
    found = []  # (silent coordinates, tensor, rank, steps, size)
    for r, items in sorted(by_rank.items()):
        n = min(v.numel() for _, v in items)
        if n < SILENT_MIN or any(v.numel() != n for _, v in items):
            continue
        small = torch.stack([v for _, v in items]).abs() < SILENT  # [steps, coordinates]
        if not bool(small.any()):
            continue
        offset = 0
        for name, size in (layout[r] if r < len(layout) else [("?", n)]):
            part = small[:, offset:offset + size]
            # a tensor's shard at one step with too many, or one of its coordinates at too many steps
            part = part & (_too_many(part.sum(1), size)[:, None] | _too_many(part.sum(0), len(items))[None, :])
            k = int(part.any(0).sum())
            if k:
                # the steps where at least half of them are silent (not a chance near-zero value of one)
                steps = tuple(items[i][0] for i in (part.sum(1) * 2 >= k).nonzero().flatten().tolist())
                # spread thin (no step holds half of them): every step with one, never an empty list
                steps = steps or tuple(items[i][0] for i in part.any(1).nonzero().flatten().tolist())
                found.append((k, name, r, steps, size))
            offset += size
    if not found:
        return None
    k, name, r, steps, size = max(found, key=lambda f: f[0])
    others = tuple(sorted({f[1] for f in found} - {name}))
    return name, r, steps, k, size, others, tuple(sorted({f[2] for f in found}))


def repeats(cells: List[Tuple[int, int, torch.Tensor]]) -> Optional[Tuple[int, int, int, int, bool, int]]:
    """The first pair of (step, rank) shards whose noise (raw residual, units of sigma C) is equal
    or negated on their first ``min`` values (>= ``REPEAT_MIN``) to ``REPEAT_EQUAL``."""
    by_rank: Dict[int, List[Tuple[int, torch.Tensor]]] = {}
    for t, r, v in cells:
        if not v.numel() or float(v.abs().max()) <= 10 * REPEAT_EQUAL:
            continue  # no noise there: the scale test names that, not a repeat
        by_rank.setdefault(r, []).append((t, v))
    ranks = sorted(by_rank)
    for i, a in enumerate(ranks):
        for b in ranks[i:]:
            m = min(min(v.numel() for _, v in by_rank[a]), min(v.numel() for _, v in by_rank[b]))
            if m < REPEAT_MIN:
                continue
            xa = torch.stack([v[:m] for _, v in by_rank[a]])
            xb = torch.stack([v[:m] for _, v in by_rank[b]])
            for negated, other in ((False, xb), (True, -xb)):
                d = torch.cdist(xa, other, p=float("inf"))
                if a == b and not negated:
                    d.fill_diagonal_(float("inf"))
                hit = (d <= REPEAT_EQUAL).nonzero()
                if len(hit):
                    p, q = (int(x) for x in hit[0])
                    return (by_rank[a][p][0], a, by_rank[b][q][0], b, negated, m)
    return None


__all__ = ["GRIDS", "GRID_FRACTION", "CLIP_LATITUDE", "REPEAT_MIN", "REPEAT_EQUAL", "SILENT", "SILENT_P0",
           "SILENT_LEVEL", "SILENT_MIN", "count_on_grid", "silent", "repeats"]

"""Stratified exploration: which region of each axis a property's draw ``i`` of ``N`` comes from
(docs/explore.md, "Strata").

Each stratified axis is cut into ``K`` regions (strata): a ranged axis' ``explore`` range into
``min(STRATA, its size)`` equal parts (sigma in [0.5, 4]: [0.5, 1.375), [1.375, 2.25), [2.25,
3.125), [3.125, 4]; world sizes 1..4: one each), a named axis into its values. Draw ``i`` takes its
region of each axis from a seeded sequence of permutations of ``range(K)`` (``plan``): any ``K``
consecutive draws of a property take every region of that axis once, so the default 4 draws reach
every sigma quarter, every world size 1..4, every precision and every batch mode (fixed,
accumulation, Poisson, resumed), whatever the seed; hypothesis draws the value inside the region
(and every axis that is not stratified) as before. A bug confined to one region of a drawn axis
(sigma above 3, 3-4 ranks, bf16, a resumed run, a batch past 48, lr above 0.75) is therefore in
every default run's draws, not in some seeds' only.

The permutations are seeded by name (``space.seed_for(run seed, property, "explore", "strata")``,
``random.Random``'s shuffle, stable across machines and Python 3 versions), so ``--seed S`` draws
the same regions in the same order on any machine. Torch-free and hypothesis-free.
"""

from __future__ import annotations

import random
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..config import space

#: regions a ranged axis is cut into (fewer when it has fewer values): the default draw count
#: (``defaults.DEFAULT_EXPLORE_DRAWS``), so that every default run reaches every region
STRATA = 4

#: one draw's regions: axis -> (region index k, region count K)
Strata = Mapping[str, Tuple[int, int]]

#: the ranged axes stratified by their ``explore`` range (``space``); ``world_size`` by its top
#: (``explore_specs``' ``max_world_size``)
FLOAT_AXES = ("lr", "clip_quantile", "noise_multiplier")
INT_AXES = ("local_batch",)


def int_count(lo: int, hi: int) -> int:
    """Regions of the integer range ``lo..hi``: ``STRATA``, or one per value when it has fewer."""
    return max(1, min(STRATA, hi - lo + 1))


def int_region(lo: int, hi: int, k: int, count: int) -> Tuple[int, int]:
    """Region ``k`` of ``count`` of ``lo..hi``: contiguous, non-empty, together the whole range."""
    n = hi - lo + 1
    return lo + (n * k) // count, lo + (n * (k + 1)) // count - 1


def float_region(lo: float, hi: float, k: int, count: int) -> Tuple[float, float]:
    """Region ``k`` of ``count`` equal parts of ``[lo, hi]`` (its top end excluded but for the last)."""
    width = (hi - lo) / count
    return lo + k * width, (hi if k == count - 1 else lo + (k + 1) * width)


def precision_modes(precisions: Sequence[str], dtypes: Sequence[str]) -> Tuple[Tuple[str, str], ...]:
    """The (precision, dtype) regions: fp32 in each drawn dtype, then every bf16 form (over float32)."""
    fp32 = tuple(("fp32", d) for d in dtypes) if "fp32" in precisions else ()
    return fp32 + tuple((p, "float32") for p in precisions if p != "fp32")


def batch_modes(samplings: Sequence[str], physical: bool, resume: bool) -> Tuple[str, ...]:
    """The batch-and-loop regions: ``fixed`` batches, ``accumulation`` (fixed, physical passes),
    ``poisson`` sampling (a third of them long runs), ``resumed`` (checkpointed and resumed; its
    sampling drawn, no accumulation: ``space.combination_problem``)."""
    out: Tuple[str, ...] = ("fixed",) if "fixed" in samplings else ()
    out += ("accumulation",) if physical and "fixed" in samplings else ()
    out += ("poisson",) if "poisson" in samplings else ()
    return out + (("resumed",) if resume else ())


def axis_counts(max_world_size: int, *, models: Sequence[str], samplings: Sequence[str],
                precisions: Sequence[str], dtypes: Sequence[str], physical: bool, resume: bool,
                noise: bool) -> Dict[str, int]:
    """Every stratified axis of a property's draws and its region count (what ``plan`` permutes)."""
    counts = {"world_size": int_count(1, max_world_size), "model": len(models),
              "precision": len(precision_modes(precisions, dtypes)),
              "batches": len(batch_modes(samplings, physical, resume)),
              "local_batch": int_count(*space.integer("local_batch").drawn),
              "lr": STRATA, "clip_quantile": STRATA}
    if noise:  # a noisy draw's releases are judged where the batch is at most half the coordinates
        # (releases/analysis.py projects the signal off): its local batch stays hypothesis' (small-leaning)
        del counts["local_batch"]
        counts["noise_multiplier"] = STRATA
    return {k: v for k, v in counts.items() if v > 1}


def plan(seed: int, draws: int, counts: Mapping[str, int]) -> List[Dict[str, Tuple[int, int]]]:
    """The regions of ``draws`` draws: for each axis (in sorted order) a sequence of seeded
    permutations of ``range(K)``, draw ``i`` taking its ``i``-th element -- every ``K`` consecutive
    draws take every region once."""
    rng = random.Random(seed)
    out: List[Dict[str, Tuple[int, int]]] = [{} for _ in range(draws)]
    for axis in sorted(counts):
        k_all = counts[axis]
        seq: List[int] = []
        while len(seq) < draws:
            block = list(range(k_all))
            rng.shuffle(block)
            seq += block
        for i in range(draws):
            out[i][axis] = (seq[i], k_all)
    return out


def region(strata: Optional[Strata], axis: str) -> Optional[Tuple[int, int]]:
    """``(k, K)`` of ``axis`` in a draw's strata, or ``None`` (not stratified: drawn from the whole range)."""
    return None if strata is None else strata.get(axis)


def describe(strata: Strata) -> str:
    """``world_size 3/4, noise_multiplier 4/4 ...``: one draw's regions (1-based), for its listing."""
    return ", ".join(f"{a} {k + 1}/{n}" for a, (k, n) in sorted(strata.items()))


__all__ = ["STRATA", "Strata", "int_count", "int_region", "float_region", "precision_modes", "batch_modes",
           "axis_counts", "plan", "region", "describe"]

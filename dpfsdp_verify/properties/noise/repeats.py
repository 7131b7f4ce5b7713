"""What a ``noise_calibration`` verdict says when noise values repeat: the sentences of a
``noise_exact.Repeat`` finding (what repeats where, and the cause it points to). Pure functions of
the finding; nothing is detected here.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

from .exact import Repeat

#: added to the cause of a repeat whose copy is negated
NEGATED_NOTE = (" (here negated: a sign flip cancels in the *sum* of the two releases as a copy does in their "
                "difference)")


def _shard_offset(r: Repeat) -> Tuple[str, str]:
    (ri, si, _, _), (ra, rb), (row_a, row_b) = r.a, r.ranks, r.rows
    return (f"rank {rb}'s shard of {r.tensor_a!r} carries, from its row {row_b}, the noise rank {ra}'s shard "
            f"carries from its row {row_a} (run {ri}, step {si})",
            "a shard offset: one noise tensor drawn whole on every rank (replicated) and sliced at the wrong rows "
            "-- e.g. at rank * local_rows, right only while every earlier shard has as many rows as this one "
            "(FSDP's last dim-0 shards are shorter) -- so two shards release the same noise rows and some rows of "
            "the full tensor none")


def _ranks_seeded_alike(r: Repeat) -> Tuple[str, str]:
    (ri, si, _, _), (ra, rb) = r.a, r.ranks
    same = "get the same noise, negated" if r.negated else "get the same noise"
    return (f"rank {ra}'s and rank {rb}'s shards of {r.tensor_a!r} {same} (run {ri}, step {si})",
            "ranks seeded alike (a seed from LOCAL_RANK, which repeats on every node, or from rank % 2) add the "
            "same noise to several shards")


def _tiled(r: Repeat) -> Tuple[str, str]:
    (_, si, _, oi), oj = r.a, r.b[3]
    return (f"the noise of {r.tensor_a!r} repeats within itself at step {si} (offsets {oi} and {oj}, "
            f"{abs(oj - oi)} apart)", "a short noise buffer tiled over the tensor")


def _one_buffer(r: Repeat) -> Tuple[str, str]:
    ri, si = r.a[0], r.a[1]
    same = "the same noise values, one negated," if r.negated else "the same noise values"
    return (f"{r.tensor_a!r} and {r.tensor_b!r} get {same} at step {si} (run {ri}): one noise buffer sliced for "
            "every tensor", "different tensors must get independent noise")


def _identical(r: Repeat) -> str:
    return "is negated" if r.negated else "is identical"


def _across_steps(r: Repeat) -> Tuple[str, str]:
    ri, si, sj = r.a[0], r.a[1], r.b[1]
    lag = abs(sj - si)
    hit_t, tensors, hit_s, steps = r.extent or (1, 1, 1, 1)
    if hit_t < tensors or (lag == 1 and hit_s < steps):  # some tensors (or steps) only: not a re-seeded generator
        cause = (f"noise reused for some releases only: {hit_t} of {tensors} tensor(s) repeat an earlier step's noise, "
                 f"at {hit_s} of {steps} step(s) of the run (a cache or buffer of noise drawn once and released "
                 "again; a generator re-seeded every step would repeat every tensor at every step)")
    elif lag == 1:
        cause = "the generator is re-seeded every step, so each release repeats the last one's noise"
    else:
        cause = (f"a pool of {lag} noise vectors reused in turn: the releases at steps k and k+{lag} carry the same "
                 "noise")
    return (f"the noise on {r.tensor_a!r} {_identical(r)} at steps {min(si, sj)} and {max(si, sj)} (lag {lag}, "
            f"run {ri})", cause)


def _shifted(r: Repeat) -> Tuple[str, str]:
    (ri, si, _, _), (rj, sj, _, _), (seed_i, seed_j) = r.a, r.b, r.seeds or (None, None)
    cause = ("the generator is seeded from noise_seed + step: jobs whose noise seeds differ by d release the same "
             "noise d steps apart" if r.kind == "seed_plus_step" else
             "noise reused across training jobs with different noise seeds, shifted in steps")
    return (f"the noise on {r.tensor_a!r} at step {si} of run {ri} (noise seed {seed_i}) {_identical(r)} to the "
            f"noise at step {sj} of run {rj} (noise seed {seed_j})", cause)


def _rank_seeds(r: Repeat) -> Tuple[str, str]:
    (ri, si, _, _), (rj, sj, _, _), (ra, rb) = r.a, r.b, r.ranks
    what = (f"rank {ra}'s shard of {r.tensor_a!r} at step {si} of run {ri}"
            + (f" (noise seed {r.seeds[0]})" if r.seeds is not None else "")
            + f" carries the noise rank {rb}'s shard carries at step {sj} of run {rj}"
            + (f" (noise seed {r.seeds[1]})" if r.seeds is not None else ""))
    if r.kind == "rank_seed_plus_rank" and r.seeds is not None:
        d = ra - rb
        return what, (f"the ranks' noise seeds overlap across training jobs: rank r under noise seed s {d:+d} draws "
                      f"what rank r {d:+d} draws under seed s (e.g. a generator seeded noise_seed + rank: rank {ra} "
                      f"of seed {r.seeds[0]} is rank {rb} of seed {r.seeds[1]}), so jobs with nearby seeds release "
                      "the same noise on different ranks")
    return what, ("the ranks' noise seeds overlap across training jobs: one rank's stream under one noise seed is "
                  "another rank's under another")


def _seed_ignored(r: Repeat) -> Tuple[str, str]:
    (ri, si, _, _), (rj, sj, _, _) = r.a, r.b
    return (f"the noise on {r.tensor_a!r} (step {si}) and on {r.tensor_b!r} (step {sj}) {_identical(r)} in two runs "
            f"with different noise seeds (runs {ri} and {rj})",
            "the target ignores the noise seed and draws the same noise every time")


def _reused(r: Repeat) -> Tuple[str, str]:
    (ri, si, _, _), sj = r.a, r.b[1]
    return (f"the noise of {r.tensor_a!r} at step {si} reappears on {r.tensor_b!r} at step {sj} (run {ri})",
            "noise values reused across releases")


WORDS: Dict[str, Callable[[Repeat], Tuple[str, str]]] = {
    "shard_offset": _shard_offset, "ranks_seeded_alike": _ranks_seeded_alike, "tiled": _tiled,
    "one_buffer": _one_buffer, "across_steps": _across_steps, "seed_plus_step": _shifted,
    "shifted_across_runs": _shifted, "rank_seed_plus_rank": _rank_seeds, "rank_seeds_overlap": _rank_seeds,
    "seed_ignored": _seed_ignored, "reused": _reused}


def repeat_words(r: Repeat) -> Tuple[str, str]:
    """``(what repeats where, its cause)`` of a repeat (the cause noting a negated copy)."""
    what, cause = WORDS[r.kind](r)
    return what, cause + (NEGATED_NOTE if r.negated else "")


def repeat_message(r: Repeat, where: str) -> str:
    """The ``dependent_noise`` verdict's message of a repeat found in the releases ``where`` describes."""
    what, cause = repeat_words(r)
    return (f"PRIVACY VIOLATION: {what} {where}: {cause}. Noise must be fresh for every coordinate of every "
            "release; repeated noise cancels in the difference of two releases.")


__all__ = ["NEGATED_NOTE", "WORDS", "repeat_words", "repeat_message"]

"""The exact noise checks of ``noise_calibration`` (no statistics: each is a fact of the released
values, never a false alarm): the noise of a release is its gradient minus the noise-0 run's
(``noise_differences``); a coordinate whose noise is exactly 0 in every draw (``silent_shard``) or
in any one draw (``unnoised_in_some_draw``); the same ``WINDOW`` noise values (quantised far below
the noise's scale, a sign flip included) in two places -- shards, tensors, steps, runs (``repeated_noise``,
worded with its most telling cause); float32 noise with bfloat16's resolution (``bf16_fraction``);
a noisy run that sampled other batches than its noise-0 twin (``resampled_run``).

DP meaning: a coordinate released without noise, or noise that repeats, is released without
privacy: repeated noise cancels in the difference of two releases.
"""

from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Set, Tuple, cast

from ...lazy import torch

from ...targets import RunSpec
from .stats import shard_sizes, shards


#: consecutive values that make a repetition (a chance match of 4 quantised Gaussians is ~1e-25)
WINDOW = 4


def noise_differences(outputs) -> List[List[Dict[str, torch.Tensor]]]:
    """``noise[run][step][name]``: each noisy run's released gradient minus the noise-0 run's."""
    clean = outputs[0][0].steps
    return [[{n: (s.gradient[n] - c.gradient[n]).to(torch.float64) for n in c.gradient}
             for s, c in zip(run[0].steps, clean)] for run in outputs[1:]]


def repeat_quantum(spec: RunSpec, s: float) -> float:
    """Noise values closer than this are "the same value": far above the rounding of
    gradient(sigma) - gradient(0) in the spec's dtype, far below the noise's scale ``s``."""
    return s * max(2.0 ** -20, 2.0 ** 10 * torch.finfo(spec.torch_dtype).eps)


def noise_windows(noise, names, quantum: float):
    """Every ``WINDOW`` consecutive quantised values of every (run, step, tensor)'s noise:
    ``(keys [M, WINDOW] int64, owners [M, 4] = (run, step, tensor index, offset))``."""
    keys, owners = [], []
    for i, run in enumerate(noise):
        for k, step in enumerate(run):
            for t, n in enumerate(names):
                q = torch.round(step[n].reshape(-1) / quantum).to(torch.int64)
                w = min(WINDOW, q.numel())
                if w < 2:
                    continue
                win = q.unfold(0, w, 1)
                # a sign flip is a repeat: each window keyed with its first nonzero value made positive,
                # so a negated copy (cancelling in the *sum* of two releases) has the same key
                lead = torch.gather(win, 1, (win != 0).to(torch.int8).argmax(dim=1, keepdim=True))
                win = win * torch.where(lead < 0, -1, 1)
                if w < WINDOW:  # short tensors: pad with a value no window of a long one holds
                    win = torch.cat([win, torch.full((win.shape[0], WINDOW - w), -2 ** 62 - w)], dim=1)
                keys.append(win)
                off = torch.arange(win.shape[0])
                owners.append(torch.stack([torch.full_like(off, i), torch.full_like(off, k), torch.full_like(off, t),
                                           off], dim=1))
    return torch.cat(keys), torch.cat(owners)


class Repeat(NamedTuple):
    """A repetition of noise values (``repeated_noise``), worded by ``wording.noise_repeats``. ``a``
    and ``b``: the two windows as ``(run, step, tensor index, offset)``; ``kind`` the cause it points
    to: ``shard_offset`` (ranks/rows/shards), ``ranks_seeded_alike``, ``tiled`` (within one tensor),
    ``one_buffer`` (two tensors of one release), ``across_steps`` (one run), ``seed_plus_step`` /
    ``shifted_across_runs`` (other steps of runs with other seeds), ``rank_seed_plus_rank`` /
    ``rank_seeds_overlap`` (other ranks' shards of runs with other seeds), ``seed_ignored`` (runs
    with other seeds), ``reused`` (anything else). ``negated``: one copy is the other's negation."""
    kind: str
    a: Tuple[int, int, int, int]
    b: Tuple[int, int, int, int]
    tensor_a: str
    tensor_b: str
    ranks: Tuple[int, int] = (-1, -1)
    rows: Tuple[int, int] = (-1, -1)
    seeds: Optional[Tuple[int, int]] = None
    negated: bool = False
    #: ``across_steps`` only: ``(tensors whose noise repeats at some step of the run, tensors, steps whose
    #: noise repeats another step's, steps)`` -- every tensor at every step is a generator re-seeded each
    #: step; fewer is noise reused for some releases only (``across_steps_extent``)
    extent: Optional[Tuple[int, int, int, int]] = None


def repeated_pairs(keys, owners) -> List[Tuple[List[int], List[int]]]:
    """Each repeated window paired with the first window of its group, as two owners ``(run, step,
    tensor index, offset)``: earliest repeats first, at most 20,000 (a repeating target repeats
    everywhere, so the first pairs name it); ``[]`` if no window repeats."""
    _, inverse, counts = torch.unique(keys, dim=0, return_inverse=True, return_counts=True)
    dup = counts[inverse] > 1
    if not bool(dup.any()):
        return []
    idx = dup.nonzero().reshape(-1)
    # the windows of each repeated group in order (stable sort by group)
    order = idx[torch.sort(inverse[idx], stable=True).indices]
    groups = inverse[order]
    later = (groups[1:] == groups[:-1]).nonzero().reshape(-1) + 1
    later = later[torch.argsort(order[later])][:20_000]  # earliest repeats first (run, step, tensor, offset)
    starts = torch.searchsorted(groups, groups[later])
    return [(owners[order[a]].tolist(), owners[order[b]].tolist()) for a, b in zip(starts.tolist(), later.tolist())]


def shard_of(shape, offset: int, ws: int) -> int:
    """The rank whose dim-0 shard holds flat ``offset`` of a tensor of ``shape``."""
    row = offset // max(1, math.prod(shape[1:])) if len(shape) > 1 else offset
    starts, acc = [], 0
    for size in shard_sizes(shape[:1], ws):
        starts.append(acc)
        acc += size
    return max(r for r, s0 in enumerate(starts) if row >= s0)


def in_shard(shape, offset: int, ws: int) -> Tuple[int, int, int]:
    """``(rank, row within its shard, offset within its shard)`` of a flat offset of a tensor of ``shape``."""
    width = max(1, math.prod(shape[1:])) if len(shape) > 1 else 1
    r = shard_of(shape, offset, ws)
    start = sum(shard_sizes(shape[:1], ws)[:r]) * width
    return r, (offset - start) // width, offset - start


def _within_release(a, b, name: str, shape, ws: int) -> Tuple[float, Repeat]:
    """A repeat within one tensor of one release: across shards (at other places, or the same) or tiled."""
    oi, oj = a[3], b[3]
    if ws > 1 and shard_of(shape, oi, ws) != shard_of(shape, oj, ws):
        (ra, row_a, at_a), (rb, row_b, at_b) = in_shard(shape, oi, ws), in_shard(shape, oj, ws)
        if at_a != at_b:  # the same values at different places of the two shards
            return 0, Repeat("shard_offset", a, b, name, name, (ra, rb), (row_a, row_b))
        # after a shard offset (a tensor whose short shard repeats another shard's rows at the
        # same place looks seeded alike; one at another place says which it is)
        return 0.5, Repeat("ranks_seeded_alike", a, b, name, name, (ra, rb))
    return 4, Repeat("tiled", a, b, name, name)


def _classify(a, b, names, shapes, ws: int, seeds) -> Tuple[float, Repeat]:
    """The cause a repeat of window ``a`` at window ``b`` points to, with its rank (lower: more telling)."""
    (ri, si, ti, oi), (rj, sj, tj, oj) = a, b
    na, nb = names[ti], names[tj]
    pair = None if seeds is None else (seeds[ri], seeds[rj])
    if (ri, si, ti) == (rj, sj, tj):
        return _within_release(a, b, na, shapes[na], ws)
    if (ri, si) == (rj, sj):
        return 1, Repeat("one_buffer", a, b, na, nb)
    if ri == rj and ti == tj:
        return 2, Repeat("across_steps", a, b, na, nb)
    if ri != rj and si != sj and ti == tj and seeds is not None:
        kind = "seed_plus_step" if seeds[rj] - seeds[ri] == si - sj else "shifted_across_runs"
        return 2, Repeat(kind, a, b, na, nb, seeds=pair)
    if ri != rj and ws > 1 and ti == tj and shard_of(shapes[na], oi, ws) != shard_of(shapes[nb], oj, ws):
        # another rank's shard in another run: the ranks' seeds overlap across jobs, not a seed ignored
        ra, rb = shard_of(shapes[na], oi, ws), shard_of(shapes[nb], oj, ws)
        kind = ("rank_seed_plus_rank" if seeds is not None and seeds[rj] - seeds[ri] == ra - rb
                else "rank_seeds_overlap")
        return 2, Repeat(kind, a, b, na, nb, (ra, rb), seeds=pair)
    if ri != rj:
        return 3, Repeat("seed_ignored", a, b, na, nb)
    return 4, Repeat("reused", a, b, na, nb)


def _negated(noise, names, a, b) -> bool:
    """Whether window ``b`` holds window ``a``'s values negated."""
    (ri, si, ti, oi), (rj, sj, tj, oj) = a, b
    x = noise[ri][si][names[ti]].reshape(-1)[oi:oi + WINDOW]
    y = noise[rj][sj][names[tj]].reshape(-1)[oj:oj + WINDOW]
    return bool((x * y).sum() < 0)


def repeated_noise(noise, names, ws: int, quantum: float, seeds=None) -> Optional[Repeat]:
    """The most telling repetition of noise values (``wording.noise_repeats`` words it); ``None`` if
    none. ``seeds``: each noisy run's noise seed."""
    found = repeated_pairs(*noise_windows(noise, names, quantum))
    if not found:
        return None
    shapes = {n: noise[0][0][n].shape for n in names}
    (_, repeat), flipped = min(((_classify(tuple(a), tuple(b), names, shapes, ws, seeds), _negated(noise, names, a, b))
                                for a, b in found), key=lambda d: d[0][0])
    if repeat.kind == "across_steps":
        run = noise[repeat.a[0]]
        windowed = sum(run[0][n].numel() >= 2 for n in names)  # a 1-value tensor has no window (noise_windows)
        lag = abs(repeat.b[1] - repeat.a[1])
        repeat = repeat._replace(extent=across_steps_extent(found, repeat.a[0], windowed, len(run), lag))
    return repeat._replace(negated=flipped)


def across_steps_extent(found, run: int, tensors: int, steps: int, lag: int = 1) -> Tuple[int, int, int, int]:
    """``Repeat.extent`` of run ``run``: of its ``tensors``, how many hold noise repeated at another step of the
    run (any window of ``found``, the repeated pairs of ``repeated_pairs``; ``tensors`` counts those with a
    window), and of its steps that have a partner ``lag`` steps away (a pool of ``lag`` noise vectors reused
    in turn repeats each of them), how many repeat."""
    hit_tensors: Set[int] = set()
    hit_steps: Set[int] = set()
    for a, b in found:
        if a[0] == b[0] == run and a[2] == b[2] and a[1] != b[1]:
            hit_tensors.add(a[2])
            hit_steps.update((a[1], b[1]))
    partnered = {k for k in range(steps) if k + lag < steps or k - lag >= 0}
    return len(hit_tensors), tensors, len(hit_steps & partnered), len(partnered)


def unnoised_in_some_draw(runs, names, spec: RunSpec) -> Optional[Tuple[str, int, int, int, int, int]]:
    """The first tensor with coordinates released with exactly zero noise in some draw, as
    ``(tensor, unnoised coordinates, coordinates, draws with any, run, step)`` of the first such
    draw; ``None`` if none. Exact zero noise has probability 0 under a Gaussian: counted where the
    noise-0 gradient is 0 (the noisy value is then the noise itself, in any dtype) and everywhere
    in float64 (where rounding the noise away next to a gradient value is out of reach)."""
    clean = runs[0][0].steps
    exact_everywhere = spec.torch_dtype == torch.float64
    for n in names:
        hit, draws, first = None, 0, None
        for i, run in enumerate(runs[1:]):
            for k, (st, c) in enumerate(zip(run[0].steps, clean)):
                zero = st.gradient[n] == c.gradient[n]
                if not exact_everywhere:
                    zero &= c.gradient[n] == 0
                if bool(zero.any()):
                    hit = zero if hit is None else hit | zero
                    draws += 1
                    first = first or (i, k)
        if hit is not None:
            first_run, first_step = cast(Tuple[int, int], first)  # set with the first hit
            return n, int(hit.sum()), hit.numel(), draws, first_run, first_step
    return None


def unnoised_draws(runs, names, spec: RunSpec) -> List[Tuple[int, int]]:
    """Every ``(run, step)`` draw with a coordinate released with exactly zero noise (the criterion of
    ``unnoised_in_some_draw``), in order."""
    clean = runs[0][0].steps
    exact_everywhere = spec.torch_dtype == torch.float64
    found = []
    for i, run in enumerate(runs[1:]):
        for k, (st, c) in enumerate(zip(run[0].steps, clean)):
            for n in names:
                zero = st.gradient[n] == c.gradient[n]
                if not exact_everywhere:
                    zero &= c.gradient[n] == 0
                if bool(zero.any()):
                    found.append((i, k))
                    break
    return found


def empty_round_unnoised(runs, names, spec: RunSpec) -> Optional[Tuple[int, int, int, int, List[int]]]:
    """Whether the draws released without noise are exactly the ones a rank drew an empty local
    batch in: ``(unnoised draws, draws with an empty local batch, first run, first step, the ranks
    empty there)`` when every unnoised draw had a rank with an empty batch and every draw whose
    ranks all drew samples is noised; ``None`` otherwise. Then the noise scale depends on the batch
    (scaled by its norms or its size: zero when nothing was drawn), not on what it touched."""
    unnoised = unnoised_draws(runs, names, spec)
    if not unnoised:
        return None

    def empty_ranks(i, k):
        return [r for r, o in enumerate(runs[1 + i]) if k < len(o.steps) and not o.steps[k].indices]

    if not all(empty_ranks(i, k) for i, k in unnoised):
        return None
    empty = sum(1 for i, run in enumerate(runs[1:]) for k in range(len(run[0].steps)) if empty_ranks(i, k))
    i, k = unnoised[0]
    return len(unnoised), empty, i, k, empty_ranks(i, k)


def unnoised_message(unnoised, ws: int, where: str) -> str:
    name, k, numel, draws, run, step = unnoised
    return (f"PRIVACY VIOLATION: no noise on {k} of {numel} coordinates of {name!r} in {draws} release(s) (first: "
            f"step {step} of run {run}) {where}: those coordinates are released exactly (equal to the noise-0 "
            "run's gradient), which Gaussian noise does with probability 0. Noise only where the gradient is "
            "nonzero (e.g. only on the embedding rows of the tokens a batch used) reveals which rows the batch "
            "touched: membership released without noise.")


def silent_shard(stacked, names, ws: int) -> Optional[Tuple[str, int, int, int]]:
    """The first shard with coordinates whose noise is exactly 0 in every draw, as ``(tensor,
    rank, silent coordinates, coordinates)``; ``None`` if every coordinate got noise."""
    for n in names:
        for r, shard in enumerate(shards(stacked[n], ws)):
            silent = (shard == 0).reshape(shard.shape[0], -1).all(dim=0)
            if bool(silent.any()):
                return n, r, int(silent.sum()), silent.numel()
    return None


def bf16_fraction(runs, names) -> Optional[float]:
    """The fraction of the float32 noise values (computed in float32, as released) that
    bfloat16 represents exactly (low 16 bits of the float32 pattern zero); ``None`` if no value."""
    clean = runs[0][0].steps
    hits = total = 0
    for run in runs[1:]:
        for st, c in zip(run[0].steps, clean):
            for n in names:
                d = (st.gradient[n] - c.gradient[n]).to(torch.float32).reshape(-1)
                d = d[d != 0]
                hits += int(((d.view(torch.int32) & 0xFFFF) == 0).sum())
                total += d.numel()
    return hits / total if total else None


def resampled_run(runs) -> Optional[int]:
    """The first noisy run whose batches differ from the noise-0 run's (Poisson), or ``None``."""
    clean = [[st.indices for st in rank.steps] for rank in runs[0]]
    for i, run in enumerate(runs[1:]):
        if [[st.indices for st in rank.steps] for rank in run] != clean:
            return i
    return None



__all__ = ["WINDOW", "noise_differences", "repeat_quantum", "noise_windows", "Repeat", "repeated_pairs", "shard_of",
           "in_shard", "repeated_noise", "unnoised_in_some_draw",
           "unnoised_message", "unnoised_draws", "empty_round_unnoised", "silent_shard", "bf16_fraction",
           "resampled_run"]

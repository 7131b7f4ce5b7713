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
from typing import Dict, List, Optional, Tuple, cast

from ...lazy import torch

from ...targets import RunSpec
from .noise_stats import shard_sizes, shards


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


def repeated_noise(noise, names, ws: int, quantum: float, seeds=None) -> Optional[Tuple[str, str]]:
    """The most telling repetition of noise values, as ``(what, cause)``; ``None`` if none.
    ``seeds``: each noisy run's noise seed."""
    keys, owners = noise_windows(noise, names, quantum)
    _, inverse, counts = torch.unique(keys, dim=0, return_inverse=True, return_counts=True)
    dup = counts[inverse] > 1
    if not bool(dup.any()):
        return None
    # pair each repeated window with the first window of its group
    idx = dup.nonzero().reshape(-1)
    # the windows of each repeated group in order (stable sort by group): each window after its
    # group's first is paired with that first; a repeating target repeats everywhere, so the first
    # 20,000 pairs name it
    order = idx[torch.sort(inverse[idx], stable=True).indices]
    groups = inverse[order]
    later = (groups[1:] == groups[:-1]).nonzero().reshape(-1) + 1
    later = later[torch.argsort(order[later])][:20_000]  # earliest repeats first (run, step, tensor, offset)
    starts = torch.searchsorted(groups, groups[later])
    found = [(owners[order[a]].tolist(), owners[order[b]].tolist()) for a, b in zip(starts.tolist(), later.tolist())]
    shapes = {n: noise[0][0][n].shape for n in names}

    def shard_of(name, offset):
        shape = shapes[name]
        row = offset // max(1, math.prod(shape[1:])) if len(shape) > 1 else offset
        starts, acc = [], 0
        for size in shard_sizes(shape[:1], ws):
            starts.append(acc)
            acc += size
        return max(r for r, s0 in enumerate(starts) if row >= s0)

    def in_shard(name, offset):
        """``(rank, row within its shard, offset within its shard)`` of a flat offset of ``name``."""
        shape = shapes[name]
        width = max(1, math.prod(shape[1:])) if len(shape) > 1 else 1
        r = shard_of(name, offset)
        start = sum(shard_sizes(shape[:1], ws)[:r]) * width
        return r, (offset - start) // width, offset - start

    def describe(a, b):
        (ri, si, ti, oi), (rj, sj, tj, oj) = a, b
        na, nb = names[ti], names[tj]
        if (ri, si, ti) == (rj, sj, tj):
            if ws > 1 and shard_of(na, oi) != shard_of(na, oj):
                (ra, row_a, at_a), (rb, row_b, at_b) = in_shard(na, oi), in_shard(na, oj)
                if at_a != at_b:  # the same values at different places of the two shards
                    return 0, (f"rank {rb}'s shard of {na!r} carries, from its row {row_b}, the noise rank {ra}'s "
                               f"shard carries from its row {row_a} (run {ri}, step {si})",
                               "a shard offset: one noise tensor drawn whole on every rank (replicated) and sliced "
                               "at the wrong rows -- e.g. at rank * local_rows, right only while every earlier "
                               "shard has as many rows as this one (FSDP's last dim-0 shards are shorter) -- so two "
                               "shards release the same noise rows and some rows of the full tensor none")
                # after a shard offset (a tensor whose short shard repeats another shard's rows at the
                # same place looks seeded alike; one at another place says which it is)
                return 0.5, (f"rank {ra}'s and rank {rb}'s shards of {na!r} get the same noise (run {ri}, step {si})",
                           "ranks seeded alike (a seed from LOCAL_RANK, which repeats on every node, or from rank % "
                           "2) add the same noise to several shards")
            return 4, (f"the noise of {na!r} repeats within itself at step {si} (offsets {oi} and {oj}, "
                       f"{abs(oj - oi)} apart)",
                       "a short noise buffer tiled over the tensor")
        if (ri, si) == (rj, sj):
            return 1, (f"{na!r} and {nb!r} get the same noise values at step {si} (run {ri}): one noise buffer "
                       f"sliced for every tensor", "different tensors must get independent noise")
        if ri == rj and ti == tj:
            lag = abs(sj - si)
            cause = ("the generator is re-seeded every step, so each release repeats the last one's noise"
                     if lag == 1 else f"a pool of {lag} noise vectors reused in turn: the releases at steps k "
                     f"and k+{lag} carry the same noise")
            return 2, (f"the noise on {na!r} is identical at steps {min(si, sj)} and {max(si, sj)} (lag {lag}, run "
                       f"{ri})",
                       cause)
        if ri != rj and si != sj and ti == tj and seeds is not None:
            d_seed, d_step = seeds[rj] - seeds[ri], si - sj
            shifted = ("the generator is seeded from noise_seed + step: jobs whose noise seeds differ by d release "
                       "the same noise d steps apart" if d_seed == d_step else
                       "noise reused across training jobs with different noise seeds, shifted in steps")
            return 2, (f"the noise on {na!r} at step {si} of run {ri} (noise seed {seeds[ri]}) is identical to the "
                       f"noise at step {sj} of run {rj} (noise seed {seeds[rj]})", shifted)
        if ri != rj and ws > 1 and ti == tj and shard_of(na, oi) != shard_of(nb, oj):
            # another rank's shard in another run: the ranks' seeds overlap across jobs, not a seed ignored
            ra, rb = shard_of(na, oi), shard_of(nb, oj)
            what = (f"rank {ra}'s shard of {na!r} at step {si} of run {ri}"
                    + (f" (noise seed {seeds[ri]})" if seeds is not None else "")
                    + f" carries the noise rank {rb}'s shard carries at step {sj} of run {rj}"
                    + (f" (noise seed {seeds[rj]})" if seeds is not None else ""))
            if seeds is not None and seeds[rj] - seeds[ri] == ra - rb:
                d = ra - rb
                cause = (f"the ranks' noise seeds overlap across training jobs: rank r under noise seed s {d:+d} draws "
                         f"what rank r {d:+d} draws under seed s (e.g. a generator seeded noise_seed + rank: rank {ra} "
                         f"of seed {seeds[ri]} is rank {rb} of "
                         f"seed {seeds[rj]}), so jobs with nearby seeds release the same noise on different ranks")
            else:
                cause = ("the ranks' noise seeds overlap across training jobs: one rank's stream under one noise seed "
                         "is another rank's under another")
            return 2, (what, cause)
        if ri != rj:
            return 3, (f"the noise on {na!r} (step {si}) and on {nb!r} (step {sj}) is identical in two runs with "
                       f"different noise seeds (runs {ri} and {rj})",
                       "the target ignores the noise seed and draws the same noise every time")
        return 4, (f"the noise of {na!r} at step {si} reappears on {nb!r} at step {sj} (run {ri})",
                   "noise values reused across releases")

    def negated(a, b) -> bool:
        (ri, si, ti, oi), (rj, sj, tj, oj) = a, b
        x = noise[ri][si][names[ti]].reshape(-1)[oi:oi + WINDOW]
        y = noise[rj][sj][names[tj]].reshape(-1)[oj:oj + WINDOW]
        return bool((x * y).sum() < 0)

    (_, (what, cause)), flipped = min(((describe(a, b), negated(a, b)) for a, b in found), key=lambda d: d[0][0])
    if flipped:
        what = (what.replace("the same noise values", "the same noise values, one negated,")
                .replace("get the same noise (", "get the same noise, negated (").replace("is identical", "is negated"))
        cause += (" (here negated: a sign flip cancels in the *sum* of the two releases as a copy does in their "
                  "difference)")
    return what, cause


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



__all__ = ["WINDOW", "noise_differences", "repeat_quantum", "noise_windows", "repeated_noise", "unnoised_in_some_draw",
           "unnoised_message", "unnoised_draws", "empty_round_unnoised", "silent_shard", "bf16_fraction",
           "resampled_run"]

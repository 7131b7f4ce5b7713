"""checkpoint_resume: a DP run checkpointed after k of K steps and resumed in a fresh run is the run that was
never interrupted -- the same model, the same privacy accounting, and no randomness replayed.

DP meaning: users of DP under FSDP stop and resume from checkpoints. What the step after the
checkpoint depends on must survive it: the parameters and the optimizer state (else the released
model is not the one trained), the privacy accountant's step count (else the epsilon reported is
that of the steps since the resume only), the noise generator's state (a resumed generator that
starts its stream again adds to step k+j the very noise it added to step j: the difference of the
two releases cancels the noise, no privacy at all for what it was meant to hide), and the Poisson
sampler's state (replayed masks make the batches of steps k+j and j the same draw: the
subsampling amplification the accountant assumes for independent draws does not hold).

Each half runs in rank processes started for it (``Case.fresh_groups``: the ``save`` halves in one set,
the ``load`` halves in the next, then the uninterrupted runs), so nothing survives the resume but
the checkpoint (``RunSpec.resume_at``; the runner gives each run a temporary checkpoint directory).
One case per world size (mlp, split data, ``"mean"``), K = 4 steps resumed at k = 2 (options
``steps`` and ``resume_at``), four checks, every failing one named in the verdict (the first gives
the diagnosis):

* trajectory (fixed batches, noise 0, SGD momentum 0.9, C between the middle reference norms): the
  parameters after every step of the resumed run equal the uninterrupted run's and the float64
  reference's (``reference.dp_sgd_trajectory(momentum=...)``), to ``compare.tolerance`` --
  ``mismatch`` (the message says when the resumed steps follow momentum buffers restarted at k);
* step count: ``StepOutput.privacy_steps`` after step t is t + 1 in both halves --
  ``step_count_reset``; not reported: fail, not checkable;
* noise (fixed batches, noise multiplier 1, lr 0 so every step sees the same parameters; noise =
  released gradient minus that of a noise-0 run): no FSDP shard (dim-0 chunk per rank) of a
  tensor after the resume carries the noise of any step before it -- ``noise_replayed``. Equal
  means every coordinate within 1e-6 s (float32: 1e-3 s) of s = sigma C / D, on shards of >= 4
  coordinates: two independent draws are that close with probability < 1e-12 (float32), so the
  check is exact in effect (a replay is equal to rounding, ~1e-16 s);
* masks (Poisson sampling, q = 0.5 over 16 samples per rank unless the options say otherwise,
  epochs of int(1/q) steps, the options' first seeding or ``same``, so k = 2 is an epoch
  boundary): a rank's batches after the resume must not repeat its batches before it in order --
  ``mask_replayed`` when at one lag L at least ``min(2, pairs)`` post-resume steps t draw exactly
  the non-empty batch of step t - L. Two independent non-empty masks over a shard of n samples
  are equal with probability p = (q^2 + (1-q)^2)^n - (1-q)^(2n); the verdict states the bound
  ``sum over lags of C(pairs_L, m) p^m`` times the ranks (1.5e-5^2 per rank at the defaults);
* across ranks (world size >= 2), after the resume: equal-shaped noise shards of different ranks
  are not equal at the same step (a pair equal before the resume is not flagged) --
  ``dependent_noise`` (false alarm < 1e-12 per pair, as above), nor -- compared stream against
  stream, for uneven shards that read one restored stream at different offsets -- does one rank's
  post-resume noise turn up value by value among another's (``_cross_rank_streams``: false alarm
  < 1e-12 per verdict); and no two ranks draw the same
  non-empty mask over their shards (sample i at shard position i // ws) at ``min(2, post-resume
  steps)`` steps -- ``correlated_sampling`` (bound ``C(ws, 2) C(steps, m) p^m``: 2.3e-10 at the
  defaults). Both catch ranks that all restore rank 0's random state;
* the sampler continues (Poisson, ``same`` / ``per_rank`` seeding): the resumed run's batches after step k
  are those of the same run never interrupted (an eleventh run, in the last fresh group) -- a sampler
  that restores its state and then skips a mask (or repeats one) fails ``mismatch``, naming the shift.

The accountant's history and epsilon after the resume are the runner's check of every run
(``prechecks.accountant_history_problem``): a load half's history must hold the k restored steps and
the steps after them, no fewer (emptied, one short), no more (restored twice) -- ``accountant_mismatch``.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Dict, List, Optional, Tuple

from ...config.defaults import CLIP_EPSILON
from ...lazy import torch

from ...lazy import reference
from ...verdict import Verdict
from ..analysis.clipfit import spec_trajectory_at_own_epsilon, with_picked_clip
from ..analysis.compare import (fmt, max_rel_diff, processed_indices, reference_batch, reference_model, tensors_close,
                                tolerance,
                      trainable_names)
from ..engine.contract import Case, Outputs, Point, Property

#: K steps, resumed after k (options ``steps`` / ``resume_at``)
STEPS, RESUME_AT = 4, 2
#: SGD momentum of the trajectory check: its buffers are the optimizer state a checkpoint carries
MOMENTUM = 0.9
SIGMA, CLIP = 1.0, 1.0
#: the mask check's Poisson sampling unless the options name q / the dataset size
POISSON_RATE, POISSON_PER_RANK = 0.5, 16
#: the second mask run, resumed mid-epoch (int(1/q) = 3 steps per epoch; the first run's k = 2 at q = 0.5 is an
#: epoch boundary): a sampler state saved as of the epoch's start replays only at a mid-epoch resume. 24 samples
#: per rank keep its false-alarm bound at ~1e-12 (two masks equal with p = (5/9)^24 = 7.5e-7)
MID_EPOCH_RATE, MID_EPOCH_PER_RANK = 1 / 3, 24
#: equal noise: every coordinate within this fraction of the noise std (per dtype)
NOISE_EQUAL = {"float64": 1e-6, "float32": 1e-3}
#: shards smaller than this are not compared (their chance agreement is not negligible)
NOISE_MIN_NUMEL = 4
#: the stream-level cross-rank check's false-alarm bound per verdict (``shared_values_needed``)
STREAM_FALSE_ALARM = 1e-12
#: replayed masks: equal non-empty batches at one lag, at least this many (fewer where fewer pairs exist)
MASK_REPLAYS = 2


def check_params(params: Dict[str, Any]) -> None:
    """``ValueError`` for options the property cannot run (the CLI turns it into exit 2)."""
    steps, k = params.get("steps", STEPS), params.get("resume_at", RESUME_AT)
    for name, v in (("steps", steps), ("resume_at", k)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"checkpoint_resume: {name} must be an int, got {v!r}")
    if steps < 2:
        raise ValueError(f"checkpoint_resume: steps={steps} must be >= 2 (a step before the checkpoint and one after)")
    if not 1 <= k < steps:
        raise ValueError(f"checkpoint_resume: resume_at={k} must be in 1..{steps - 1} (the checkpoint is taken after "
                         "step k "
                         f"of steps={steps}, and at least one step must follow it)")


def _halves(spec, k: int, name: str):
    """The ``save`` and ``load`` halves of ``spec`` resumed at step ``k``."""
    return tuple(spec.with_(resume_at=k, phase=phase, checkpoint_dir=name) for phase in ("save", "load"))


def cases(point: Point):
    params = dict(point.options.params)
    check_params(params)
    steps, k = point.param("steps"), point.param("resume_at")
    ws = point.world_size
    base = point.spec(steps=steps, global_batch_size=4 * ws, lr=0.5, momentum=MOMENTUM)
    traj = with_picked_clip(base, planning=point.planning)
    noise = point.spec(steps=steps, global_batch_size=4 * ws, lr=0.0, max_grad_norm=CLIP, noise_multiplier=SIGMA,
                       noise_seed=point.seed_for("noise_run", ws))
    o = point.options
    q = o.sample_rate or POISSON_RATE
    poisson = point.spec(steps=steps, lr=0.5, sampling="poisson", sample_rate=q,
                         dataset_size=o.dataset_size or POISSON_PER_RANK * ws, seeding=(o.seedings or ("same",))[0],
                         sampling_seed=point.seed_for("poisson_run", ws))
    poisson = poisson.with_(epochs=-(-steps // poisson.steps_per_epoch))
    mid = point.spec(steps=steps, lr=0.5, sampling="poisson", sample_rate=MID_EPOCH_RATE,
                     dataset_size=MID_EPOCH_PER_RANK * ws, seeding=(o.seedings or ("same",))[0],
                     sampling_seed=point.seed_for("mid_epoch_run", ws))
    mid = mid.with_(epochs=-(-steps // mid.steps_per_epoch))
    k_mid = k if k % mid.steps_per_epoch else k - 1  # k - 1 >= 2 is then mid-epoch too
    (ts, tl), (ns, nl), (ps, pl) = (_halves(s, k, n) for s, n in zip((traj, noise, poisson),
                                                                     ("trajectory", "noise", "poisson")))
    ms, ml = _halves(mid, k_mid, "poisson-mid-epoch")
    specs = (ts, ns, ps, ms, tl, nl, pl, ml, traj, noise.with_(noise_multiplier=0.0), poisson)
    yield point.case(traj, specs, labels={"resume_at": k}, fresh_groups=2, fresh_jobs=(4, 7),
                     doing=f"{steps} DP steps checkpointed after {k} and resumed in fresh rank processes")


# -- the checks: each returns (diagnosis, message, evidence) or None ---------------------------------
def _trajectory(case: Case, save, load, full, k: int) -> Tuple[Optional[tuple], dict]:
    spec, ws = case.spec, case.world_size
    rtol, atol = tolerance(spec.dtype)
    steps = spec.steps
    batches = [reference_batch(spec, t).select(processed_indices(full, t, spec)) for t in range(steps)]
    # the reference at the target's own clip epsilon where it is one DP-SGD allows (clipfit.at_own_clip_epsilon)
    ref, eps = spec_trajectory_at_own_epsilon(spec, batches, full[0].steps[-1].parameters, rtol, atol,
                                              momentum=spec.momentum)
    for r in range(ws):
        resumed = [s.parameters for s in save[r].steps + load[r].steps]
        for t in range(steps):
            if not tensors_close(full[r].steps[t].parameters, ref.steps[t], rtol, atol):
                err, name = max_rel_diff(full[r].steps[t].parameters, ref.steps[t])
                return ("mismatch", f"the uninterrupted run already differs from the reference after step {t} "
                        f"(rank {r}: up to {fmt(err)} relative, {name!r}): the trajectory property judges that; the "
                        "resume cannot be judged against it", {}), {}
        for t in range(steps):
            for other, what in ((full[r].steps[t].parameters, "the uninterrupted run"), (ref.steps[t],
                                                                                         "the reference")):
                if tensors_close(resumed[t], other, rtol, atol):
                    continue
                err, name = max_rel_diff(resumed[t], other)
                when = (f"step {t}, after the resume at step {k}" if t >= k else f"step {t}, before the checkpoint")
                msg = (f"rank {r}: the resumed run's parameters after {when} differ from {what}'s by up to "
                       f"{fmt(err)} relative (worst {name!r}) at world_size={ws}")
                if t >= k and _restarted_momentum(spec, ref.steps[k - 1], batches[k:], resumed[k:], rtol, atol, eps):
                    msg += (f"; they equal the trajectory whose momentum buffers restart at step {k}: the optimizer "
                            "state was not restored from the checkpoint")
                elif t >= k:
                    msg += ": state the step after the checkpoint depends on did not survive it"
                return ("mismatch", msg + ". The released model is not the one the DP analysis describes.", {}), {}
    return None, {"max_grad_norm": spec.max_grad_norm, "momentum": spec.momentum, "clip_epsilon": eps}


def _restarted_momentum(spec, start: Dict[str, torch.Tensor], batches, resumed, rtol, atol,
                        clip_epsilon: float = CLIP_EPSILON) -> bool:
    """Whether the resumed steps are the reference restarted from ``start`` with fresh momentum buffers."""
    if not spec.momentum:
        return False
    model = copy.deepcopy(reference_model(spec))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    alt = reference.dp_sgd_trajectory(model, batches, lr=spec.lr, max_grad_norm=spec.max_grad_norm,
                                      reduction=spec.reduction, expected_batch_size=spec.expected_batch_size,
                                      momentum=spec.momentum, clip_epsilon=clip_epsilon)
    return all(tensors_close(got, want, rtol, atol) for got, want in zip(resumed, alt.steps))


def _step_count(case: Case, halves, k: int) -> Optional[tuple]:
    for label, (save, load) in halves:
        for r, (s_out, l_out) in enumerate(zip(save, load)):
            got = [s.privacy_steps for s in s_out.steps + l_out.steps]
            if any(g is None for g in got):
                return (None, f"not checkable on this target: it reports no privacy step count "
                        f"(StepOutput.privacy_steps) in the {label} run: a target declaring 'resume' reports the DP "
                        "steps its accounting has counted", {"privacy_steps": got})
            want = list(range(1, len(got) + 1))
            if got != want:
                return ("step_count_reset", f"rank {r}, {label} run resumed at step {k}: the privacy step count "
                        f"after each step is {got}, expected {want}; {_count_error(got, want, k)}.",
                        {"privacy_steps": got})
    return None


def _count_error(got: List[int], want: List[int], k: int) -> str:
    """How ``got`` (the counts after each step of a run resumed after ``k``) misses ``want``, in words:
    only a count that starts again below k + 1 at the resume is called a reset."""
    before, after = got[:k], got[k:]
    if before != want[:k]:
        return "already before the checkpoint it does not count one per DP step"
    if after == list(range(1, len(after) + 1)):
        return (f"after the resume it counts from 1 again: the accountant lost the {k} step(s) taken before the "
                f"checkpoint, so the epsilon it reports is that of {len(after)} step(s), not the run's {len(got)}")
    if after[0] == got[k - 1]:
        return (f"its count does not advance at the first step after the resume (it stays at {after[0]}): the "
                "resumed step is not counted, so the epsilon reported is too small")
    if after[0] < k + 1:
        return (f"after the resume it continues from {after[0] - 1}, not {k}: the accountant lost "
                f"{k + 1 - after[0]} of the {k} step(s) taken before the checkpoint")
    if after[0] > k + 1:
        return (f"after the resume it continues from {after[0] - 1}, not {k}: it counts steps that were not taken "
                "(an over-reported epsilon)")
    return "after the resume it does not count one per DP step"


def _released_noise(save, load, clean, noise_spec) -> Tuple[float, float, List[str], List[Dict[str, torch.Tensor]]]:
    """``(s, eps, names, noise)``: the noise std s = sigma C / D, the equality tolerance
    (``NOISE_EQUAL``), the trainable tensors, and each step's noise per tensor (released gradient
    minus the noise-0 run's, float64), the save half's steps then the load half's."""
    s = noise_spec.noise_multiplier * noise_spec.max_grad_norm / noise_spec.divisor
    eps = NOISE_EQUAL.get(noise_spec.dtype, 1e-3) * s
    names = [n for n in trainable_names(noise_spec) if n in clean[0].steps[0].gradient]
    released = [st.gradient for st in save[0].steps + load[0].steps]
    noise = [{n: (g[n] - c.gradient[n]).to(torch.float64) for n in names} for g, c in zip(released, clean[0].steps)]
    return s, eps, names, noise


def _noise(case: Case, save, load, clean, k: int, noise_spec) -> Tuple[Optional[tuple], dict]:
    ws = case.world_size
    s, eps, names, noise = _released_noise(save, load, clean, noise_spec)
    shards = [(n, j) for n in names for j, c in enumerate(torch.chunk(noise[0][n], ws, dim=0))
              if c.numel() >= NOISE_MIN_NUMEL]
    compared, replays = 0, []
    for t in range(k, len(noise)):
        for u in range(k):
            for n, j in shards:
                a = torch.chunk(noise[t][n], ws, dim=0)[j]
                b = torch.chunk(noise[u][n], ws, dim=0)[j]
                if a.abs().max() <= eps or b.abs().max() <= eps:
                    continue  # no noise there: noise_calibration's finding, not a replay
                compared += 1
                if (a - b).abs().max() <= eps:
                    replays.append((t, u, n, j))
    evidence = {"noise_shard_pairs_compared": compared, "noise_replays": [list(x) for x in replays[:20]]}
    if replays:
        steps = sorted({(t, u) for t, u, _, _ in replays})
        return ("noise_replayed", (
            f"PRIVACY VIOLATION: after the resume at step {k} the noise released repeats noise released before it: "
            + "; ".join(f"step {t} repeats step {u} on {sum(1 for x in replays if x[:2] == (t, u))} of {len(shards)} "
                        f"tensor shards" for t, u in steps[:4])
            + f" (world_size={ws}). The resumed noise generator started its stream again (its state is not in the "
            "checkpoint, and it was seeded as at the start): the difference of the two releases cancels the noise, "
            "so those steps' gradients are released without privacy."), evidence), evidence
    if not compared:
        return ("mismatch", f"no noise to compare at noise multiplier {noise_spec.noise_multiplier}: every shard's "
                "noise is 0 before or after the resume (noise_calibration judges missing noise)", evidence), evidence
    return None, evidence


def _cross_rank_noise(case: Case, save, load, clean, k: int, noise_spec) -> Optional[tuple]:
    """After the resume, shards of one tensor (dim-0 chunks: different ranks' draws; uneven ones
    compared over the shorter one's length) must not carry equal noise at the same step -- a pair is flagged only if it
    was distinct at every
    step before the resume (equal before is noise_calibration's finding, not the resume's). Equal
    as in ``_noise`` (every coordinate within ``NOISE_EQUAL`` s, >= ``NOISE_MIN_NUMEL``
    coordinates): false alarm < 1e-12 per pair."""
    ws = case.world_size
    if ws < 2:
        return None
    s, eps, names, noise = _released_noise(save, load, clean, noise_spec)

    def equal_pairs(t):
        out = set()
        for n in names:
            chunks = torch.chunk(noise[t][n], ws, dim=0)
            for i in range(len(chunks)):
                for j in range(i + 1, len(chunks)):
                    # uneven shards (rows not divisible by the world size): two ranks drawing from one
                    # restored state share the shorter draw's length, a prefix of the longer
                    m = min(chunks[i].numel(), chunks[j].numel())
                    a, b = chunks[i].reshape(-1)[:m], chunks[j].reshape(-1)[:m]
                    if m < NOISE_MIN_NUMEL or a.abs().max() <= eps:
                        continue
                    if (a - b).abs().max() <= eps:
                        out.add((n, i, j))
        return out

    before = set().union(*(equal_pairs(t) for t in range(k)))
    hits = [(t, x) for t in range(k, len(noise)) for x in sorted(equal_pairs(t) - before)]
    if not hits:
        return None
    t0 = hits[0][0]
    first = [x for t, x in hits if t == t0]
    return ("dependent_noise", (
        f"PRIVACY VIOLATION: after the resume at step {k} different ranks' noise shards are equal at the same step: "
        f"at step {t0}, " + ", ".join(f"{n!r} shards {i} and {j}" for n, i, j in first[:4])
        + f" ({len(hits)} equal shard pair(s) over steps {sorted({t for t, _ in hits})}, none equal before the resume; "
        f"world_size={ws}). The resumed ranks restored the same noise generator state (e.g. every rank loads rank "
        "0's): the shards then carry the same noise (the shorter one a prefix of the longer), so a coordinate's noise "
        "is known from another's "
        "and the noise is not independent across the update (a correct run shows this with probability < 1e-12 "
        "per pair)."), {"cross_rank_equal_noise": [[t, *x] for t, x in hits[:20]]})


def rank_streams(noise: List[Dict[str, torch.Tensor]], names: List[str], steps: range, ws: int
                 ) -> List[torch.Tensor]:
    """Each rank's noise over ``steps``, every value it drew in one flat tensor: its FSDP shard
    (dim-0 chunk) of each tensor, step after step."""
    out = []
    for r in range(ws):
        parts = [chunks[r].reshape(-1) for t in steps for n in names
                 for chunks in [torch.chunk(noise[t][n], ws, dim=0)] if r < len(chunks)]
        out.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64))
    return out


def shared_values(a: torch.Tensor, b: torch.Tensor, eps: float) -> int:
    """How many values of ``a`` lie within ``eps`` of some value of ``b`` (values within ``eps`` of 0,
    no noise there, left out on both sides)."""
    a, b = a[a.abs() > eps], b[b.abs() > eps]
    if not a.numel() or not b.numel():
        return 0
    b = torch.sort(b).values
    i = torch.searchsorted(b, a).clamp(1, max(1, b.numel() - 1))
    nearest = torch.minimum((b[i] - a).abs(), (b[(i - 1).clamp(min=0)] - a).abs())
    return int((nearest <= eps).sum())


def shared_values_needed(n_a: int, n_b: int, eps_over_s: float, pairs: int) -> Tuple[int, float]:
    """``(m, bound)``: the shared values (``shared_values``) that call two independent noise streams
    of ``n_a`` and ``n_b`` Gaussian values of std s dependent, and the probability that ``pairs``
    such independent pairs show that many somewhere. Given b, each value of a lies within eps of one
    of b's with probability at most ``p = n_b * 2 eps / (s sqrt(2 pi))`` (the density of N(0, s^2)
    is at most 1/(s sqrt(2 pi))), independently of a's other values: at least m of them with
    probability at most ``C(n_a, m) p^m``; m is the least (>= ``NOISE_MIN_NUMEL``) with ``pairs``
    times that below ``STREAM_FALSE_ALARM``."""
    p = min(1.0, n_b * 2 * eps_over_s / math.sqrt(2 * math.pi))
    m = NOISE_MIN_NUMEL
    while m < n_a and pairs * math.comb(n_a, m) * p ** m >= STREAM_FALSE_ALARM:
        m += 1
    return m, pairs * math.comb(n_a, m) * p ** m


def _cross_rank_streams(case: Case, save, load, clean, k: int, noise_spec) -> Tuple[Optional[tuple], dict]:
    """After the resume, no rank's noise values may turn up anywhere in another rank's (a
    stream-level comparison: ``_cross_rank_noise`` compares equal places of equal-shaped shards, which
    uneven shards defeat -- ranks that restored one generator state read its stream at different
    offsets). The count of one rank's post-resume values found (within ``NOISE_EQUAL`` s) among
    another's must stay below ``shared_values_needed``'s m, and is not flagged where the two ranks
    already shared that many before the resume (ranks seeded alike from the start are
    noise_calibration's finding, not the resume's)."""
    ws = case.world_size
    if ws < 2:
        return None, {}
    s, eps, names, noise = _released_noise(save, load, clean, noise_spec)
    after = rank_streams(noise, names, range(k, len(noise)), ws)
    before = rank_streams(noise, names, range(k), ws)
    pairs = [(i, j) for i in range(ws) for j in range(i + 1, ws)]
    n = max(x.numel() for x in after)
    m, bound = shared_values_needed(n, n, eps / s, len(pairs))
    hits = []
    for i, j in pairs:
        shared = shared_values(after[i], after[j], eps)
        if shared >= m and shared_values(before[i], before[j], eps) < m:
            hits.append((i, j, shared))
    evidence: Dict[str, Any] = {"cross_rank_stream_shared_needed": m, "cross_rank_stream_false_alarm_bound": bound}
    if not hits:
        return None, evidence
    evidence["cross_rank_stream_shared"] = [list(h) for h in hits[:20]]
    i, j, shared = hits[0]
    return ("dependent_noise", (
        f"PRIVACY VIOLATION: after the resume at step {k} different ranks draw their noise from one stream: "
        + ", ".join(f"{b} of rank {a}'s noise values turn up among rank {c}'s" for a, c, b in hits[:3])
        + f" (post-resume steps {k}-{len(noise) - 1}, {after[i].numel()} and {after[j].numel()} values; {m} "
        f"would be needed by chance with probability {bound:.2g}; fewer shared before the resume; "
        f"world_size={ws}). The resumed ranks restored the same noise generator state (e.g. every rank loads rank "
        "0's): with shards of unequal length they read it at different offsets, so no equal places coincide, "
        "but one rank's noise is known from another's and the noise is not independent across the update."),
        evidence), evidence


def mask_false_alarm(q: float, shard: int, pairs_per_lag: List[int], ranks: int) -> Tuple[int, float]:
    """``(m, bound)``: matches needed at one lag, and the probability that a correct sampler (fresh
    independent masks) shows that many equal non-empty masks at some lag on some rank."""
    p = (q * q + (1 - q) ** 2) ** shard - (1 - q) ** (2 * shard)
    m = min(MASK_REPLAYS, max(pairs_per_lag or [0]))
    if m < 1:
        return 0, 0.0
    return m, min(1.0, ranks * sum(math.comb(n, m) * p ** m for n in pairs_per_lag if n >= m))


def _cross_rank_masks(case: Case, save, load, k: int, spec) -> Tuple[Optional[tuple], dict]:
    """After the resume, two ranks must not draw the same mask over their shards: rank r's shard is
    ``r, r + ws, ...``, so sample i sits at position ``i // ws``; flagged when at least
    ``min(MASK_REPLAYS, post-resume steps)`` steps show equal non-empty position sets on one pair
    of ranks (positions beyond the smallest shard left out). False alarm: ``C(ws, 2) C(steps, m) p^m``
    with p the equal-non-empty-mask probability of ``mask_false_alarm`` over the smallest shard."""
    ws = case.world_size
    if ws < 2:
        return None, {}
    n = spec.dataset_size // ws
    post = len(load[0].steps)
    m = min(MASK_REPLAYS, post)
    p = (spec.sample_rate ** 2 + (1 - spec.sample_rate) ** 2) ** n - (1 - spec.sample_rate) ** (2 * n)
    bound = min(1.0, math.comb(ws, 2) * math.comb(post, m) * p ** m) if m else 0.0
    pos = [[sorted(i // ws for i in st.indices if i // ws < n) for st in load[r].steps] for r in range(ws)]
    evidence = {"cross_rank_masks_needed": m, "cross_rank_mask_false_alarm_bound": bound}
    for a in range(ws):
        for b in range(a + 1, ws):
            hits = [t for t in range(post) if pos[a][t] and pos[a][t] == pos[b][t]]
            if m and len(hits) >= m:
                steps = [k + t for t in hits]
                evidence.update({"ranks": [a, b], "equal_mask_steps": steps})
                return ("correlated_sampling", (
                    f"PRIVACY VIOLATION: after the resume at step {k} ranks {a} and {b} draw the same Poisson mask "
                    "over "
                    f"their shards at steps {steps} (shard positions {[pos[a][t] for t in hits]}; world_size={ws}): "
                    "the "
                    "resumed ranks restored the same sampler state (e.g. every rank loads rank 0's), so sample "
                    f"{b} + {ws}j is in the batch exactly when sample {a} + {ws}j is -- not the independent Poisson "
                    "subsampling the "
                    f"accountant assumes (a correct sampler shows this with probability <= {bound:.2g})."),
                    evidence), evidence
    return None, evidence


def _masks(case: Case, save, load, k: int, spec) -> Tuple[Optional[tuple], dict]:
    ws = case.world_size
    lags = range(1, len(save[0].steps) + len(load[0].steps))
    worst = None
    for r in range(ws):
        batches = [sorted(s.indices) for s in save[r].steps + load[r].steps]
        total = len(batches)
        for lag in lags:
            hits = [t for t in range(k, total) if 0 <= t - lag < k and batches[t] and batches[t] == batches[t - lag]]
            if worst is None or len(hits) > len(worst[2]):
                worst = (r, lag, hits, batches)
    pairs = [sum(1 for t in range(k, spec.nominal_steps) if 0 <= t - lag < k) for lag in lags]
    m, bound = mask_false_alarm(spec.sample_rate, spec.dataset_size // ws, pairs, ws)
    evidence: Dict[str, Any] = {"mask_replays_needed": m, "mask_false_alarm_bound": bound}
    if worst and m and len(worst[2]) >= m:
        r, lag, hits, batches = worst
        cause = ("The sampler's random state is not in the checkpoint and the resumed run seeds it as at the start"
                 if k % spec.steps_per_epoch == 0 else
                 f"The resume at step {k} is mid-epoch (epochs of int(1/q) = {spec.steps_per_epoch} steps) and the "
                 "resumed sampler starts from a state from before the checkpoint (the epoch's start state, or the "
                 f"seed), not where its stream was after step {k - 1}")
        evidence.update({"rank": r, "lag": lag, "replayed_steps": hits, "batches": batches})
        return ("mask_replayed", (
            f"PRIVACY VIOLATION: rank {r}'s Poisson sampler replays its masks after the resume at step {k}: steps "
            f"{hits} draw exactly the batches of steps {[t - lag for t in hits]} ({[batches[t] for t in hits]}) "
            f"at world_size={ws}. {cause}: those steps' batches are the same draw, not the independent Poisson "
            "subsamples the "
            f"accountant's amplification assumes (a correct sampler shows this with probability <= {bound:.2g})."),
            evidence), evidence
    return None, evidence


def _continues(case: Case, save, load, full, k: int, spec) -> Tuple[Optional[tuple], dict]:
    """Under a seeded sampler (``same`` / ``per_rank``) the resumed run's batches after step k are
    the uninterrupted run's (``full``: the same spec, never checkpointed): a sampler that restores
    its state and then draws a mask more (or fewer), or restores another state, takes other batches
    than the run that was never interrupted. Exact (no statistics); ``unseeded`` is not judged."""
    if spec.seeding == "unseeded":
        return None, {"sampler_continues": "not judged (unseeded)"}
    ws = case.world_size
    for r in range(ws):
        got = [sorted(s.indices) for s in load[r].steps]
        want = [sorted(s.indices) for s in full[r].steps[k:k + len(got)]]
        if got == want:
            continue
        t = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b) if len(got) == len(want) else 0
        whole = [sorted(s.indices) for s in full[r].steps]
        def overlap(d, got=got, whole=whole):  # the resumed batches against the uninterrupted run's d steps later
            pairs = [(got[j], whole[k + d + j]) for j in range(len(got)) if 0 <= k + d + j < len(whole)]
            return bool(pairs) and any(a for a, _ in pairs) and all(a == b for a, b in pairs)
        shifted = next((d for d in (1, 2, 3, -1) if overlap(d)), None)
        how = (f"they are the uninterrupted run's batches {shifted} step(s) {'later' if shifted > 0 else 'earlier'}: "
               f"the resumed sampler {'skips' if shifted > 0 else 'repeats'} {abs(shifted)} mask(s) at the resume"
               if shifted else "the resumed sampler does not continue the stream where the checkpoint left it")
        evidence = {"rank": r, "resumed_batches": got, "uninterrupted_batches": want}
        return ("mismatch", (
            f"rank {r}'s Poisson batches after the resume at step {k} are not the uninterrupted run's (same sampling "
            f"seed, {spec.seeding!r} seeding): step {k + t} draws {got[t] if t < len(got) else None} where the run "
            f"that was never interrupted draws {want[t] if t < len(want) else None}; {how} (world_size={ws}). The "
            "resumed run is not the run that was never interrupted: its sampler state did not survive the "
            "checkpoint exactly."), evidence), evidence
    return None, {"sampler_continues": True}


def judge(case: Case, runs: Outputs) -> Verdict:
    ts, ns, ps, ms, tl, nl, pl, ml, full, clean, pfull = runs[0]
    k = case.specs[0].resume_at
    evidence: Dict[str, Any]
    found, evidence = [], {"resume_at": k}
    traj, ev = _trajectory(case, ts, tl, full, k)
    evidence.update(ev)
    counted = _step_count(case, (("trajectory", (ts, tl)), ("noise", (ns, nl)), ("poisson", (ps, pl))), k)
    counted = counted or _step_count(case, (("mid-epoch poisson", (ms, ml)),), case.specs[3].resume_at)
    noise, ev = _noise(case, ns, nl, clean, k, case.specs[1])
    evidence.update(ev)
    masks, ev = _masks(case, ps, pl, k, case.specs[2])
    evidence.update(ev)
    mid_spec = case.specs[3]
    mid, ev = _masks(case, ms, ml, mid_spec.resume_at, mid_spec)
    evidence["mid_epoch"] = {"resume_at": mid_spec.resume_at, "sample_rate": mid_spec.sample_rate, **ev,
                             **(mid[2] if mid else {})}
    if mid and not masks:
        masks = mid[:2] + ({},)
    elif mid and masks:  # one finding: the same sampler state replays at both resumes
        masks = (masks[0], masks[1] + f" The mid-epoch resume at step {mid_spec.resume_at} (q = "
                 f"{mid_spec.sample_rate:.3g}) replays too.", masks[2])
    cross_noise = _cross_rank_noise(case, ns, nl, clean, k, case.specs[1])
    streams, ev = _cross_rank_streams(case, ns, nl, clean, k, case.specs[1])
    evidence.update(ev)
    cross_noise = cross_noise or streams
    cross_masks, ev = _cross_rank_masks(case, ps, pl, k, case.specs[2])
    evidence.update(ev)
    if not cross_masks:
        cross_masks, ev = _cross_rank_masks(case, ms, ml, mid_spec.resume_at, mid_spec)
        evidence["mid_epoch"].update(ev)
    continues, ev = _continues(case, ps, pl, pfull, k, case.specs[2])
    evidence.update(ev)
    if masks or cross_masks:  # replayed or shared masks already say why the batches differ: one finding
        continues = None
    found = [f for f in (traj, counted, noise, masks, cross_noise, cross_masks, continues) if f]
    for f in found:
        evidence.update(f[2])
    if found:
        return case.verdict("fail", found[0][0], " Also: ".join(f[1] for f in found), evidence)
    steps = case.spec.steps
    return case.verdict("pass", None, (
        f"{steps} DP steps checkpointed after {k} and resumed in fresh rank processes at world_size={case.world_size}: "
        "parameters after every step equal the uninterrupted run's and the reference's (momentum "
        f"{case.spec.momentum}), "
        f"the privacy step count continues at {k + 1} (and the accountant's history holds every step: the runner's "
        f"check of every run), the Poisson batches after the resume are the uninterrupted run's"
        f"{'' if case.specs[2].seeding != 'unseeded' else ' (not judged: unseeded)'}, no noise released after the "
        f"resume repeats earlier noise "
        f"({evidence['noise_shard_pairs_compared']} shard pairs compared) and the Poisson sampler replays no masks "
        f"(false-alarm bound {evidence['mask_false_alarm_bound']:.2g}; mid-epoch resume at step "
        f"{evidence['mid_epoch']['resume_at']}: {evidence['mid_epoch']['mask_false_alarm_bound']:.2g})"
        + ("" if case.world_size < 2 else
           f"; after the resume no two ranks' noise shards are equal, no rank's noise values turn up among another's "
           f"({evidence['cross_rank_stream_shared_needed']} would, false-alarm bound "
           f"{evidence['cross_rank_stream_false_alarm_bound']:.2g}) and no two ranks draw the same mask "
           f"(false-alarm bound {evidence['cross_rank_mask_false_alarm_bound']:.2g})")), evidence)


PROPERTY = Property(
    id="checkpoint_resume",
    meaning=("a run checkpointed after k steps and resumed in fresh processes trains the uninterrupted run's "
             "model, keeps counting privacy steps, and replays neither noise nor Poisson masks"),
    cases=cases, judge=judge, models=("mlp",), layouts=("split",), reductions=("mean",),
    diagnoses=("mismatch", "step_count_reset", "noise_replayed", "mask_replayed", "dependent_noise",
               "correlated_sampling"),
    params=(("steps", STEPS), ("resume_at", RESUME_AT)), samplings=None, check_params=check_params,
    false_alarm_rate=1e-9)


__all__ = ["STEPS", "RESUME_AT", "MOMENTUM", "SIGMA", "CLIP", "POISSON_RATE", "POISSON_PER_RANK", "MID_EPOCH_RATE",
           "MID_EPOCH_PER_RANK", "NOISE_EQUAL", "NOISE_MIN_NUMEL", "MASK_REPLAYS", "check_params", "cases",
           "mask_false_alarm", "judge", "PROPERTY"]

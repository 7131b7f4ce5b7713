"""At-scale hang risk of a DP data pipeline under Poisson sampling, computed without training.

DP-SGD's Poisson sampling under FSDP/DDP draws each rank's local batch over its own shard of the
dataset. A pipeline that *skips* an empty local batch (opacus' distributed sampler does) lets the
ranks take different numbers of steps, and with gradient accumulation a rank runs
``ceil(local / p)`` physical passes per step (an empty logical batch: one empty pass), so ranks
with different local batch sizes pair FSDP's collectives across steps. Either way a real job
hangs -- but only at scale: with expected local batch ``b = q N / ws`` a rank is empty with
probability ``(1-q)^{n_r} ~ e^-b`` per step, so at 512 ranks and ``b = 2`` some rank is empty in
almost every step, while the 2-rank test a developer runs almost never sees it.

``scale_report`` drives the target's own data pipeline (``Target.sample_batches`` for virtual
ranks; ``Target.sample_masks`` when the target has it, checked against ``sample_batches`` on a
subsample) for every rank of each world size, one independent epoch per trial, and computes per
world size: the empty-batch, divergence and pass-mismatch probabilities (Monte-Carlo, Wilson
intervals) beside their closed forms for independent ranks, the realised sampling rate per step
taken (what the DP accountant's ``q`` really is), and the cross-rank correlation of local batch
sizes (DP-SGD's analysis assumes every sample is drawn independently). The figures are plain
numbers in a dict; ``format_report`` words them.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, cast

import numpy as np
import torch

from ..errors import HintedError
from ..config.space import seed_for
from ..targets.base import RunSpec, Target

#: trials use sampling seeds this far apart, so ``seed + rank`` (per_rank seeding) never repeats
TRIAL_SEED_STRIDE = 1_000_003
#: 95% two-sided normal quantile (Wilson intervals, means)
Z95 = 1.959963984540054
#: (trial, rank) pairs per world size on which ``sample_masks`` is checked against ``sample_batches``
VERIFY_PAIRS = 24


class ScaleUsageError(HintedError):
    """Bad input to ``scale``: the message says what, ``hint`` how to fix it."""


@dataclass(frozen=True)
class ScaleConfig:
    dataset_size: int
    sample_rate: float
    world_sizes: Tuple[int, ...]
    physical_batch_size: Optional[int] = None
    seeding: str = "per_rank"
    steps: int = 1000
    seed: int = 0

    def validate(self) -> None:
        q, n = self.sample_rate, self.dataset_size
        if not (isinstance(q, (int, float)) and not isinstance(q, bool) and 0.0 < q <= 1.0):
            raise ScaleUsageError(f"--sample-rate must be in (0, 1], got {q!r}", "e.g. --sample-rate 0.01")
        if not (isinstance(n, int) and n >= 1):
            raise ScaleUsageError(f"--dataset-size must be a positive int, got {n!r}", "e.g. --dataset-size 102400")
        if not self.world_sizes or any(not isinstance(w, int) or isinstance(w, bool) or w < 1
                                       for w in self.world_sizes):
            raise ScaleUsageError(f"--world-sizes must be positive ints, got {self.world_sizes!r}",
                                  "e.g. --world-sizes 8,64,512,1024")
        if n < max(self.world_sizes):
            raise ScaleUsageError(f"--dataset-size {n} is smaller than world size {max(self.world_sizes)}: "
                                  "some rank would own no sample", "raise --dataset-size or drop that world size")
        if self.physical_batch_size is not None and not (
                isinstance(self.physical_batch_size, int) and self.physical_batch_size >= 1):
            raise ScaleUsageError(f"--physical-batch-size must be a positive int, got {self.physical_batch_size!r}",
                                  "the max_physical_batch_size given to BatchMemoryManager, e.g. 4")
        if self.seeding not in ("same", "per_rank", "unseeded"):
            raise ScaleUsageError(f"unknown --seeding {self.seeding!r}", "choose same, per_rank or unseeded")
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ScaleUsageError(f"--steps must be a positive int, got {self.steps!r}", "e.g. --steps 1000")
        if int(q * n) < 1:
            raise ScaleUsageError(f"expected batch int(q * N) = int({q} * {n}) is 0", "raise q or the dataset size")

    @property
    def steps_per_epoch(self) -> int:
        return int(1 / self.sample_rate)

    @property
    def trials(self) -> int:
        """Independent epochs drawn per world size: ``steps`` nominal steps, rounded up to epochs."""
        return max(1, -(-self.steps // self.steps_per_epoch))

    def spec(self, trial: int) -> RunSpec:
        return RunSpec(sampling="poisson", task="sample", sample_rate=float(self.sample_rate),
                       dataset_size=self.dataset_size, seeding=self.seeding, epochs=1, steps=0,
                       sampling_seed=self.seed + trial * TRIAL_SEED_STRIDE)


def supports_virtual_ranks(target: Target) -> Optional[str]:
    """``None`` if ``target.sample_batches`` takes a virtual rank; else one line saying what to implement."""
    method = getattr(type(target), "sample_batches", None)
    if method is None or method is Target.sample_batches:
        return (f"target {getattr(target, 'name', '?')!r} does not expose its data pipeline: implement "
                "Target.sample_batches(spec, rank=None, world_size=None) (the dataset indices each step draws "
                "on that rank)")
    params = inspect.signature(target.sample_batches).parameters
    if not ({"rank", "world_size"} <= set(params) or any(p.kind == p.VAR_KEYWORD for p in params.values())):
        return (f"target {getattr(target, 'name', '?')!r} implements the older sample_batches(spec); scale needs "
                "sample_batches(spec, rank=None, world_size=None) to draw a virtual rank's batches without a "
                "process group")
    return None


# -- drawing -----------------------------------------------------------------------------------


@dataclass
class Draws:
    """One world size's draws. ``taken[t][r]``: local batch sizes of the steps rank r took in trial
    t, in order; ``nominal``: ``[trials, steps_per_epoch, ws]`` local sizes at every nominal step
    (0 = empty), or ``None`` where the pipeline hid its skipped steps; ``source`` says which."""

    world_size: int
    taken: List[List[np.ndarray]]
    nominal: Optional[np.ndarray]
    source: str
    verified_pairs: int = 0
    #: why the target's ``sample_masks`` was not used (it differed from ``sample_batches``)
    refused: Optional[str] = None


def rank_sizes(dataset_size: int, world_size: int) -> np.ndarray:
    """``n_r``: samples each rank owns (a balanced split, the first ``N % ws`` ranks one more)."""
    n = np.full(world_size, dataset_size // world_size, dtype=np.int64)
    n[: dataset_size % world_size] += 1
    return n


def draw(target: Target, cfg: ScaleConfig, world_size: int) -> Draws:
    """Every rank's draws for ``cfg.trials`` independent epochs, from the target's own pipeline."""
    T, trials = cfg.steps_per_epoch, cfg.trials
    refused = None
    if hasattr(target, "sample_masks"):
        try:  # checked first: a fast path that does not replay the pipeline is never used
            verified = _verify_masks(target, cfg, world_size)
        except ScaleUsageError as e:
            refused = str(e)
    if hasattr(target, "sample_masks") and refused is None:
        nominal = np.zeros((trials, T, world_size), dtype=np.int64)
        taken = cast(List[List[np.ndarray]], [[None] * world_size for _ in range(trials)])  # all filled below
        specs = [cfg.spec(t) for t in range(trials)]
        for r in range(world_size):  # rank outer: a target may reuse its sampler across seeds
            for t in range(trials):
                _, masks, took = target.sample_masks(specs[t], r, world_size)
                sizes = masks.sum(1).numpy()
                nominal[t, :, r] = sizes
                taken[t][r] = sizes[took.numpy()]
        return Draws(world_size, taken, nominal, "sample_masks (checked against sample_batches)", verified)
    taken = [[np.array([len(b) for b in target.sample_batches(cfg.spec(t), rank=r, world_size=world_size)],
                       dtype=np.int64) for r in range(world_size)] for t in range(trials)]
    lock_step = all(len(s) == T for row in taken for s in row)
    # every rank took every nominal step: the steps are aligned, so the nominal sizes are seen
    seen = np.stack([np.stack(row, 1) for row in taken]) if lock_step else None
    return Draws(world_size, taken, seen, "sample_batches", refused=refused)


def _verify_masks(target: Target, cfg: ScaleConfig, world_size: int) -> int:
    """Check ``sample_masks`` against ``sample_batches`` (the pipeline as a user iterates it) on
    a spread of (trial, rank) pairs: identical indices, step by step. ``unseeded`` cannot be
    replayed (a fresh seed per call), so it is checked under ``per_rank``: the same generator
    calls in the same order, another seed. ``ScaleUsageError`` on any difference (the adapter's
    fast path is wrong: ``draw`` then iterates ``sample_batches`` instead and says why)."""
    rng = np.random.default_rng(seed_for(cfg.seed, "scale", "verify_masks", world_size))
    pairs = {(int(rng.integers(cfg.trials)), int(r)) for r in
             rng.choice(world_size, size=min(VERIFY_PAIRS, world_size), replace=False)}
    pairs |= {(0, 0), (cfg.trials - 1, world_size - 1)}
    for t, r in sorted(pairs):
        spec = cfg.spec(t)
        if spec.seeding == "unseeded":
            spec = spec.with_(seeding="per_rank")
        indices, masks, took = cast(Any, target).sample_masks(spec, r, world_size)  # optional: ``draw`` checked
        replay = [indices[m].tolist() for m, k in zip(masks, took) if k]
        real = [[int(i) for i in b] for b in target.sample_batches(spec, rank=r, world_size=world_size)]
        if replay != real:
            raise ScaleUsageError(f"sample_masks differs from sample_batches at world size {world_size}, rank {r}, "
                                  f"epoch {t}: the fast path does not replay the target's sampler",
                                  "fix the target's sample_masks")
    return len(pairs)


# -- statistics (no wording) --------------------------------------------------------------------


def wilson(k: int, n: int) -> Tuple[float, float, float]:
    """``(estimate, low, high)``: the Wilson 95% interval of ``k`` successes in ``n`` trials."""
    if n == 0:
        return (float("nan"),) * 3
    p = k / n
    d = 1 + Z95 ** 2 / n
    c = (p + Z95 ** 2 / (2 * n)) / d
    h = Z95 * math.sqrt(p * (1 - p) / n + Z95 ** 2 / (4 * n * n)) / d
    # the exact endpoints at 0 and n successes (no rounding residue like 1e-20)
    return p, 0.0 if k == 0 else max(0.0, c - h), 1.0 if k == n else min(1.0, c + h)


def mean_ci(x: np.ndarray) -> Tuple[float, float, float, int]:
    x = np.asarray(x, dtype=np.float64)
    if len(x) == 0:
        return float("nan"), float("nan"), float("nan"), 0
    m = float(x.mean())
    h = Z95 * float(x.std(ddof=1)) / math.sqrt(len(x)) if len(x) > 1 else float("inf")
    return m, m - h, m + h, len(x)


def _binom_logpmf(n: int, p: float, k: np.ndarray) -> np.ndarray:
    k = np.asarray(k, dtype=np.float64)
    if p >= 1.0:
        return np.where(k == n, 0.0, -np.inf)
    lg = np.vectorize(math.lgamma)
    return lg(n + 1) - lg(k + 1) - lg(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)


def _groups(n_r: np.ndarray) -> List[Tuple[int, int]]:
    """``[(n, how many ranks own n samples)]``: at most two groups (balanced split)."""
    values, counts = np.unique(n_r, return_counts=True)
    return [(int(v), int(c)) for v, c in zip(values, counts)]


def _p_all_equal(dists: List[Tuple[np.ndarray, int]]) -> float:
    """P(every rank's value is the same) for independent ranks; ``dists``: (pmf over a common
    support, number of ranks with that pmf)."""
    with np.errstate(divide="ignore"):
        log = sum(c * np.log(np.clip(pmf, 0.0, None)) for pmf, c in dists)
    return float(np.exp(log).sum())


def closed_forms(cfg: ScaleConfig, world_size: int, skips: bool) -> Dict[str, Optional[float]]:
    """Closed forms for independent ranks (``per_rank``/``unseeded`` seeding): ``skips`` says
    whether the pipeline skips an empty local batch (the model its step counts follow)."""
    q, N, T, p = cfg.sample_rate, cfg.dataset_size, cfg.steps_per_epoch, cfg.physical_batch_size
    groups = _groups(rank_sizes(N, world_size))
    empty = {n: (1.0 - q) ** n for n, _ in groups}           # P(rank owning n samples draws nothing)
    p_some = 1.0 - math.prod((1.0 - empty[n]) ** c for n, c in groups)
    p_all = math.prod(empty[n] ** c for n, c in groups)
    out: Dict[str, Optional[float]] = {
        "rank_empty": float(sum(empty[n] * c for n, c in groups) / world_size),
        "some_rank_empty": p_some,
    }
    k = np.arange(T + 1)
    if skips:
        # a rank's steps per epoch: Binomial(T, 1 - (1-q)^{n_r}); they diverge unless all equal
        out["diverge"] = 1.0 - _p_all_equal([(np.exp(_binom_logpmf(T, 1.0 - empty[n], k)), c) for n, c in groups])
        # the step sequences first misalign at the first nominal step where some, not all, ranks are empty
        m = p_some - p_all
        out["first_divergence_step"] = (None if m <= 0 else
                                        float(sum(j * m * (1 - m) ** (j - 1) for j in range(1, T + 1))
                                              / (1 - (1 - m) ** T)))
        out["rate_per_step_taken"] = float(sum(c * n * q / (1.0 - empty[n]) for n, c in groups) / N)
    else:
        out["diverge"] = 0.0
        out["first_divergence_step"] = None
        out["rate_per_step_taken"] = float(q)
    if p:
        nmax = max(n for n, _ in groups)
        top = max(1, -(-nmax // p))
        dists = []
        for n, c in groups:
            sizes = np.arange(n + 1)
            pmf = np.exp(_binom_logpmf(n, q, sizes))
            passes = np.maximum(1, -(-sizes // p))
            if skips:  # a step is taken only when its local batch is non-empty
                pmf = np.where(sizes == 0, 0.0, pmf) / max(1e-300, 1.0 - pmf[0])
            dists.append((np.bincount(passes, weights=pmf, minlength=top + 1)[: top + 1], c))
        out["passes_differ"] = 1.0 - _p_all_equal(dists)
    else:
        out["passes_differ"] = None
    return out


def _mean_pairwise_correlation(x: np.ndarray) -> Optional[float]:
    """Mean Pearson correlation over pairs of columns (ranks) of ``x`` [steps, ranks]; ranks whose
    sizes never vary are left out. ``None`` with fewer than 3 steps or 2 varying ranks."""
    if x.shape[0] < 3:
        return None
    sd = x.std(0)
    x = x[:, sd > 0]
    k = x.shape[1]
    if k < 2:
        return None
    z = (x - x.mean(0)) / x.std(0)
    s = z.sum(1)
    return float(((s * s).mean() - k) / (k * (k - 1)))


def world_size_figures(cfg: ScaleConfig, d: Draws) -> dict:
    """Every figure of one world size: Monte-Carlo beside closed form, as plain numbers."""
    ws, T, p = d.world_size, cfg.steps_per_epoch, cfg.physical_batch_size
    counts = np.array([[len(s) for s in row] for row in d.taken])          # [trials, ws]
    skips = bool((counts < T).any())
    cf = closed_forms(cfg, ws, skips)
    n_r = rank_sizes(cfg.dataset_size, ws)
    b = cfg.sample_rate * cfg.dataset_size / ws

    def prob(k: int, n: int, closed: Optional[float]) -> dict:
        if n == 0:  # no such step was taken (JSON has no NaN)
            return {"mc": None, "ci": None, "n": 0, "closed_form": closed, "agrees": None, "why": "no step to count"}
        est, lo, hi = wilson(k, n)
        return {"mc": est, "ci": [lo, hi], "n": n, "closed_form": closed,
                "agrees": None if closed is None or n == 0 else bool(lo - 1e-12 <= closed <= hi + 1e-12)}

    def mean(x: np.ndarray, closed: Optional[float], unit: float = 0.0) -> dict:
        """``unit``: an integer-valued figure (a step number) is judged within half a step of the
        interval too, so that a run where every trial gave the same step is not a zero-width CI."""
        m, lo, hi, n = mean_ci(x)
        lo, hi = lo - unit / 2, hi + unit / 2
        return {"mc": m if n else None, "ci": [lo, hi] if n > 1 else None, "n": n, "closed_form": closed,
                "agrees": None if closed is None or n < 2 else bool(lo <= closed <= hi)}

    out: Dict[str, Any]
    out = {"world_size": ws, "expected_local_batch": b, "rank_samples": sorted({int(v) for v in n_r}),
           "trials": cfg.trials, "steps_per_epoch": T, "source": d.source, "verified_pairs": d.verified_pairs,
           "skips_empty": skips, "nominal_steps_seen": d.nominal is not None, "fast_path_refused": d.refused}
    # each rank's empty-batch rate per nominal step: seen from the skip counts even when hidden
    empties = int((T - counts).sum()) if skips or d.nominal is None else int((d.nominal == 0).sum())
    out["rank_empty"] = prob(empties, counts.size * T, cf["rank_empty"])
    if d.nominal is not None:
        some = int((d.nominal == 0).any(2).sum())
        out["some_rank_empty"] = prob(some, cfg.trials * T, cf["some_rank_empty"])
    else:
        out["some_rank_empty"] = {"mc": None, "closed_form": cf["some_rank_empty"], "agrees": None,
                                  "why": "the pipeline skips empty steps without saying which"}
    diverged = (counts != counts[:, :1]).any(1)
    out["diverge"] = prob(int(diverged.sum()), cfg.trials, cf["diverge"])
    out["diverge"]["closed_form_if_skipping"] = closed_forms(cfg, ws, True)["diverge"]
    # the step at which a rank first runs out of steps (taken order): where FSDP waits forever
    out["hang_step"] = mean(counts.min(1)[diverged] + 1, None, unit=1.0)
    if skips and d.nominal is not None:
        partial = (d.nominal == 0).any(2) & (d.nominal > 0).any(2)              # [trials, T]
        first = np.array([int(np.argmax(r)) + 1 for r in partial if r.any()])
        out["first_divergence_step"] = mean(first, cf["first_divergence_step"], unit=1.0)
    else:
        out["first_divergence_step"] = {"mc": None, "closed_form": cf["first_divergence_step"], "agrees": None}
    # steps paired across ranks by order (what FSDP's collectives do): j < min_r K_r
    per_trial = [np.stack([s[: min(len(x) for x in row)] for s in row], 1) for row in d.taken]   # [K, ws]
    paired = np.concatenate(per_trial, 0) if per_trial else np.zeros((0, ws), dtype=np.int64)
    if p:
        passes = np.maximum(1, -(-paired // p))
        differ = int((passes != passes[:, :1]).any(1).sum())
        out["passes_differ"] = prob(differ, len(paired), cf["passes_differ"])
    else:
        out["passes_differ"] = None
    rate = paired.sum(1) / cfg.dataset_size
    out["rate_per_step_taken"] = mean(rate, cf["rate_per_step_taken"])
    out["rate_per_step_taken"]["q"] = cfg.sample_rate
    out["size_correlation"] = {"mc": _mean_pairwise_correlation(paired.astype(np.float64)),
                               "independent": 0.0, "noise": 1.0 / math.sqrt(max(1, len(paired)))}
    return out


def check_runnable(target: Target, cfg: ScaleConfig) -> None:
    """Before anything is drawn, ask the pipeline for one step on rank 0 of every world size: a
    configuration it refuses (opacus cannot run every ``q`` at every world size: it derives ``q =
    1/len(data_loader)``) is refused at once, naming every refused world size, and the rates the
    pipeline offers instead when it says (``rates`` on the exception, e.g. ``InexpressibleRate``)."""
    refused = []
    for ws in cfg.world_sizes:
        try:
            target.sample_batches(cfg.spec(0).with_(steps=1), rank=0, world_size=ws)
        except ValueError as e:
            refused.append((ws, e))
    if not refused:
        return
    ws, first = refused[0]
    others = [w for w, _ in refused[1:]]
    more = f" (also refused at world size(s) {', '.join(map(str, others))})" if others else ""
    rates = getattr(first, "rates", None)
    hint = (f"--sample-rate {' or '.join(f'{r:.6g}' for r in rates)} runs at world size {ws}" if rates
            else "pick --sample-rate/--dataset-size the pipeline can run")
    if others:
        hint += "; or drop the refused world sizes"
    raise ScaleUsageError(f"world size {ws}: {first}{more}", hint)


def scale_report(target: Target, cfg: ScaleConfig, target_ref: str = "") -> dict:
    """The whole report as plain data (documented in docs/scale.md)."""
    cfg.validate()
    missing = supports_virtual_ranks(target)
    if missing:
        raise ScaleUsageError(missing, "see docs/scale.md")
    import time

    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny draws: threading only costs
    try:
        check_runnable(target, cfg)
        for ws in cfg.world_sizes:
            t0 = time.perf_counter()
            try:
                d = draw(target, cfg, ws)
            except ValueError as e:  # the pipeline refuses this configuration (e.g. an unreachable q)
                raise ScaleUsageError(f"world size {ws}: {e}", "pick --sample-rate/--dataset-size the pipeline "
                                      "can run") from None
            row = world_size_figures(cfg, d)
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
    finally:
        torch.set_num_threads(threads)
    return {"target": {"ref": target_ref, "name": getattr(target, "name", "?"), "version": target.version()},
            "config": {"dataset_size": cfg.dataset_size, "sample_rate": cfg.sample_rate,
                       "physical_batch_size": cfg.physical_batch_size, "seeding": cfg.seeding,
                       "steps": cfg.steps, "seed": cfg.seed, "world_sizes": list(cfg.world_sizes)},
            "world_sizes": rows}


# -- wording ------------------------------------------------------------------------------------


def _fmt_p(f: Optional[dict], label: str) -> str:
    if not f:
        return f"  {label}: -"
    cf = f.get("closed_form")
    cf_s = "" if cf is None else f"; closed form {cf:.4g}"
    if f.get("mc") is None:
        return f"  {label}: not measured ({f.get('why', 'no such event')}){cf_s}"
    ci = f.get("ci")
    ci_s = f" [{ci[0]:.4g}, {ci[1]:.4g}]" if ci else ""
    agree = {True: " -- agrees within the interval", False: " -- DISAGREES with the closed form",
             None: ""}[f.get("agrees")]
    return f"  {label}: {f['mc']:.4g}{ci_s} (n={f['n']}){cf_s}{agree}"


def format_report(report: dict) -> str:
    c = report["config"]
    lines = [f"scale: target {report['target']['name']} {report['target']['version']}, N={c['dataset_size']}, "
             f"q={c['sample_rate']}, seeding={c['seeding']}"
             + (f", physical batch {c['physical_batch_size']}" if c["physical_batch_size"] else "")
             + f", {c['steps']} nominal steps per rank (seed {c['seed']})"]
    for r in report["world_sizes"]:
        lines.append(f"world size {r['world_size']}: expected local batch {r['expected_local_batch']:.3g}, "
                     f"{r['trials']} epoch(s) of {r['steps_per_epoch']} steps, "
                     + ("skips empty local batches" if r["skips_empty"] else "lock-step (never skips a step)")
                     + f", drawn by {r['source']}"
                     + (f" on {r['verified_pairs']} (epoch, rank) pairs" if r["verified_pairs"] else "")
                     + f", {r['seconds']:.1f} s")
        if r["fast_path_refused"]:
            lines.append(f"  the target's sample_masks was NOT used: {r['fast_path_refused']}")
        lines.append(_fmt_p(r["rank_empty"], "P(a rank's local batch is empty in a step)"))
        lines.append(_fmt_p(r["some_rank_empty"], "P(some rank's local batch is empty in a step)"))
        d = r["diverge"]
        lines.append(_fmt_p(d, "P(ranks' step counts diverge within an epoch: FSDP hangs)")
                     + ("" if r["skips_empty"]
                        else f" [if empty batches were skipped: {d['closed_form_if_skipping']:.4g}]"))
        if r["first_divergence_step"].get("mc") is not None:
            lines.append(_fmt_p(r["first_divergence_step"], "expected nominal step of the first divergence"))
        if r["hang_step"]["mc"] is not None:
            lines.append(_fmt_p(r["hang_step"], "step at which the first rank runs out (the hang)"))
        if r["passes_differ"] is not None:
            lines.append(_fmt_p(r["passes_differ"], "P(physical pass counts differ in a step: collectives pair "
                                                    "across steps)"))
        lines.append(_fmt_p(r["rate_per_step_taken"],
                            f"realised sampling rate per step taken (q = {c['sample_rate']})"))
        sc = r["size_correlation"]
        lines.append("  cross-rank correlation of local batch sizes: "
                     + ("-" if sc["mc"] is None else f"{sc['mc']:.3g}")
                     + f" (independent draws: 0 +- {sc['noise']:.2g})")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Risk vs world size (needs matplotlib: the ``plot`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["world_sizes"]
    ws = [r["world_size"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    series = [("some_rank_empty", "P(some rank empty in a step)"), ("diverge", "P(step counts diverge in an epoch)"),
              ("passes_differ", "P(physical passes differ in a step)")]
    for key, label in series:
        pts = [(w, r[key]) for w, r in zip(ws, rows) if r.get(key) and r[key].get("mc") is not None]
        if not pts:
            continue
        x = [w for w, _ in pts]
        y = [f["mc"] for _, f in pts]
        err = [[f["mc"] - f["ci"][0] for _, f in pts], [f["ci"][1] - f["mc"] for _, f in pts]]
        line = ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=label)
        cf = [(w, f["closed_form"]) for w, f in pts if f.get("closed_form") is not None]
        if cf:
            ax.plot([w for w, _ in cf], [v for _, v in cf], ls="--", color=line[0].get_color(), alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("probability (dashed: closed form)")
    c = report["config"]
    ax.set_title(f"{report['target']['name']}: N={c['dataset_size']}, q={c['sample_rate']}, {c['seeding']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_world_sizes(text: str) -> Tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or any(w < 1 for w in out):
        raise ScaleUsageError(f"--world-sizes must be a comma list of positive ints, got {text!r}",
                              "e.g. --world-sizes 8,64,512,1024")
    return out


__all__ = ["ScaleConfig", "ScaleUsageError", "Draws", "check_runnable", "draw", "closed_forms", "format_report", "plot",
           "rank_sizes", "scale_report", "supports_virtual_ranks", "wilson", "world_size_figures",
           "parse_world_sizes"]

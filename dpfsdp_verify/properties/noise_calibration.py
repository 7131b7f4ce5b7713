"""noise_calibration: the added noise has std sigma*C/D on every coordinate of every tensor, is
fresh at every step and independent across shards.

DP meaning: the Gaussian mechanism's guarantee is for noise of exactly std sigma*C on the summed
clipped gradient (sigma*C/D after dividing by D), on every coordinate it releases. Less noise
(drawn on every rank and averaged, divided by N twice, missing on one tensor or on one rank's
shard) is a privacy violation. More noise (not divided by N) is a utility bug. Noise that repeats
(a generator re-seeded every step, ranks seeded alike, a seed that ignores the run) cancels in the
difference of two releases: no privacy at all for what it was meant to hide.

Measured on the target itself, with ``lr = 0`` so every step sees the same parameters: one run of
``steps`` steps with noise 0 and ``repeats`` runs with noise on and different noise seeds, same
data; each step's noise is gradient(sigma) - gradient(0) (signal bugs cancel; ``clipped_step``
judges those). Deterministic checks first (no statistics needed):

* a coordinate whose noise is exactly 0 in every draw (a tensor, or a rank's shard, left
  un-noised);
* the same noise at two steps of a run, or in two runs with different noise seeds.

Then two-sided tests, each at ``alpha / m`` (Bonferroni over the ``m`` tests of a verdict, and
``alpha`` = ``FAMILY_ALPHA`` shared out over the verdicts of the run, so a correct target raises a
false alarm in a whole gate run with probability <= ``FAMILY_ALPHA``):

* scale, per parameter tensor and per rank-owned shard (FSDP's dim-0 chunks):
  ``sum(noise^2) / s^2 ~ chi^2(n)`` for ``s = sigma*C/D``;
* mean, per tensor: ``sum(noise) / (s sqrt(n)) ~ N(0, 1)``;
* independence across shards (world_size > 1), across consecutive steps and across runs:
  Pearson correlation, Fisher z ~ N(0, 1).

The evidence states each tensor's power: the smallest std error (too little / too much noise)
detected with >= 99% probability. The number of draws is chosen so that it is <= 5% on every
tensor of >= 64 elements (``draws_for``).
"""

from __future__ import annotations

import math
from typing import Dict, List

import torch

from ..targets import RunSpec
from ..verdict import Verdict
from .compare import reference_model, trainable_names
from .contract import Case, Outputs, Point, Property
from .stats import chi2_two_sided_p, correlation_p, detectable_std_ratios, normal_two_sided_p

#: false-alarm probability of a correct target over every noise verdict of one run
FAMILY_ALPHA = 1e-3
SIGMA = 1.0
CLIP = 1.0
#: power target: a std error of this size on a tensor of >= POWER_MIN_NUMEL elements ...
POWER_STD_ERROR, POWER_MIN_NUMEL, POWER = 0.05, 64, 0.99
#: ... and the mlp dims that give the gate such a tensor: fc1.weight has 16 x 16 = 256 elements, so
#: ~45 draws reach the target (a 64-element tensor would need ~170: the ``draws`` option)
MLP_DIMS = (("d_in", 16), ("hidden", 16))
#: noise draws per run (steps at lr 0); runs with fresh noise seeds make up the rest of the draws
STEPS_PER_RUN = 16


def draws_for(numel: int, alpha: float) -> int:
    """Draws of a ``numel``-element tensor that detect a ``POWER_STD_ERROR`` std error on either
    side with probability >= ``POWER`` at level ``alpha``."""
    lo, hi = 1, 1
    while max(1 - detectable_std_ratios(numel * hi, alpha, POWER)[0],
              detectable_std_ratios(numel * hi, alpha, POWER)[1] - 1) > POWER_STD_ERROR:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        low, high = detectable_std_ratios(numel * mid, alpha, POWER)
        if max(1 - low, high - 1) > POWER_STD_ERROR:
            lo = mid
        else:
            hi = mid
    return hi


def _tests_per_verdict(shapes: Dict[str, torch.Size], ws: int) -> int:
    shards = sum(len(torch.chunk(torch.empty(s), ws, dim=0)) if len(s) else 1 for s in shapes.values())
    return shards + len(shapes) + (1 if ws > 1 else 0) + 2


def cases(point: Point):
    model_kwargs = MLP_DIMS if point.model == "mlp" else ()
    spec = point.spec(global_batch_size=4 * point.world_size, max_grad_norm=CLIP, noise_multiplier=SIGMA,
                      noise_seed=point.seed(point.param("noise_seed")), lr=0.0, steps=STEPS_PER_RUN, model_kwargs=model_kwargs)
    # frozen parameters are not released (the runner checks they get no noise at all)
    shapes = {n: p.shape for n, p in reference_model(spec).named_parameters() if p.requires_grad}
    alpha = FAMILY_ALPHA / point.matrix_size / _tests_per_verdict(shapes, point.world_size)
    big = [math.prod(s) for s in shapes.values() if math.prod(s) >= POWER_MIN_NUMEL]
    draws = point.param("draws") or max([draws_for(min(big), alpha)] if big else [4 * STEPS_PER_RUN])
    repeats = max(2, -(-draws // STEPS_PER_RUN))
    runs = [spec.with_(noise_seed=spec.noise_seed + 7919 * i) for i in range(repeats)]
    # a job of its own: its draws make it the longest job of a gate run, and its deadline is per job
    yield point.case(spec, [spec.with_(noise_multiplier=0.0)] + runs, doing="DP steps with noise",
                     facts={"alpha_per_test": alpha}, isolate=True)


def _noise(outputs) -> List[List[Dict[str, torch.Tensor]]]:
    """``noise[run][step][name]``: each noisy run's released gradient minus the noise-0 run's."""
    clean = outputs[0][0].steps
    return [[{n: (s.gradient[n] - c.gradient[n]).to(torch.float64) for n in c.gradient}
             for s, c in zip(run[0].steps, clean)] for run in outputs[1:]]


def _repeats(noise, names, ws: int) -> str:
    """The first exact repetition of a tensor's noise across shards, steps or runs, described; ""
    if none."""
    for n in names:
        step = noise[0][0][n]
        chunks = torch.chunk(step, ws, dim=0) if step.dim() else [step]
        for i in range(len(chunks)):
            for j in range(i + 1, len(chunks)):
                if chunks[i].shape == chunks[j].shape and torch.equal(chunks[i], chunks[j]):
                    return (f"the noise is not independent across shards: rank {i}'s and rank {j}'s shards of {n!r} "
                            "get identical noise (ranks seeded alike)")
    for i, run in enumerate(noise):
        for k in range(1, len(run)):
            for n in names:
                if torch.equal(run[k][n], run[k - 1][n]):
                    return (f"the noise on {n!r} is identical at steps {k - 1} and {k} (run {i}): the generator is "
                            "re-seeded every step, so each release repeats the last one's noise")
    for i in range(1, len(noise)):
        for n in names:
            if torch.equal(noise[i][0][n], noise[i - 1][0][n]):
                return (f"the noise on {n!r} is identical in two runs with different noise seeds (runs {i - 1} and "
                        f"{i}, step 0): the target ignores the noise seed and draws the same noise every time")
    return ""


def judge(case: Case, outputs: Outputs) -> Verdict:
    spec, ws, runs = case.spec, case.world_size, outputs[0]
    d = float(spec.global_batch_size) if spec.reduction == "mean" else 1.0
    s = spec.noise_multiplier * spec.max_grad_norm / d
    noise = _noise(runs)
    names = sorted(set(noise[0][0]) & set(trainable_names(spec)))
    n_draws = sum(len(run) for run in noise)
    stacked = {n: torch.stack([step[n] for run in noise for step in run]) for n in names}  # [draws, *shape]
    where = (f"at world_size={ws}, reduction={spec.reduction}, {spec.dtype} (sigma={spec.noise_multiplier}, "
             f"C={spec.max_grad_norm}, D={d:g}; {n_draws} draws of every coordinate)")
    evidence: Dict = {"expected_std": s, "draws": n_draws, "alpha_per_test": case.facts["alpha_per_test"]}
    for n in names:
        for r, shard in enumerate(_shards(stacked[n], ws)):
            silent = (shard == 0).reshape(shard.shape[0], -1).all(dim=0)
            if bool(silent.any()):
                return case.verdict("fail", "mismatch", (
                    f"PRIVACY VIOLATION: no noise at all on {int(silent.sum())} of {silent.numel()} coordinates of "
                    f"{n!r}" + (f" in rank {r}'s shard" if ws > 1 else "") + f" {where}: they are released exactly. "
                    "Every released coordinate needs its Gaussian noise."), evidence)
    repeated = _repeats(noise, names, ws)
    if repeated:
        return case.verdict("fail", "mismatch", f"PRIVACY VIOLATION: {repeated} {where}. Noise must be fresh for "
                            "every release; repeated noise cancels in the difference of two releases.", evidence)
    alpha = case.facts["alpha_per_test"]
    tensors, failures = {}, []
    for n in names:
        x = stacked[n]
        shard_stats = []
        for r, shard in enumerate(_shards(x, ws)):
            t, k = float((shard / s).pow(2).sum()), shard.numel()
            shard_stats.append((r, math.sqrt(t / k), chi2_two_sided_p(t, k), k))
        t_all, k_all = float((x / s).pow(2).sum()), x.numel()
        z_mean = float(x.sum()) / (s * math.sqrt(k_all))
        low, high = detectable_std_ratios(k_all, alpha, POWER)
        tensors[n] = {"coordinates": k_all // n_draws, "std_ratio": math.sqrt(t_all / k_all),
                      "shard_std_ratios": [round(ratio, 4) for _, ratio, _, _ in shard_stats],
                      "p_scale_min": min(p for _, _, p, _ in shard_stats), "z_mean": z_mean,
                      "detects_too_little": 1 - low, "detects_too_much": high - 1}
        for r, ratio, p, k in shard_stats:
            if not p >= alpha:
                failures.append(("scale", n, r, ratio, p))
        p_mean = normal_two_sided_p(z_mean)
        if not p_mean >= alpha:
            failures.append(("mean", n, None, z_mean, p_mean))
    evidence["tensors"] = tensors
    pooled = torch.cat([stacked[n].reshape(-1) for n in names])
    evidence["std_ratio"] = float(pooled.pow(2).mean().sqrt()) / s
    if failures:
        return case.verdict("fail", "mismatch", _scale_message(failures[0], ws, s, where, alpha), evidence)
    for test, (r_corr, p_corr, pairs) in _independence(noise, names, ws).items():
        evidence[f"{test}_correlation"] = r_corr
        if not p_corr >= alpha:
            what = {"shard": "across shards (ranks seeded alike add the same noise to every shard)",
                    "step": "between consecutive steps", "run": "between runs with different noise seeds"}[test]
            return case.verdict("fail", "mismatch", (
                f"PRIVACY VIOLATION: the noise is not independent {what} {where}: correlation {r_corr:.3f} over "
                f"{pairs} coordinate pairs (Fisher z test p={p_corr:.2g} < {alpha:.2g}). The mechanism assumes "
                "independent noise on every coordinate of every release."), evidence)
    big = {n: t for n, t in tensors.items() if t["coordinates"] >= POWER_MIN_NUMEL}
    power = (f"; detects a std error of {max(max(t['detects_too_little'], t['detects_too_much']) for t in big.values()):.1%}"
             f" or more on every tensor of >= {POWER_MIN_NUMEL} elements with {POWER:.0%} probability" if big else "")
    ratios = [t["std_ratio"] for t in tensors.values()]
    return case.verdict("pass", None, (
        f"noise std = sigma*C/D on all {len(names)} tensors {where}: std ratio per tensor "
        f"{min(ratios):.3f}..{max(ratios):.3f}, fresh at every step and run"
        f"{', independent across shards' if ws > 1 else ''}; "
        f"{_tests_per_verdict({n: stacked[n].shape[1:] for n in names}, ws)} two-sided tests at "
        f"{alpha:.2g} each{power}"), evidence)


def _shards(x: torch.Tensor, ws: int):
    """FSDP's dim-0 chunks of every draw of a tensor (``x``: ``[draws, *shape]``)."""
    return torch.chunk(x, ws, dim=1) if x.dim() > 1 else [x]


def _scale_message(failure, ws: int, s: float, where: str, alpha: float) -> str:
    test, name, rank, value, p = failure
    shard = f" in rank {rank}'s shard" if ws > 1 and rank is not None else ""
    if test == "mean":
        return (f"the noise on {name!r} is biased {where}: mean z={value:.3g} (p={p:.2g} < {alpha:.2g}); Gaussian DP "
                "noise has mean 0.")
    hint = ""
    for k, what in ((1 / math.sqrt(ws), "1/sqrt(N): noise drawn on every rank and averaged"),
                    (1 / ws, "1/N: noise divided by N once too often"),
                    (float(ws), "N: noise not divided by N although the ranks' gradients are averaged")):
        if ws > 1 and abs(value - k) < 0.15 * k:
            hint = f" The ratio is close to {what}."
    if value < 1:
        return (f"PRIVACY VIOLATION: too little noise on {name!r}{shard} {where}: measured std {value * s:.4g} = "
                f"{value:.3f} x the required sigma*C/D = {s:.4g} (two-sided chi-square p={p:.2g} < {alpha:.2g})."
                f"{hint} The released gradient is less private than the accounting states.")
    return (f"UTILITY LOSS: too much noise on {name!r}{shard} {where}: measured std {value * s:.4g} = {value:.3f} x "
            f"sigma*C/D = {s:.4g} (two-sided chi-square p={p:.2g} < {alpha:.2g}).{hint} Privacy holds, but the model "
            "trains on more noise than the guarantee needs.")


def _independence(noise, names, ws):
    """``{test: (r, p, pairs)}`` for shard pairs (ws > 1), consecutive steps, consecutive runs."""
    def pairs_of(get_a, get_b):
        xs, ys = [], []
        for a, b in zip(get_a, get_b):
            k = min(a.numel(), b.numel())
            xs.append(a.reshape(-1)[:k])
            ys.append(b.reshape(-1)[:k])
        x, y = torch.cat(xs), torch.cat(ys)
        r, p = correlation_p(x, y)
        return r, p, x.numel()

    out = {}
    draws = [step for run in noise for step in run]
    if ws > 1:
        a, b = [], []
        for step in draws:
            for n in names:
                if step[n].dim() == 0:
                    continue
                chunks = torch.chunk(step[n], ws, dim=0)
                for i in range(len(chunks)):
                    for j in range(i + 1, len(chunks)):
                        a.append(chunks[i])
                        b.append(chunks[j])
        if a:
            out["shard"] = pairs_of(a, b)
    out["step"] = pairs_of([run[k][n] for run in noise for k in range(1, len(run)) for n in names],
                           [run[k - 1][n] for run in noise for k in range(1, len(run)) for n in names])
    out["run"] = pairs_of([noise[i][k][n] for i in range(1, len(noise)) for k in range(len(noise[i])) for n in names],
                          [noise[i - 1][k][n] for i in range(1, len(noise)) for k in range(len(noise[i])) for n in names])
    return out


PROPERTY = Property(
    id="noise_calibration",
    meaning=("the Gaussian noise has std sigma*C/D on every coordinate of every tensor (less: privacy violation; "
             "more: utility loss), fresh at every step and independent across shards"),
    cases=cases, judge=judge, models=("mlp",), layouts=("split",), reductions=("mean", "sum"),
    params=(("noise_seed", RunSpec.noise_seed), ("draws", None)), false_alarm_rate=FAMILY_ALPHA)

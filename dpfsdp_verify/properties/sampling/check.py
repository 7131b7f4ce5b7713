"""sampling_accounting: the sampling the privacy accountant assumes is the sampling that happens.

DP meaning: opacus' accountant (RDP / PRV) is told one number per step, the sample rate q, and
assumes *Poisson* subsampling: in every step each sample of the dataset is in the batch
independently with probability q, and every rank takes the same steps. A sampler whose inclusion
rate is not q (e.g. q computed from a rank's local loader instead of the global dataset: q times
the world size), whose draws are correlated (ranks seeded identically draw identical masks;
samples not independent within a step; the same mask reused across steps), or whose ranks take
different numbers of steps (each rank skips its own empty local batches: a hang under FSDP)
releases a mechanism the accountant's epsilon does not describe.

No training: the target's data pipeline is driven through ``Target.sample_batches`` (optional
in the target contract: a target without it gets a ``fail`` saying so), built exactly as its training run
builds it, for thousands of steps (param ``draws``, default 2000). Cases, per world size: a
dataset the world size divides (``N = 8 * ws``, q = 1/8) and, at ``ws > 1``, one it does not
(``N = 8 * ws + 1``, q = 1/9) -- q as opacus derives it for a ``DistributedSampler`` with one
sample per local batch -- under each seeding policy (``same``, ``per_rank``, ``unseeded``).

Checks, in this order (the first that fails names the diagnosis; every p-value is in the
evidence):

1. every rank took the same number of steps: else ``step_divergence`` (deterministic);
2. ``correlated_sampling``: for each pair of ranks, the correlation of their local batch sizes
   over steps (Fisher z); the dispersion of the global batch size around its mean, ``sum_t (B_t -
   mean B)^2 / (N p (1-p))`` at the observed rate p, against chi^2_{T-1} two-sided (samples
   correlated within a step inflate it, fixed batch sizes deflate it; measured at the observed
   rate so that a wrong rate is not read as correlation). Before the dispersion test (whose
   distribution it changes): fewer steps taken than the nominal ``epochs * int(1/q)`` is
   ``wrong_sample_rate`` (steps with an empty batch skipped: deterministic). Then three tests of
   independence *across steps* (``across_steps``), at every lag L = 1..T/2 (1000 at 2000 draws):

   * ``batch_size_lags``: the lag-L autocovariance of the global batch size, strongest lag,
     Bonferroni over the T/2 lags (one step's draws steering another step's batch);
   * ``membership_lags``: the same on *membership*: for each sample its 0/1 inclusion series,
     centred at its own rate, lag-L autocovariances pooled over the samples. z_L estimates
     (P(in t+L | in t) - q) / (1 - q) * sqrt(N (T-L)); the sentence names the strongest lag and
     its conditional rate against q. This sees what batch sizes cannot: a mask reused from L steps
     back, or last step's members preferred while batch sizes stay exactly Binomial(N, q);
   * ``membership_portmanteau``: ``sum_{L <= 32} z_L^2`` against chi^2_32 (upper tail): dependence
     spread thinly over many short lags.

   The lag tests' p-values carry Cramer's skewness correction (``stats.skewed_normal_two_sided_p``:
   a sum of products of 0/1 indicators is right-skewed, and the Bonferroni split over 1000 lags
   reads the normal tail at z ~ 5.7, where the plain normal tail is ~3.5x too light). Measured
   (``benchmarks/sampling_lags.py``, docs/sampling.md) on 20,000 independent Bernoulli(q) null
   matrices per gate shape (N = 8, 16, 17; q = 1/8, 1/9; T = 2000), each of the three tests
   rejects at its nominal level or below, within sampling error, from 0.1 down to 1e-4. Power,
   measured at the property's per-test level: a sampler that reuses the mask of two steps back
   with probability 0.3, or keeps P(in t | in t-1) = 0.32 at q = 1/8 with exact Binomial batch
   sizes, or takes the batch size of three steps back with probability 0.5, fails all 270 of 270
   cases (30 run seeds x the gate's 9, at the earlier level 1e-4); a conditional rate
   P(in t+L | in t) = q + 0.055 at one lag L (1, 2 or 100) is detected with probability 0.84-0.90
   at one rank (N = 8) and 1.0 at two (N = 16, 17), q + 0.04 with ~0.33 at one rank and >= 0.9 at
   two, q + 0.07 with >= 0.99 (at the level 1e-5, docs/sampling.md);
3. ``wrong_sample_rate``: the total number of inclusions against Binomial(T N, q) (two-sided
   normal approximation; T N >= 16,000 here), and the per-sample inclusion counts against
   chi^2_N two-sided (some samples drawn more often than others, or each exactly once per epoch
   as a shuffling loader does).

False alarms: ``alpha`` (default 1e-5) is the family-wise level *per case*, Bonferroni-split
over its ``6 + pairs of ranks`` tests (7 at two ranks, 9 at three); a NaN statistic rejects.
Sampling does not depend on the model, reduction or dtype: the cases run once per world size
(the first point of those axes). At world size 1 one more case, under the first seeding, takes
q = 0.3 over N = 10 (``fractional_rate``): every other q here is 1/integer, where a sampler that
draws at 1/int(1/q) (one over its batches per epoch) while the accountant is told q is right.
The default gate runs 10 cases (world sizes 1 and 2) and one at the node world size (``nodes``: 4
ranks as 2 nodes x 2, the divisible dataset under the first seeding), so its family-wise
false-alarm rate on a correct sampler is below 1.1e-4. Where the rate tests fail and the ranks
draw from disjoint samples, the sentence names the rank(s) whose own samples are off q
(``rank_rates``: a description of the failure, not a test of its own). q = 1 (every sample, every
step) is deterministic: only checks 1 and 3 apply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Dict, List, Optional, Sequence, cast

from ...lazy import torch

from ...targets import RunSpec
from ...verdict import Verdict
from ..engine.contract import Case, FuzzRecipe, Outputs, Point, Prepared, Property
from ..analysis.stats import (chi2_sf, chi2_two_sided_p, correlation_p, lag_autocovariance_z, normal_two_sided_p,
                    skewed_normal_two_sided_p)

DRAWS = 2000
ALPHA = 1e-5
SEEDINGS = ("same", "per_rank", "unseeded")
#: lags 1..PORTMANTEAU_LAGS in the portmanteau (its chi^2 law holds while the lags are few next to T)
PORTMANTEAU_LAGS = 32


#: the one case whose q is not 1/integer (world size 1): N = 10, q = 0.3
FRACTIONAL = (10, 0.3)


def datasets(ws: int):
    """``{name: (dataset_size, q)}``: q = 1/ceil(N/ws), what opacus derives from a
    DistributedSampler with local batch size 1; at world size 1 also ``fractional_rate``, a q that
    is not one over an integer (``FRACTIONAL``): a sampler that draws at 1/int(1/q) -- one over
    its number of batches per epoch -- while the accountant is told q is the sampler only there."""
    out = {"divisible": (8 * ws, 1 / 8)}
    if ws > 1:
        out["indivisible"] = (8 * ws + 1, 1 / 9)
    else:
        out["fractional_rate"] = FRACTIONAL
    return out


def case_datasets(point: Point):
    """``datasets`` for ``point``: ``fractional_rate`` under the first seeding only (at one rank
    the seeding policies differ in nothing that a rate derived from the loader's length depends on)."""
    out = datasets(point.world_size)
    if point.seeding != (point.options.seedings or SEEDINGS)[0]:
        out.pop("fractional_rate", None)
    return out


def prepare(spec: RunSpec) -> Prepared:
    """A Poisson spec as a sampling task with at least ``DRAWS`` steps."""
    if not spec.poisson:
        return "sampling_accounting needs sampling='poisson'"
    epochs = max(spec.epochs, math.ceil(DRAWS / spec.steps_per_epoch))
    return spec.with_(task="sample", steps=0, epochs=epochs)


def cases(point: Point):
    if not point.first_of_axes(PROPERTY.models, PROPERTY.reductions, PROPERTY.dtypes):
        return  # sampling does not depend on the model, reduction or dtype: once per world size
    draws = point.param("draws")
    for data, (n, q) in case_datasets(point).items():
        base = point.spec(sampling="poisson", sample_rate=q, dataset_size=n, seeding=point.seeding, steps=0,
                          sampling_seed=point.poisson_seed())
        spec = base.with_(task="sample", epochs=math.ceil(draws / base.steps_per_epoch))
        yield point.case(spec, labels={"dataset": data}, facts={"alpha": point.param("alpha")},
                         doing=f"{spec.nominal_steps} Poisson draws")


def nodes(point: Point):
    """At the node world size (``horizon.py``: 4 ranks as 2 simulated nodes x 2 local ranks), once:
    the divisible dataset's draws under the first seeding, where a sampler keyed on a rank index >= 2
    or on the node (a rank-2 loader at another rate) shows; the failure names the rank(s)."""
    if point.seeding != (point.options.seedings or SEEDINGS)[0]:
        return
    n, q = datasets(point.world_size)["divisible"]
    base = point.spec(sampling="poisson", sample_rate=q, dataset_size=n, seeding=point.seeding, steps=0,
                      sampling_seed=point.poisson_seed())
    spec = base.with_(task="sample", epochs=math.ceil(point.param("draws") / base.steps_per_epoch))
    yield point.case(spec, labels={"dataset": "divisible"}, facts={"alpha": point.param("alpha")},
                     doing=f"{spec.nominal_steps} Poisson draws on 2 nodes x 2 ranks")


def rank_rates(outputs, q: float, level: float) -> List[tuple]:
    """``(rank, observed rate, p)`` of the ranks whose own samples are included at a rate other than
    q (two-sided normal approximation of Binomial(T |S_r|, q) at ``level``), where the ranks draw
    from disjoint sets of samples (a static shard per rank, ``S_r`` the samples rank r ever drew);
    ``[]`` otherwise. It only names where a failed rate test's excess is (no test of its own)."""
    own = [{i for s in o.steps for i in s.indices} for o in outputs]
    if any(a & b for a, b in combinations(own, 2)):
        return []
    out = []
    for o, shard in zip(outputs, own):
        trials = len(o.steps) * len(shard)
        if not trials or q >= 1:
            continue
        hits = sum(len(s.indices) for s in o.steps)
        p = normal_two_sided_p((hits - trials * q) / math.sqrt(trials * q * (1 - q)))
        if not p >= level:
            out.append((o.rank, hits / trials, p))
    return out


def _inclusions(spec: RunSpec, outputs) -> torch.Tensor:
    """``[T, N]`` 0/1: sample i in the union of the ranks' batches at step t."""
    t = len(outputs[0].steps)
    x = torch.zeros(t, spec.dataset_size, dtype=torch.float64)
    for o in outputs:
        for k, s in enumerate(o.steps):
            if s.indices:
                x[k, torch.as_tensor(s.indices, dtype=torch.long)] = 1.0
    return x


def across_steps(x: torch.Tensor, batch: torch.Tensor):
    """The three across-steps statistics of ``[T, N]`` inclusions ``x`` (batch sizes ``batch``), or
    None below 4 steps: for every lag L = 1..T/2 the lag-L autocovariance of each sample's
    inclusion indicators (pooled over samples) and of the batch size, as Cramer-corrected normal
    p-values (``stats.lag_autocovariance_z``), Bonferroni over the lags; and the portmanteau
    sum_{L <= PORTMANTEAU_LAGS} z_L^2 of the membership lags against chi^2 (upper tail). With, for
    the sentences: the lag of the smallest membership p-value, the conditional rate
    P(in step t + L | in step t) there (co-inclusions / inclusions), and the batch-size lag."""
    t = x.shape[0]
    lmax = t // 2
    if lmax < 2:
        return None
    out: Dict[str, Any] = {"lags": lmax}
    z, skew = lag_autocovariance_z(x, lmax)
    p = skewed_normal_two_sided_p(z, skew)
    k = int(torch.argmin(p))  # the strongest lag (ties: the shortest)
    lag = k + 1
    both, first = float((x[:-lag] * x[lag:]).sum()), float(x[:-lag].sum())
    out.update(membership_lags=min(1.0, lmax * float(p[k])), lag=lag, z=float(z[k]),
               conditional_rate=both / first if first else float("nan"))
    npt = min(PORTMANTEAU_LAGS, lmax)
    portmanteau = float((z[:npt] ** 2).sum())
    top = [int(i) + 1 for i in torch.argsort(z[:npt].abs(), descending=True)[:3]]
    out.update(membership_portmanteau=chi2_sf(portmanteau, npt) if math.isfinite(portmanteau) else 0.0,
               portmanteau=portmanteau, portmanteau_lags=npt, portmanteau_top=top)
    zb, skew_b = lag_autocovariance_z(batch.reshape(-1, 1), lmax)
    pb = skewed_normal_two_sided_p(zb, skew_b)
    kb = int(torch.argmin(pb))
    rb = float(torch.corrcoef(torch.stack([batch[:-(kb + 1)], batch[kb + 1:]]))[0, 1])
    out.update(batch_size_lags=min(1.0, lmax * float(pb[kb])), batch_lag=kb + 1, batch_r=rb)
    return out


ACROSS_STEPS = ("batch_size_lags", "membership_lags", "membership_portmanteau")


def _across_steps_text(name: str, s: dict, q: float, q_obs: float) -> str:
    if name == "batch_size_lags":
        return (f"the batch sizes of steps {s['batch_lag']} apart are correlated (r = {s['batch_r']:.3f}, the "
                f"strongest of lags 1..{s['lags']}; 0 expected): draws are not independent across steps")
    if name == "membership_lags":
        return (f"a sample in step t is in step t+{s['lag']} with probability {s['conditional_rate']:.4g}, not "
                f"q = {q:.4g} (observed rate {q_obs:.4g}; lag {s['lag']} is the strongest of lags 1..{s['lags']}, "
                f"z = {s['z']:.1f}): membership is correlated across steps (e.g. a mask reused from {s['lag']} "
                "step(s) back, or earlier members preferred)")
    return (f"summed over lags 1..{s['portmanteau_lags']}, each sample's inclusions are autocorrelated "
            f"{s['portmanteau'] / s['portmanteau_lags']:.3g}x as much as independent steps allow (portmanteau "
            f"{s['portmanteau']:.4g} against chi^2_{s['portmanteau_lags']}; strongest at lags "
            f"{', '.join(map(str, s['portmanteau_top']))}): membership depends on recent steps")


@dataclass
class Sampled:
    """The statistics of ``T`` steps' inclusions (``statistics``); what the tests judge."""

    t: int
    n: int
    q: float
    batch: torch.Tensor
    #: q >= 1: every sample in every step, nothing random to test
    deterministic: bool
    #: ``(rank a, rank b, r, p)``: the correlation of two ranks' local batch sizes over steps
    pairs: List[tuple] = field(default_factory=list)
    #: the global batch size's dispersion around the observed rate ``q_obs``
    q_obs: float = float("nan")
    var0: float = float("nan")
    disp: float = float("nan")
    ratio: float = float("nan")
    #: ``across_steps``' statistics (None when not random or below 4 steps)
    lags: Optional[dict] = None
    total: float = 0.0
    q_hat: float = 0.0
    p_rate: float = 1.0
    counts: Optional[torch.Tensor] = None
    hom: float = 0.0
    p_hom: float = 1.0


def statistics(spec: RunSpec, ws: int, outputs, x: torch.Tensor) -> Sampled:
    """Every statistic of the ``[T, N]`` inclusions ``x`` (and the ranks' local batch sizes)."""
    t, n, q = x.shape[0], spec.dataset_size, spec.sample_rate
    st = Sampled(t=t, n=n, q=q, batch=x.sum(1), deterministic=q >= 1.0)
    batch = st.batch
    if not st.deterministic:
        local = [torch.tensor([float(len(s.indices)) for s in o.steps], dtype=torch.float64) for o in outputs]
        st.pairs = [(a, b, *correlation_p(local[a], local[b])) for a, b in combinations(range(ws), 2)]
        # around the *observed* rate, so that a wrong rate (check 3) does not read as correlation
        st.q_obs = float(batch.mean()) / n
        st.var0 = n * st.q_obs * (1 - st.q_obs)
        st.disp = float(((batch - batch.mean()) ** 2).sum() / st.var0) if st.var0 > 0 else float("nan")
        st.ratio = st.disp / (t - 1) if t > 1 else float("nan")
        st.lags = across_steps(x, batch)
    st.total = float(x.sum())
    st.q_hat = st.total / (t * n)
    st.counts = x.sum(0)
    if st.deterministic:
        st.p_rate = 1.0 if st.total == t * n else 0.0
        st.p_hom = 1.0 if bool((st.counts == t).all()) else 0.0
    else:
        st.p_rate = normal_two_sided_p((st.total - t * n * q) / math.sqrt(t * n * q * (1 - q)))
        st.hom = float(((st.counts - t * q) ** 2).sum() / (t * q * (1 - q)))
        st.p_hom = chi2_two_sided_p(st.hom, n)
    return st


def judge(case: Case, runs: Outputs) -> Verdict:
    spec, ws, outputs = case.spec, case.world_size, runs[0][0]
    alpha = case.facts.get("alpha", ALPHA)  # the fuzzer's cases carry no facts: the default
    # check 1 (equal step counts) is the runner's (prechecks.poisson_problem): step_divergence
    x = _inclusions(spec, outputs)
    if x.shape[0] == 0:
        return case.verdict("fail", "wrong_sample_rate", f"the sampler drew no step at all in {spec.epochs} "
                            f"epoch(s) (nominal {spec.nominal_steps})")
    m = 6 + len(list(combinations(range(ws), 2)))  # the deterministic steps-taken check costs no alpha
    level = alpha / m
    st = statistics(spec, ws, outputs, x)
    tests = _tests(st, spec, ws)
    evidence = {"steps": st.t, "dataset_size": st.n, "q": st.q, "q_hat": st.q_hat, "alpha": alpha,
                "tests": len(tests), "per_test_level": level, "p_values": {name: p for _, name, p, _ in tests},
                "empty_global_batches": int((st.batch == 0).sum())}
    if st.lags is not None:
        evidence["across_steps"] = {k: v for k, v in st.lags.items() if k not in ACROSS_STEPS}
    failed = [(d, name, p, msg) for d, name, p, msg in tests if not p >= level]  # NaN p rejects
    if failed:
        ranks = rank_rates(outputs, st.q, level) if failed[0][0] == "wrong_sample_rate" else []
        evidence["ranks_off_rate"] = [{"rank": r, "rate": rate, "p": p} for r, rate, p in ranks]
        return case.verdict("fail", failed[0][0], _failure_message(failed, level, ws, st, spec.seeding, ranks),
                            evidence)
    return case.verdict("pass", None, (
        f"{st.t} steps on {ws} rank(s): inclusion rate {st.q_hat:.5g} (q = {st.q:.5g}), independent across samples, "
        f"ranks and steps ({len(tests)} tests, family-wise alpha {alpha:g})"), evidence)


def _tests(st: Sampled, spec: RunSpec, ws: int) -> List[tuple]:
    """``(diagnosis, name, p, sentence)`` for every test, in the order the first failure is named."""
    t, n, q = st.t, st.n, st.q
    tests: List[tuple] = []
    if not st.deterministic:
        for a, b, r, p in st.pairs:
            tests.append(("correlated_sampling", f"ranks_{a}_{b}_correlation", p,
                          f"ranks {a} and {b}: their local batch sizes are correlated (r = {r:.3f} over {t} steps; "
                          "0 expected): the ranks' Poisson draws are not independent -- e.g. every rank's sampler "
                          "seeded identically draws the same mask over its own shard of the data"))
        tests.append(("correlated_sampling", "batch_size_dispersion", chi2_two_sided_p(st.disp, t - 1),
                      f"the global batch size varies {st.ratio:.3g}x as much as independent draws would (variance "
                      f"{float(st.batch.var()):.4g} vs N q (1-q) = {st.var0:.4g} at the observed rate): the samples' "
                      "inclusions are not independent within a step" + (
                          " (fixed-size batches are not Poisson sampling)" if st.ratio < 1 else "")))
        if t < spec.nominal_steps:  # deterministic: listed before the statistics it distorts
            tests.insert(len(st.pairs), ("wrong_sample_rate", "steps_taken", 0.0,
                         f"only {t} of the {spec.nominal_steps} nominal steps were taken "
                         f"({spec.epochs} epoch(s) of int(1/q) = {spec.steps_per_epoch}): steps whose batch "
                         "came out empty are skipped, so the accountant (one entry per step taken, each at rate "
                         "q) describes neither the number of steps nor the rate per step taken"))
        if st.lags is not None:
            for name in ACROSS_STEPS:
                tests.append(("correlated_sampling", name, st.lags[name],
                              _across_steps_text(name, st.lags, q, st.q_obs)))
    tests.append(("wrong_sample_rate", "inclusion_rate", st.p_rate,
                  f"samples are included at rate {st.q_hat:.5g} per step over {t} steps, not the configured "
                  f"q = {q:.5g}{_rate_why(st, spec, ws)}"))
    counts, hom = cast(torch.Tensor, st.counts), st.hom  # set by ``statistics``
    tests.append(("wrong_sample_rate", "per_sample_rate", st.p_hom,
                  f"per-sample inclusion counts spread {hom / n if n else 0:.3g}x as much as Binomial(T, q) "
                  f"(min {int(counts.min())}, max {int(counts.max())}, expected {t * q:.4g}): samples are not "
                  "each drawn with rate q" + (" (a shuffling loader draws each exactly once per epoch)"
                                              if n and hom / n < 0.5 else "")))
    return tests


def _rate_why(st: Sampled, spec: RunSpec, ws: int) -> str:
    """What an inclusion rate other than q looks like (the rate test's sentence ends with it)."""
    q_hat, q, t = st.q_hat, st.q, st.t
    if ws > 1 and abs(q_hat / q - ws) < 0.1 * ws:
        return (f" = {q_hat / q:.3g}x q, about the world size: q looks computed from a rank's local loader "
                "(its shard of the dataset) instead of the global dataset")
    if q_hat > q and t < spec.nominal_steps:
        return (f" = {q_hat / q:.3g}x q, and only {t} of the {spec.nominal_steps} nominal steps were taken: steps "
                "whose batch came out empty are skipped (the accountant counts the steps taken, each with rate q; "
                "per step taken the rate is higher)")
    return f" = {q_hat / q:.3g}x q"


def _failure_message(failed: List[tuple], level: float, ws: int, st: Sampled, seeding: str,
                     ranks: Sequence[tuple] = ()) -> str:
    text = "; ".join(f"{msg} (p = {p:.2g} < {level:.2g})" for _, _, p, msg in failed)
    if ranks:
        text = ("; ".join(f"rank {r} includes its own samples at rate {rate:.5g} = {rate / st.q:.3g}x q (p = {p:.2g})"
                          for r, rate, p in ranks) + f" -- the other ranks at q: {text}")
    steps = (" Amplification by subsampling, as the accountant composes it, needs every step's batch to be a "
             "fresh draw independent of every other step: a sample whose presence in one step makes it "
             "likelier in another is exposed in correlated steps, and the reported epsilon is too small."
             if any(name in ACROSS_STEPS for _, name, _, _ in failed) else "")
    return (f"at world_size={ws}, N={st.n}, q={st.q:.4g}, seeding {seeding!r}: {text}. The accountant's epsilon "
            f"assumes independent Poisson inclusion at rate q in every step on every rank.{steps}")


PROPERTY = Property(
    id="sampling_accounting", diagnoses=("correlated_sampling", "wrong_sample_rate", "step_divergence"),
    meaning=("the sampler is the Poisson sampling the accountant assumes: each sample in each step with rate q, "
             "independently across samples, ranks and steps, and every rank takes the same steps"),
    cases=cases, judge=judge, models=("mlp",), layouts=("split",), reductions=("mean",),
    params=(("draws", DRAWS), ("alpha", ALPHA)), samplings=("poisson",), seedings=SEEDINGS, nodes=nodes,
    # ALPHA per case; the default gate's 11 cases (world sizes 1 and 2, and the node case at 4) share
    # 11 * ALPHA = 1.1e-4
    false_alarm_rate=11 * ALPHA,
    fuzz=FuzzRecipe(draw=(("sampling_values", ("poisson",)), ("models", ("mlp",)), ("layouts", ("split",)),
                          ("reduction_values", ("mean",))), prepare=prepare))


__all__ = ["DRAWS", "ALPHA", "SEEDINGS", "PORTMANTEAU_LAGS", "FRACTIONAL", "datasets", "case_datasets", "prepare",
           "cases", "nodes", "rank_rates", "across_steps", "ACROSS_STEPS", "Sampled", "statistics", "judge", "PROPERTY"]

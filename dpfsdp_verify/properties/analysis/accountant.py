"""What a target's privacy accountant was told, against the mechanism the gate measured.

DP meaning: the epsilon a user reads is computed from the accountant's history -- (noise
multiplier sigma, sampling rate q, steps) -- not from the noise the optimizer adds. A fork whose
noise is right but whose accountant is told sigma*sqrt(N) and q/N (N ranks) reports an epsilon
several times too small: a privacy violation in the accounting, invisible to every check of the
noise and the sampler.

``noise_calibration`` calls ``accountant_problem`` on its statistical cases (several noisy runs
at lr 0, each step's noise measured as gradient(sigma) - gradient(0)), after its own tests passed,
for a target that reports its accountant (``RankOutput.accountant_history``; docs/adapters.md):

* every rank reports the same history, and its steps add up to the steps the run took;
* sigma: for each value of sigma the history gives a step, the noise measured at those steps
  (every coordinate of every tensor, pooled over the runs) must have std sigma * C / D: a
  two-sided chi-square test at the case's per-test level (the test the scale checks use);
* q (Poisson runs): each entry's sampling rate is the configured q (relative 1e-9), the rate
  ``sampling_accounting`` measures the sampler at (2000 draws per case); the rate seen in the run's
  own draws is stated beside it. Fixed batches have no sampling rate to measure: q is not judged;
* epsilon (the runs that ask, ``RunSpec.accountant_delta`` > 0): any valid accounting of the measured
  mechanism -- sigma's confidence interval at the case's level, the configured q (fixed batches: the
  told q), the steps taken -- passes, whatever the accountant's kind: the reported epsilon must lie
  between ``accounting_bounds.epsilon_floor`` at sigma's upper end (a sound lower bound on the true
  epsilon: PLD/PRV are above it) and ``accounting_bounds.classic_epsilon`` at its lower end (RDP with
  the classic conversion, the loosest standard valid one). Below: under-reported (a privacy
  violation); above: over-reported (the guarantee understated, privacy intact).

The steps composed are the steps *taken* (what ``StepOutput.privacy_steps`` counts): a sampler
that skips empty rounds takes fewer steps than nominal, which ``sampling_accounting`` names
(``wrong_sample_rate``); what that does to the epsilon is docs/findings.md's finding 7.
"""

from __future__ import annotations

import hashlib
import math
from typing import Dict, List, Optional, Sequence, Tuple, Union, cast

from ...targets import RunSpec, accounting, accounting_bounds
from .findings import HistoryFinding
from .stats import chi2_quantile, chi2_two_sided_p

#: the delta the runs that ask for an epsilon ask it at: not a value a fork would hard-code (1e-5,
#: 1e-6: opacus' examples'); at 1e-5 an epsilon reported at a hard-coded 1e-5 was right
#: (``fixtures.sigma_specimens:EpsilonAtHardCodedDelta``)
DELTA = 2e-6
#: the range the other runs' deltas are drawn from, log-uniform (``asked_delta``)
ASKED_DELTAS = (1e-8, 1e-4)
#: a run of at least this many steps is asked for its epsilon (``asked_delta``)
ASK_STEPS = 24
#: relative rounding allowed between two RDP computations of one history (measured: 2e-14)
RDP_RTOL = 1e-6
#: told sampling rates are compared with the configured one to rounding
RATE_RTOL = 1e-9


def _expand(history) -> List[Tuple[float, float]]:
    """``[(sigma, q)]`` per step, in order, of an opacus-format history."""
    return [(float(s), float(q)) for s, q, n in history for _ in range(int(n))]


def _history_finding(spec: RunSpec, noisy) -> Optional[HistoryFinding]:
    """The first noisy run whose ranks' histories disagree, are missing, or compose another number of
    steps than the run took; ``None`` if every run's history is consistent."""
    for i, run in enumerate(noisy):
        histories = [o.accountant_history for o in run]
        if any(h != histories[0] for h in histories):
            return HistoryFinding("ranks_disagree", told_by=tuple((o.rank, o.accountant_history) for o in run))
        history = histories[0]
        if history is None:
            return HistoryFinding("no_history", run=i)
        taken = spec.first_step + len(run[0].steps)
        if len(_expand(history)) != taken:
            return HistoryFinding("step_count", history=history, told_steps=len(_expand(history)), taken=taken)
    return None


def _noise_by_sigma(spec: RunSpec, noisy, noise, names: Sequence[str]) -> Tuple[Dict[float, List[float]], set]:
    """Each step's measured sum of squares and coordinates, summed by the sigma the accountant was told
    for it (``{sigma: [sum of squares, count]}``), and the sampling rates it was told."""
    by_sigma: Dict[float, List[float]] = {}
    told_rates: set = set()
    for i, run in enumerate(noisy):
        per_step = _expand(run[0].accountant_history)
        for k, step in enumerate(noise[i]):
            sigma, q = per_step[spec.first_step + k]
            told_rates.add(q)
            acc = by_sigma.setdefault(sigma, [0.0, 0])
            acc[0] += sum(float(step[n].pow(2).sum()) for n in names)
            acc[1] += sum(step[n].numel() for n in names)
    return by_sigma, told_rates


def accountant_problem(specs: Sequence[RunSpec], runs, noise, names: Sequence[str], alpha: float,
                       evidence: Optional[Dict] = None) -> Optional[Tuple[Union[str, HistoryFinding], Dict]]:
    """``(problem, evidence)`` when the accountant of a noisy run was told other than what the
    gate measured (module docstring), else ``None`` (also when the target reports no accountant).
    ``runs[i][rank]``: the outputs of ``specs[i]`` (``runs[0]`` noise 0); ``noise[i - 1][step][name]``:
    run i's measured noise; ``alpha``: the case's per-test level. ``evidence``: a dict it fills with
    what it compared (told and measured sigma and q, both epsilons), pass or fail. ``problem``: the
    sentence, or the ``HistoryFinding`` for ``wording.accountant.measured_history_message``."""
    spec, noisy = specs[1], runs[1:]
    if all(o.accountant_history is None for run in noisy for o in run):
        return None
    evidence = {} if evidence is None else evidence
    evidence["accountant"] = noisy[0][0].accountant
    found = _history_finding(spec, noisy)
    if found is not None:
        if found.kind == "step_count":
            evidence["accountant_history"] = found.history
        return found, evidence  # a history finding: worded by the caller (wording.accountant)
    by_sigma, told_rates = _noise_by_sigma(spec, noisy, noise, names)
    total_ss = sum(v[0] for v in by_sigma.values())
    total_n = cast(int, sum(v[1] for v in by_sigma.values()))
    sigma_hat = math.sqrt(total_ss / total_n) / (spec.max_grad_norm / spec.divisor)
    evidence.update(told_sigmas=sorted(by_sigma), measured_sigma=sigma_hat, told_rates=sorted(told_rates))
    q_hat = _observed_rate(spec, noisy[0]) if spec.poisson else None
    if q_hat is not None:
        evidence["measured_rate"] = q_hat
    told = (f"sigma {', '.join(f'{s:.6g}' for s in sorted(by_sigma))} "
            f"and q {', '.join(f'{q:.6g}' for q in sorted(told_rates))}")
    measured = f"sigma {sigma_hat:.4g}" + (f" and q {spec.sample_rate:.6g} (the run's draws: {q_hat:.4g})"
                                          if q_hat is not None else "")
    why = _told_parameter_problem(spec, by_sigma, told_rates, q_hat, alpha)
    if why is not None:
        return _mismatch(spec, evidence, told, measured, why, specs, runs, sigma_hat, total_n, alpha)
    return _epsilon_problem(specs, evidence, told, measured, runs, sigma_hat, total_n, alpha)


def _told_parameter_problem(spec: RunSpec, by_sigma: Dict[float, List[float]], told_rates: set,
                            q_hat: Optional[float], alpha: float) -> Optional[str]:
    """Why the told sigma (each value against the noise of the steps it was told for) or the told q
    (Poisson: against the configured rate) is not the mechanism's; ``None`` if both are."""
    unit = spec.max_grad_norm / spec.divisor  # the noise std per unit of sigma
    for sigma, (ss, count) in sorted(by_sigma.items()):
        own = math.sqrt(ss / count) / unit
        p = chi2_two_sided_p(ss / (sigma * unit) ** 2, cast(int, count)) if sigma > 0 else 0.0  # [ss, count]
        if not p >= alpha:
            return (f"it was told sigma = {sigma:.6g} for steps whose noise has std {own:.4g} x C/D "
                    f"(two-sided chi-square over {count} values, p = {p:.2g} < {alpha:.2g})")
    if spec.poisson:
        wrong = sorted(q for q in told_rates if abs(q - spec.sample_rate) > RATE_RTOL * spec.sample_rate)
        if wrong:
            return (f"it was told q = {', '.join(f'{q:.6g}' for q in wrong)} while the sampler draws at q = "
                    f"{spec.sample_rate:.6g} (this run's draws: {q_hat:.4g}; sampling_accounting measures the "
                    f"sampler's rate over 2000 draws); {wrong[0] / spec.sample_rate:.4g} x q")
    return None


def _observed_rate(spec: RunSpec, ranks) -> float:
    """Inclusions per sample per step taken in one Poisson run (the union of the ranks' batches)."""
    steps = len(ranks[0].steps)
    drawn = sum(len(o.steps[k].indices) for o in ranks for k in range(steps))
    return drawn / (steps * spec.dataset_size) if steps else float("nan")


def _interval(specs: Sequence[RunSpec], runs, sigma_hat: float, total_n: int, alpha: float):
    """``(run index, its outputs, delta, (eps at sigma_hat, eps low, eps high), (sigma_hat, q, steps),
    sigma's interval)``: the suite's RDP epsilon of the measured mechanism at the delta the first run
    that asked for an epsilon asked at, over sigma's confidence interval; ``None`` if none asked."""
    asking = next((i for i in range(1, len(runs)) if specs[i].accountant_delta > 0), None)
    if asking is None:
        return None
    spec, run = specs[asking], runs[asking]
    delta = spec.accountant_delta
    steps = spec.first_step + len(run[0].steps)
    told_q = sorted({q for _, q in _expand(run[0].accountant_history or [])})
    q = spec.sample_rate if spec.poisson else (told_q[0] if len(told_q) == 1 else None)
    if q is None or not steps:
        return None
    # sigma's (1 - alpha) confidence interval from the pooled sum of squares ~ (sigma unit)^2 chi^2(n)
    lo = sigma_hat * math.sqrt(total_n / chi2_quantile(1 - alpha / 2, total_n))
    hi = sigma_hat * math.sqrt(total_n / chi2_quantile(alpha / 2, total_n))
    eps = accounting.epsilon([(sigma_hat, q, steps)], delta)
    # a valid epsilon lies between the sound floor at sigma's upper end and the classic RDP conversion
    # at its lower end (accounting_bounds)
    floor = accounting_bounds.epsilon_floor([(hi, q, steps)], delta)
    ceiling = accounting_bounds.classic_epsilon([(lo, q, steps)], delta)
    return asking, run, delta, (eps, floor, ceiling), (sigma_hat, q, steps), (lo, hi)


def _epsilon_problem(specs, evidence, told, measured, runs, sigma_hat, total_n, alpha):
    spec = specs[1]
    got = _interval(specs, runs, sigma_hat, total_n, alpha)
    if got is None:
        return None
    asking, run, delta, (eps, eps_lo, eps_hi), history, (s_lo, s_hi) = got
    reported = [o.epsilon for o in run]
    evidence.update(reported_epsilon=reported[0], independent_epsilon=eps, independent_interval=[eps_lo, eps_hi],
                    delta=delta, sigma_interval=[s_lo, s_hi])
    if all(r is None for r in reported):
        return (f"it was asked for its epsilon at delta {delta:g} (RunSpec.accountant_delta) and reported none "
                "(RankOutput.epsilon)", evidence)
    if any(r is None for r in reported) or any(r != reported[0] for r in reported):
        return (f"the ranks report different epsilons for one run ({reported}) at delta {delta:g}", evidence)
    r = float(reported[0])
    if eps_lo * (1 - RDP_RTOL) <= r <= eps_hi * (1 + RDP_RTOL):
        return None
    under = r < eps_lo
    # an epsilon that is exactly the told history's at a delta a fork hard-codes, or exactly another step
    # count's of the told (sigma, q) (relative 1e-6), is named for that: the best explanation, never one
    # that fits within sigma's interval by chance
    told_history = run[0].accountant_history or []
    other = accounting.delta_of(told_history, r, delta, extra=derived_deltas(specs[asking]))
    if other is not None:
        evidence["epsilon_delta"] = other
        return _text(spec, told, measured, wrong_delta_words(r, delta, other), tail=wrong_delta_tail(delta, other),
                     under=under), evidence
    k = accounting.steps_of(told_history, r, delta)
    if k is not None:
        evidence["epsilon_steps"] = k
        return _text(spec, told, measured, (
            f"it reports epsilon {r:.4g} at delta {delta:g}, exactly the RDP epsilon of {k} step(s) of the sigma and q "
            f"it was told, while the run took {history[2]} steps (a valid epsilon of them: "
            f"{eps_lo:.4g}..{eps_hi:.4g}): "
            f"the told sigma and q match the noise and the sampler, but the epsilon composes {k} of the {history[2]} "
            f"releases (a step count {'short' if k < history[2] else 'long'} by {abs(history[2] - k)})"), tail=(
            " The epsilon a user reads must compose every release made: with fewer steps than were taken it is "
            "too small." if k < history[2] else " An epsilon of more steps than were taken overstates the "
            "privacy loss (utility of the guarantee, not privacy)."), under=under), evidence
    side = (f"below {eps_lo:.4g}, a sound lower bound on the true epsilon (no valid accountant reports less)" if under
            else f"above {eps_hi:.4g}, the classic RDP conversion (the loosest standard valid accounting)")
    return _text(spec, told, measured, (
        f"it reports epsilon {r:.4g} at delta {delta:g}; a valid epsilon of the measured mechanism (sigma "
        f"{sigma_hat:.4g}, in {s_lo:.4g}..{s_hi:.4g} at the case's level; q {history[1]:.6g}; {history[2]} steps) "
        f"lies in {eps_lo:.4g}..{eps_hi:.4g} (the suite's RDP accountant: {eps:.4g}), and {r:.4g} is {side}"),
        tail=UNDER_TAIL if under else OVER_TAIL, under=under), evidence


def asked_delta(spec: RunSpec, world_size: int) -> float:
    """The delta a run of a fixed case is asked for its epsilon at (``RunSpec.accountant_delta``).

    Besides noise_calibration's Poisson runs (``DELTA``), every noisy training run whose accountant
    history is of a kind those runs do not have: a resumed ``load`` half (restored steps), gradient
    accumulation (physical passes), >= 3 ranks or a 2-D mesh, >= ``ASK_STEPS`` steps. Its delta is
    drawn log-uniform in ``ASKED_DELTAS`` from a hash of the spec (so every replay asks the same; 3
    significant digits, never a power of ten nor ``DELTA``): an epsilon computed at a delta of the
    fork's own, or wrong only after a resume, under accumulation, at more ranks or past some step,
    fails the run it is wrong in (``prechecks.accountant_history_problem``). A spec that asks already
    keeps its delta; a run without noise or not training is not asked (0). Fuzzed draws are not
    asked; ``deadlock_free``'s explored noisy draws are, by count (``explore_asked_delta``): opacus'
    default PRV accountant costs ~0.1-2 s per epsilon on this box (up to ~10 s at sigma 0.5 over
    200 steps, measured 2026-11-28)."""
    if spec.accountant_delta > 0 or spec.task != "train" or not float(spec.noise_multiplier) > 0:
        return spec.accountant_delta
    if not (spec.phase == "load" or spec.physical_batch_size or world_size >= 3 or spec.mesh
            or spec.nominal_steps >= ASK_STEPS):
        return 0.0
    return drawn_delta(spec)


def drawn_delta(spec: RunSpec) -> float:
    """A delta drawn log-uniform in ``ASKED_DELTAS`` from a hash of ``spec`` (every replay asks the
    same; 3 significant digits, never a power of ten nor ``DELTA``): ``asked_delta``'s, and the one
    an explored noisy draw is asked at (``checks/deadlock_free.explore_prepare``)."""
    u = int.from_bytes(hashlib.sha256(spec.to_json().encode()).digest()[:8], "big") / 2.0 ** 64
    lo, hi = (math.log10(d) for d in ASKED_DELTAS)
    delta = float(f"{10.0 ** (lo + (hi - lo) * u):.3g}")
    if delta == DELTA or any(abs(delta - d) <= 1e-9 * d for d in accounting.ROUND_DELTAS):
        delta = float(f"{delta * 1.37:.3g}")  # not a value a fork would hard-code
    return delta


def derived_deltas(spec: RunSpec) -> Tuple[float, ...]:
    """Deltas a fork derives from the run rather than hard-codes (``accounting.delta_of``): 1/N; and
    ``DELTA``, the one delta noise_calibration asks at, which a fork tuned to the gate would hard-code."""
    return ((1.0 / spec.dataset_size,) if spec.poisson and spec.dataset_size else ()) + (DELTA,)


def wrong_delta_words(reported: float, asked: float, other: float) -> str:
    """The sentence of an epsilon reported at ``other`` instead of the ``asked`` delta."""
    return (f"it reports epsilon {reported:.4g} when asked at delta {asked:g}, which is exactly the RDP epsilon of the "
            f"history it was told at delta {other:g}: the epsilon is computed at a delta other than the one asked "
            "(a hard-coded delta), while the told sigma, q and steps match the noise, the sampler and the run")


def wrong_delta_tail(asked: float, other: float) -> str:
    """What an epsilon at another delta means for the guarantee a user reads."""
    if other > asked:
        return (f" At the larger delta {other:g} the epsilon is smaller: the (epsilon, delta) a user reads claims "
                "more privacy than the run has at the delta configured.")
    return (f" At the smaller delta {other:g} the epsilon is larger: the guarantee is understated (utility of the "
            "guarantee, not privacy).")


def _mismatch(spec, evidence, told, measured, why, specs, runs, sigma_hat, total_n, alpha):
    """The message of a told-parameter mismatch, with both epsilons where a run asked for one."""
    got = _interval(specs, runs, sigma_hat, total_n, alpha)
    eps_note = ""
    if got is not None:
        asking, run, delta, (eps, eps_lo, eps_hi), history, _ = got
        reported = run[0].epsilon
        evidence.update(reported_epsilon=reported, independent_epsilon=eps, independent_interval=[eps_lo, eps_hi],
                        delta=delta)
        if reported is not None:
            eps_note = (f" It reports epsilon {reported:.4g} at delta {delta:g}; the suite's RDP accountant on the "
                        f"measured mechanism gives {eps:.4g} ({eps_lo:.4g}..{eps_hi:.4g}).")
    return _text(spec, told, measured, why) + eps_note, evidence


#: the end of a told-parameter message: what a wrong sigma or q does to the epsilon
PARAMETER_TAIL = (" The epsilon a user reads is computed from what the accountant is told: with a larger sigma or a "
                  "smaller q than the noise and the sampler have, it is too small (e.g. sigma*sqrt(N) and q/N "
                  "composed across N ranks).")


#: the end of an epsilon below the floor, and of one above the ceiling
UNDER_TAIL = " The epsilon a user reads is smaller than the run's privacy loss: a privacy violation in the accounting."
OVER_TAIL = (" The epsilon a user reads is larger than any valid accounting of the run gives: the guarantee is "
             "understated (utility of the guarantee, not privacy).")


def _text(spec: RunSpec, told: str, measured: str, why: str, tail: str = PARAMETER_TAIL,
          under: Optional[bool] = None) -> str:
    head = {None: "PRIVACY ACCOUNTING", True: "PRIVACY VIOLATION in the accounting (epsilon under-reported)",
            False: "ACCOUNTING (epsilon over-reported, privacy intact)"}[under]
    return (f"{head}: the accountant does not describe the mechanism that ran: {why}. Told {told}; "
            f"measured {measured} (C={spec.max_grad_norm:g}, D={spec.divisor:g}).{tail}")


def describe(evidence: Dict) -> str:
    """A passing check in words (``evidence`` as ``accountant_problem`` filled it); "" if not run."""
    if "measured_sigma" not in evidence:
        return ""
    text = (f"; the accountant ({evidence['accountant']}) was told sigma "
            f"{', '.join(f'{x:.6g}' for x in evidence['told_sigmas'])} (measured {evidence['measured_sigma']:.4g}) "
            f"and q {', '.join(f'{x:.6g}' for x in evidence['told_rates'])}")
    if evidence.get("reported_epsilon") is not None:
        lo, hi = evidence["independent_interval"]
        text += (f", and reports epsilon {evidence['reported_epsilon']:.4g} at delta {evidence['delta']:g} (the "
                 "suite's "
                 f"RDP epsilon of the measured mechanism: {evidence['independent_epsilon']:.4g}, {lo:.4g}..{hi:.4g})")
    return text


__all__ = ["accountant_problem", "asked_delta", "drawn_delta", "describe", "derived_deltas", "ASKED_DELTAS",
           "ASK_STEPS", "DELTA", "UNDER_TAIL", "OVER_TAIL"]

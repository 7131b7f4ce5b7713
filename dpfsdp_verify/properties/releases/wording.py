"""The sentences of the whole-run release judge (``releases/judge.py``), built from the findings of
``releases/analysis.py``: what was released wrong, in which run (the property and configuration that
made it), at which steps and ranks, in which dtype and at which lr -- and, where the measured ratio is
one a known mistake gives, that mistake."""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

from .analysis import SILENT, SILENT_LEVEL, SILENT_P0, Finding, RunReleases
from . import signal
from ..wording.noise_messages import formula_causes
from ..wording.postprocessing import DIAGNOSIS as POST_PROCESSED

#: a measured std ratio "is" a candidate cause's factor within this relative distance
CAUSE_RTOL = 0.06


def _steps(steps: Sequence[int]) -> str:
    s = sorted(steps)
    if len(s) > 2 and s == list(range(s[0], s[-1] + 1)):
        return f"steps {s[0]}-{s[-1]}"
    return ("step " if len(s) == 1 else "steps ") + ", ".join(str(x) for x in s[:8]) + (" ..." if len(s) > 8 else "")


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def cause(run: RunReleases, ratio: float, contrast: Dict[str, Tuple[str, float]], whole_run: bool = True) -> str:
    """The cause the other runs single out (``analysis.contrasts``), in words ("" if none):
    a factor that appears in this run's kind of run only and equals a known mistake's. A ratio
    alone never names a cause (0.7 is 1/sqrt(2) to 1 %: a float32-only factor is not noise averaged
    over two ranks unless the float64 runs at two ranks show it too). A factor of sigma or C is
    named only for a ratio of the ``whole_run`` (every step and rank alike, as a std formula's is),
    never for one rank's or from one step on."""
    def fine(key):
        return key in contrast and abs(contrast[key][1] - 1) < CAUSE_RTOL
    ws, lr = run.world_size, run.lr
    notes = []
    if lr and fine("lr") and abs(ratio - min(lr, 1.0)) <= CAUSE_RTOL * min(lr, 1.0):
        notes.append(f"it is min(lr, 1) = {min(lr, 1.0):g} at lr {lr:g} while {contrast['lr'][0]} release "
                     f"{contrast['lr'][1]:.3f} x: the noise is scaled by the learning rate")
    for key, name, value in (("sigma", "sigma", run.sigma), ("clip", "C", run.clip)):
        for k, what in formula_causes(name, value) if whole_run and fine(key) and not notes else ():
            if abs(ratio - k) <= CAUSE_RTOL * k:
                notes.append(f"it is {what} ({contrast[key][0]} release {contrast[key][1]:.3f} x)")
                break
    if fine("dtype") and not notes:
        notes.append(f"only the {run.dtype}{'' if run.precision == 'fp32' else ' ' + run.precision} runs are off: "
                     f"{contrast['dtype'][0]} release {contrast['dtype'][1]:.3f} x" + _edge(contrast, "dtype", run))
    if ws > 1 and fine("world_size") and not notes:
        why = (f"it is 1/sqrt({ws}): noise drawn at full shape on every rank and averaged over the ranks"
               if abs(ratio - ws ** -0.5) <= CAUSE_RTOL * ws ** -0.5 else f"it appears at world size {ws} only")
        notes.append(f"{why} ({contrast['world_size'][0]} release {contrast['world_size'][1]:.3f} x)"
                     + _edge(contrast, "world_size", run))
    return "".join(f" The ratio is telling: {n}." for n in notes[:1])


def _edge(contrast: Dict[str, Tuple[str, float]], key: str, run: RunReleases) -> str:
    """The confound of contrast ``key`` with sigma (``edges.sigma_edge``), as a clause ("" if none)."""
    if f"{key}_edge" not in contrast:
        return ""
    return (f" -- but this run's sigma {run.sigma:g} is also {contrast[key + '_edge'][0]}: a noise std that bends "
            "with sigma (capped or floored there) shows the same, and these runs cannot tell the two apart")


def where(owner: str, config: str, run: RunReleases) -> str:
    return (f"in a run made for {owner} [{config}] ({run.label}, sigma={run.sigma:g}, C={run.clip:.4g}, "
            f"D={run.divisor:g})")


def finding_message(f: Finding, owner: str, config: str, run: RunReleases, alpha: float,
                    contrast: Optional[Dict[str, Tuple[str, float]]] = None, lead: str = "", tail: str = "") -> str:
    at = where(owner, config, run)
    if f.kind == "silent":
        ranks = f" (ranks with silent coordinates: {', '.join(map(str, sorted(f.ranks)))})" if len(f.ranks) > 1 else ""
        empty = sorted(set(f.steps) & {t for t, r in run.empty if r == f.ranks[0]})
        why = (f" At {_steps(empty)} rank {f.ranks[0]}'s local batch was empty: the noise went with the batch, but a "
               "release needs it whatever the local batch holds (without it the release is the clipped sum of the "
               "other ranks' samples, exactly)." if empty else "")
        return (f"PRIVACY VIOLATION: no noise on {f.detail} at {_steps(f.steps)}{ranks} {at}: "
                f"there the released gradient x D equals the float64 reference's clipped sum to within {SILENT:g} "
                f"sigma*C, which a Gaussian value is with probability {SILENT_P0:.1g} each (these counts: < "
                f"{SILENT_LEVEL:g} for correct noise). Coordinates released without noise release their clipped sum "
                f"exactly: every coordinate of every release needs Gaussian noise of std sigma*C/D.{why}")
    if f.kind == "repeat":
        (ta, tb), (ra, rb) = f.steps, f.ranks
        resumed = (f" The run was checkpointed after step {run.first_step} and resumed in fresh rank processes: the "
                   "resumed run's noise generator started again as at the start instead of from its saved state."
                   if run.phase == "load" and ta < run.first_step <= tb else "")
        return (f"PRIVACY VIOLATION: the noise released at step {tb} on rank {rb}'s shard repeats the noise of step "
                f"{ta} on rank {ra}'s ({f.detail}, each within {1e-3:g} sigma*C) {at}. Repeated noise cancels in the "
                f"difference (or sum) of two releases: no privacy for what it was meant to hide.{resumed}")
    if f.kind == "coarse":
        return (f"PRIVACY VIOLATION: the released noise is not Gaussian {at}: it is discrete, on a grid of step "
                f"{f.ratio:.3g} sigma*C ({f.detail}; released gradient x D minus the reference's clipped sum). Values "
                "rounded to 0 look like coordinates without noise; the cause is the grid. A discrete noise needs its "
                "own privacy analysis; the Gaussian accounting does not cover it.")
    if f.kind == "grid":
        return (f"PRIVACY VIOLATION: the released noise lies on the {f.detail} grid {at}: {f.ratio:.1%} of its values "
                f"(released gradient x D minus the reference's clipped sum) have at most the {f.detail} significand, "
                "against a few % of continuous Gaussian values. Noise drawn (or rounded) in a coarser format and added "
                "in a finer one is discrete: the released value's low-order bits carry the gradient (a floating-point "
                "attack on the Gaussian mechanism), which the Gaussian accounting does not cover.")
    if f.kind == "mean":
        return (f"the released noise is not centred {at}: its mean over every coordinate and step is {f.ratio:+.3g} "
                f"sigma*C per coordinate (two-sided p = {f.p:.2g} < {alpha:.2g}). Noise with a bias moves every "
                "release the same way: the mechanism is not the Gaussian one the accountant assumes.")
    less = f.ratio < 1
    lead = lead or ("PRIVACY VIOLATION: too little noise" if less else "too much noise (utility lost)")
    if f.scope == "from":
        place = (f"from step {f.steps[0]} on: the noise std is {f.ratio:.3f} x sigma*C/D at {_steps(f.steps)} "
                 f"({f.detail} x), on every rank")
    elif f.scope == "rank":
        place = (f"on {_ranks(f.ranks)}'s shard: the noise std is {f.ratio:.3f} x sigma*C/D over every step "
                 f"({f.detail} x)")
    elif f.scope == "max_norm":
        place = (f"where a rank's local batch has no sample above C: the noise std follows min(C, the local "
                 f"batch's largest norm) / C, which every (step, rank) release fits once scaled back by it "
                 f"({f.detail} releases had all their samples below C, at {_steps(f.steps)}; pooled std "
                 f"{f.ratio:.3f} x sigma*C/D). A noise scale set by the batch's own largest clipped norm is "
                 "data-dependent: it is sigma*C only when some sample is clipped, and the Gaussian mechanism's "
                 "sensitivity is C whatever the batch")
    elif f.scope == "step":
        place = f"at {_steps(f.steps)}: the noise std is {f.ratio:.3f} x sigma*C/D (the worst step)"
    else:
        place = f"at every step ({_steps(f.steps)}), on every rank: the noise std is {f.ratio:.3f} x sigma*C/D"
    return (f"{lead} {at}, {place} (the released gradient x D minus the float64 reference's clipped sum at the "
            f"parameters the step started from, off the span of the batch's per-sample gradients; two-sided chi-square "
            f"p = {f.p:.2g} < {alpha:.2g}). Every release needs Gaussian noise of std sigma*C/D on every coordinate."
            + cause(run, f.ratio, contrast or {}, whole_run=f.scope == "run") + tail)


def judged_message(f: Finding, owner: str, config: str, run: RunReleases, alpha: float,
                   contrast: Optional[Dict[str, Tuple[str, float]]] = None) -> Tuple[Optional[str], str]:
    """``(diagnosis, message)`` of finding ``f``: a whole-run too-little-noise finding read against the
    release's factor on the signal (``signal.py``) -- ``post_processed`` where the signal is scaled like
    the noise, both readings where the run cannot tell, the violation where the signal is released whole;
    ``diagnosis`` ``None``: the finding's own. (``finding_message``'s ``lead`` replaces a std finding's
    opening, "PRIVACY VIOLATION: too little noise"; its ``tail`` is appended: ``signal.finding_words``.)"""
    sig = signal.read_finding(run.signal, f.kind, f.ratio, f.scope)
    if sig is not None and sig.kind == "rescaled":
        return POST_PROCESSED, signal.rescaled_message(sig, f.ratio, where(owner, config, run))
    return None, finding_message(f, owner, config, run, alpha, contrast, **signal.finding_words(sig, f.ratio))


def pooled_message(failures: Sequence[Tuple[str, float, float, float]], alpha: float) -> str:
    name, ratio, p, df = failures[0]
    lead = "PRIVACY VIOLATION: too little noise" if ratio < 1 else "too much noise (utility lost)"
    return (f"{lead} pooled over {name}: std {ratio:.3f} x sigma*C/D over {df:.0f} degrees of freedom (two-sided "
            f"chi-square p = {p:.2g} < {alpha:.2g}), though no single run shows it at its own size"
            + "".join(f"; {n}: {r:.3f} x (p = {q:.2g})" for n, r, q, _ in failures[1:4])
            + ". Every release needs Gaussian noise of std sigma*C/D.")


#: the short cause of a step ``analysis.decompose`` leaves out, by the opening of its reason
LEFT_OUT = (("the parameters it started from", "their starting parameters unknown"),
            ("its batch of", "their batch spans too much of the coordinates"),
            ("bf16's rounding", "bf16 beyond its first-order bound at the parameters they started from"),
            ("float32's rounding", "float32 beyond its first-order bound at the parameters they started from"))


def left_out(reasons: Sequence[str]) -> str:
    """``"; N step(s) not decomposable (why) left out"`` for the reasons of the steps left out (``""`` for none)."""
    if not reasons:
        return ""
    counts: Dict[str, int] = {}
    for why in reasons:
        kind = next((k for opening, k in LEFT_OUT if why.startswith(opening)), why)
        counts[kind] = counts.get(kind, 0) + 1
    whys = ", ".join(k if len(counts) == 1 else f"{n}: {k}" for k, n in counts.items())
    return f"; {len(reasons)} step(s) not decomposable ({whys}) left out"


def pass_message(counts: Dict[str, int], releases: int, steps: int, runs: int, tests: int, alpha: float,
                 detect: float, skipped: Sequence[str], ratio: float) -> str:
    owners = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    left = left_out(skipped)
    return (f"every release of every noisy run of this gate run decomposed into the float64 reference's clipped sum "
            f"and noise of std sigma*C/D: {runs} runs ({owners}), {steps} steps, {releases} rank shards; pooled std "
            f"{ratio:.4f} x sigma*C/D; no value on a bfloat16/float16 grid, no shard's noise repeated at another step "
            f"or rank, no coordinate released without noise; "
            f"{tests} tests at {alpha:.2g} each (false alarm <= {alpha * tests:.2g} per gate run); pooled, "
            f"a std error of {detect:.2%} is detected with ~99% probability{left}")


def not_decomposed_message(reason: str) -> str:
    return f"no release judged: {reason}"


def node_layout_note(ranks, world_size: int, local: int) -> str:
    """Where ``ranks`` sit in a layout of nodes of ``local`` ranks (``harness.node_env``), as a
    sentence to append ("" for fewer than one rank): what a seed or a branch keyed on ``LOCAL_RANK``
    / ``GROUP_RANK`` sees there."""
    if not ranks or local < 1 or world_size % local:
        return ""
    places = ", ".join(f"rank {r} is node {r // local}'s local rank {r % local}" for r in sorted(set(ranks)))
    return (f" On the {world_size // local} x {local} node layout (the environment torchrun gives: LOCAL_RANK, "
            f"GROUP_RANK) {places}: "
            "a seed or branch keyed on the node or local rank instead of the global rank shows here, not on one "
            "node.")


def one_run_pass_message(run: RunReleases, tests: int, alpha: float, detects: float, layout: str = "") -> str:
    """The pass of a run ``noise_calibration`` judges release by release (its node run, ``layout`` " as 2
    nodes x 2"; the long run): what was judged, and the power."""
    ranks = sorted({c.rank for c in run.cells})
    steps = sorted({c.step for c in run.cells})
    df = sum(c.df for c in run.cells)
    ratio = (sum(c.ss for c in run.cells) / df) ** 0.5 if df else float("nan")
    return (f"noise of std sigma*C/D on every release of the {len(steps)}-step run on {len(ranks)} ranks{layout} "
            f"({run.label}, sigma={run.sigma:g}, C={run.clip:.4g}, D={run.divisor:g}): std ratio "
            f"{ratio:.3f} over {len(run.cells)} (step, rank) releases, each rank's and each step's own scale within "
            f"its test, no shard's noise repeated on another rank or step ({tests} tests at {alpha:.2g} each; "
            f"detects a std error of {detects:.1%} on the whole run with ~99% probability)"
            + left_out([why for _, why in run.skipped]))


__all__ = ["judged_message", "node_layout_note", "one_run_pass_message",
           "CAUSE_RTOL", "cause", "where", "finding_message", "pooled_message", "pass_message", "LEFT_OUT", "left_out",
           "not_decomposed_message"]


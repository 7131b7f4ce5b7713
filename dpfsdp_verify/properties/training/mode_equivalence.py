"""mode_equivalence: two mode labels (environment sets) give the same norms, gradients, parameters.

DP meaning: a fork's fast path (deferred norms, book-keeping, flash) is only as private as the
slow path it claims to equal; if they differ, at most one of them clips and noises what the
analysis assumes -- and users pick the fast one.

The first label of ``modes`` is the baseline; each other label is compared with it on the same
specs (noise 0, clipping active, several steps so state carried between steps is compared too: 6 on
the mlp, 2 on the transformer; the fuzzer draws 2). The
message says which output differs first (norms, then gradient, then parameters), by how much, and
which mode's norms match the float64 reference. A mode whose run hangs or crashes gets that as the
verdict (``hang``/``deadlock``, ``hang``/``timeout`` or ``error``/``rank_crash``), naming the mode.

Without ``--mode-env`` (or with one) the pair is built in (``default_pair``): the same logical
steps computed unsplit and in physical batches of ``PHYSICAL_BATCH`` samples (the param
``physical_batch_size`` p; gradient accumulation, ``RunSpec.physical_batch_size``), under the same
environment. Local batches are ``2p + 1`` samples (``pair_local_batch``), three passes per step
split as opacus splits (numpy's ``array_split``): [2, 2, 1] at p = 2, two full passes and a last
one shorter than p, so a fork that mishandles a short last pass (drops it, clips or normalises it
apart) is seen as well as one that mishandles full passes (for any p >= 2 some pass is short).
Accumulation must not change the DP step: every sample clipped on its own in its pass, noise
once per logical step, the ``"mean"`` divisor the expected logical batch. Norms, gradients and
parameters are compared at noise 0 as above; a second run of one step at noise multiplier 1
compares the noise each mode released (noised minus clean gradient of step 0): identical draws
pass (the same generator consumed the same way); otherwise the variances are compared
(``log(var_b / var_a)`` is ~N(0, 4/n) for n coordinates under equal variances; fail at |z| >
``NOISE_Z``, false alarm < 1e-6): noise added at every pass triples the variance over three
passes (z ~ log 3 / sqrt(4/n) +- 1: ~5.5 on the mlp's 99 coordinates, caught about 7 times in
10; ~16 on the transformer's 827, always caught). At Poisson points (the ``poisson`` sampling axis)
the pair runs, once per world size (the first model), Poisson rounds (``POISSON_PAIR``, or the
options' q and dataset size; ``poisson_pair_spec``) with one sampling seed in both modes at noise
0: only there can a ``"mean"`` divisor taken from the batch actually drawn differ from the expected
logical batch. Both modes must take the same rounds. ``--mode-env`` labels get that case only when
Poisson sampling is selected (``--sampling poisson``).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

from ...lazy import torch

from ...config.modes import Mode
from ...targets import RunSpec
from ...verdict import Verdict
from ..analysis.clipfit import COEF_TOL, recover_clip_coefficients, with_picked_clip
from ..analysis.compare import (fmt, max_rel_diff, norm_ratios, processed_indices, reference_norms, tensors_close,
                                tolerance)
from ..engine.contract import Case, FuzzRecipe, Outputs, Point, Property

STEPS = 2
#: steps per model in the gate's cases: a mode that goes wrong only after a warm-up (a cache filled
#: over the first steps) is seen on the mlp (cheap) if it starts by step index 5
CASE_STEPS = {"mlp": 6}
#: the built-in pair's physical batch: local batches of 5 (``pair_local_batch``) run in passes [2, 2, 1]
PHYSICAL_BATCH = 2
#: |z| beyond which the two modes' noise variances differ (two-sided p ~ 1e-6)
NOISE_Z = 4.89
#: the built-in pair's Poisson case (once per world size): q, samples per rank, steps (one epoch).
#: 16 per rank at q = 1/4: expected local batch 4 (two passes at p = 2), a realised global batch
#: that differs from the expected one in some step of four except with probability < 0.003, and an
#: empty round (which a Poisson sampler may skip) in ~4% of runs at one rank
POISSON_PAIR = (0.25, 16, 4)


def default_pair(mode: Mode, params: Dict) -> Tuple[Mode, Mode]:
    """Unsplit vs physical batches of ``params["physical_batch_size"]`` (default ``PHYSICAL_BATCH``),
    under ``mode``'s environment. ``ValueError`` for a physical batch that is not an int >= 1."""
    p = params.get("physical_batch_size", PHYSICAL_BATCH)
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"mode_equivalence: physical_batch_size must be an int >= 1 (samples per physical "
                         f"pass of the built-in pair), got {p!r}")
    name = f"physical_batches_{p}"
    base = Mode(mode.label if mode.env else "unsplit", mode.env, mode.spec)
    split = Mode(f"{mode.label}+{name}" if mode.env else name, mode.env,
                 tuple(sorted({**dict(mode.spec), "physical_batch_size": p}.items())))
    return base, split


def pair_local_batch(p: int) -> int:
    """The built-in pair's local batch at physical batch ``p``: ``2p + 1``, three passes per step --
    two as full as an even split allows and, for p >= 2, passes shorter than p (a last physical
    batch that is a remainder is where a fork's accumulation loop is most often wrong)."""
    return 2 * p + 1


def prepare(spec: RunSpec, planning: bool = False) -> RunSpec:  # always a spec: never a reason to skip (``Prepared``)
    return with_picked_clip(spec, planning=planning)


def poisson_pair_spec(point: Point) -> RunSpec:
    """The Poisson case's spec (``POISSON_PAIR`` unless the options give q or the dataset size):
    DP-SGD's own sampling, the same sampling seed in both modes (``same`` seeding by default: every
    rank's local batch has the same size, so the ranks run equally many passes), noise 0. Fixed
    batches always hold the expected logical batch; only here can a ``"mean"`` divisor taken from
    the batch actually drawn differ from the expected one (one sample's presence would then change
    every other sample's weight)."""
    q, per_rank, steps = POISSON_PAIR
    o = point.options
    return prepare(point.spec(sampling="poisson", sample_rate=o.sample_rate or q,
                              dataset_size=o.dataset_size or per_rank * point.world_size, epochs=1, steps=steps,
                              seeding=point.seeding or "same", sampling_seed=point.poisson_seed()),
                   point.planning)


def cases(point: Point):
    steps = CASE_STEPS.get(point.model, STEPS)
    p = next((v for m in point.modes for k, v in m.spec if k == "physical_batch_size"), None)
    if point.sampling == "poisson":
        # one Poisson case per world size (the first model, reduction, dtype): for the built-in pair
        # always, for --mode-env labels when Poisson sampling is selected
        if (p or point.options.samplings is not None) and point.first_of_axes(PROPERTY.models, PROPERTY.reductions,
                                                                               PROPERTY.dtypes):
            yield point.case(poisson_pair_spec(point), doing="the same Poisson rounds under each mode")
        return
    if p:  # the built-in pair: local batches with a short last pass, and one noised step
        spec = prepare(point.spec(steps=steps, global_batch_size=pair_local_batch(p) * point.world_size),
                       point.planning)
        yield point.case(spec, specs=(spec, spec.with_(steps=1, noise_multiplier=1.0)),
                         doing="the same logical steps unsplit and in physical batches")
        return
    spec = prepare(point.spec(steps=steps, global_batch_size=4 * point.world_size), point.planning)
    yield point.case(spec, doing="the same steps under each mode")


def judge(case: Case, runs: Outputs) -> Verdict:
    spec, ws = case.spec, case.world_size
    base, other = case.modes
    a, b = runs[0][0], runs[1][0]
    rtol, atol = tolerance(spec.dtype)
    evidence: Dict[str, float] = {}
    problem = None
    taken = (len(a[0].steps), len(b[0].steps))
    if taken[0] != taken[1]:  # Poisson rounds a sampler skipped in one mode only
        problem = f"the modes took {taken[0]} and {taken[1]} steps of the same sampling seed"
    for k in range(min(spec.steps, *taken)):
        if problem:
            break
        for r in range(ws):
            sa, sb = a[r].steps[k], b[r].steps[k]
            if list(sa.indices) != list(sb.indices):
                problem = f"step {k}, rank {r}: the modes processed different samples"
            elif (sa.norms is None) != (sb.norms is None):
                problem = f"step {k}, rank {r}: only one mode reports norms"
            elif sa.norms is not None and sb.norms is not None:  # both or neither, by the check above
                d = (sa.norms - sb.norms).abs()
                if not bool((d <= atol + rtol * sa.norms.abs()).all()):  # NaN is never equal
                    rel = float((d / sa.norms.abs().clamp_min(1e-300)).max())
                    evidence["norm_rel_diff"] = rel
                    problem = (f"per-sample norms differ at step {k} on rank {r} by up to {fmt(rel)} relative"
                               + _who_matches(case, sa, sb, k))
            if problem is None and not tensors_close(sb.gradient, sa.gradient, rtol, atol):
                err, name = max_rel_diff(sb.gradient, sa.gradient)
                evidence["grad_rel_diff"] = err
                problem = (f"gradients differ at step {k} on rank {r} by up to {fmt(err)} relative (worst {name!r})"
                           + (_short_pass_note(case, a, b, r) if k == 0 else ""))
            if problem is None and not tensors_close(sb.parameters, sa.parameters, rtol, atol):
                err, name = max_rel_diff(sb.parameters, sa.parameters)
                evidence["param_rel_diff"] = err
                problem = f"parameters differ after step {k} on rank {r} by up to {fmt(err)} relative (worst {name!r})"
            if problem:
                break
        if problem:
            break
    noise_note = ""
    if problem is None and len(runs[0]) > 1:
        problem, noise_note = _noise_problem(runs[0][1][0].steps[0].gradient, a[0].steps[0].gradient,
                                             runs[1][1][0].steps[0].gradient, b[0].steps[0].gradient, evidence)
    if problem:
        return case.verdict("fail", "mismatch", f"modes {base.label!r} ({base.describe_env()}) and {other.label!r} "
                            f"({other.describe_env()}) are not equivalent at world_size={ws}: {problem}.", evidence)
    drawn = (f" (Poisson rounds at q = {spec.sample_rate:g}, {taken[0]} taken: the same draws in both)"
             if spec.poisson else "")
    return case.verdict("pass", None, f"modes {base.label!r} and {other.label!r} give the same norms, gradients and "
                        f"parameters over {min(spec.steps, *taken)} steps at world_size={ws}{drawn}{noise_note}",
                        evidence)


def _noise_problem(noised_a, clean_a, noised_b, clean_b, evidence) -> Tuple[Optional[str], str]:
    """Compare the noise each mode released in one step (noised minus clean gradient): ``(problem,
    note for a pass)``."""
    na = torch.cat([(noised_a[n] - clean_a[n]).reshape(-1) for n in sorted(clean_a)])
    nb = torch.cat([(noised_b[n] - clean_b[n]).reshape(-1) for n in sorted(clean_b)])
    scale = float(na.abs().max())
    if scale > 0 and float((na - nb).abs().max()) <= 1e-9 * scale:
        return None, "; with noise on, both modes released the same noise draw (noise once per logical step)"
    n = na.numel()
    va, vb = float(na.pow(2).mean()), float(nb.pow(2).mean())
    z = math.log(vb / va) / math.sqrt(4.0 / n) if va > 0 and vb > 0 else float("inf")
    evidence.update({"noise_std_ratio": math.sqrt(vb / va) if va > 0 else float("inf"), "noise_z": z})
    if not abs(z) <= NOISE_Z:  # NaN fails
        return ("with noise on, the noise released in one logical step has std ratio "
                f"{fmt(math.sqrt(vb / va)) if va > 0 else 'inf'} "
                f"(second mode / first, over {n} coordinates, z = {fmt(z)}): accumulation must add the noise once per "
                "logical step with the same std (noise at every physical pass multiplies its variance by the number "
                "of passes: more noise than the accountant assumes -- a utility loss; less is a privacy loss)"), ""
    return None, (f"; with noise on, the modes drew different noise whose std ratio {fmt(math.sqrt(vb / va))} "
                  f"is within chance (|z| = {fmt(abs(z))} <= {NOISE_Z}, {n} coordinates)")


def _short_pass_note(case: Case, a, b, rank: int) -> str:
    """For the built-in pair, gradients differing at step 0: whether the samples whose clip weight
    differs between the modes (recovered from each mode's gradient against the float64 per-sample
    gradients, ``recover_clip_coefficients``) are exactly those of the split mode's physical passes
    shorter than p, with weight 0 there -- a last pass treated as a remainder and dropped. ``""``
    when the pair is not built in or the recovery does not show exactly that."""
    p = dict(case.modes[1].spec).get("physical_batch_size")
    spec = case.spec
    if not p or spec.data_layout != "split":
        return ""
    short, passes = set(), []
    for o in b:
        st = o.steps[0]
        sizes, pos = list(st.physical_batches or []), 0
        passes.append(sizes)
        for m in sizes:
            if 0 < m < p:
                short.update(st.indices[pos:pos + m])
            pos += m
    grads = (a[rank].steps[0].gradient, b[rank].steps[0].gradient)
    if not short or not all(bool(torch.isfinite(t).all()) for g in grads for t in g.values()):
        return ""  # a non-finite gradient has no least-squares reading
    indices = processed_indices(a, 0, spec)
    ra, rb = (recover_clip_coefficients(spec, indices, g) for g in grads)
    tol = COEF_TOL.get(spec.dtype, COEF_TOL["float64"])
    seen = ra.identifiable & rb.identifiable
    if ra.residual > ra.residual_bound(tol) or rb.residual > rb.residual_bound(tol) \
            or not all(bool(seen[indices.index(i)]) for i in short):
        return ""
    differ = {i for i, ok, x, y in zip(indices, seen.tolist(), ra.coefficients.tolist(), rb.coefficients.tolist())
              if ok and abs(y - x) > tol * max(1.0, abs(x))}
    if differ != short:
        return ""
    if not bool((rb.coefficients[[indices.index(i) for i in sorted(short)]].abs() <= tol).all()):
        return ""
    return (f"; the clip weights recovered from the two step-0 gradients differ on exactly the {len(short)} "
            f"sample(s) of the physical passes shorter than p = {p} (passes per rank {passes}), which count for "
            "nothing in the split step: the short last pass's gradient is dropped, so samples drawn into the "
            "batch are accounted for but never trained on")


def _who_matches(case: Case, sa, sb, step: int) -> str:
    if step != 0:
        return ""
    ref = reference_norms(case.spec)[list(sa.indices)]
    ok = [m.label for m, s in zip(case.modes, (sa, sb))
          if bool(((s.norms - ref).abs() <= 1e-9 * ref.abs() + 1e-12).all())]
    if len(ok) == 1:
        bad, s = (case.modes[1], sb) if ok[0] == case.modes[0].label else (case.modes[0], sa)
        ratio = norm_ratios(s.norms.to(torch.float64), ref)
        return (f"; mode {ok[0]!r} matches the float64 reference, mode {bad.label!r} does not (ratio to the "
                f"reference {float(ratio.min()):.4g}..{float(ratio.max()):.4g})")
    if not ok:
        return "; neither mode matches the float64 reference (see norm_fidelity)"
    return ""


PROPERTY = Property(
    id="mode_equivalence",
    meaning=("two modes that claim to be equivalent (e.g. deferred vs immediate norms) clip and update "
             "identically; otherwise at most one of them is the mechanism the privacy analysis describes"),
    cases=cases, judge=judge, models=("mlp", "transformer"), layouts=("split",), reductions=("mean",),
    # fixed points: the built-in pair's (or the labels') cases; Poisson points: one case per world size
    samplings=("fixed", "poisson"),
    compares_modes=True, default_pair=default_pair, params=(("physical_batch_size", PHYSICAL_BATCH),),
    # like clipped_step, over 2 steps (state carried between steps is compared too)
    fuzz=FuzzRecipe(draw=(("layouts", ("split",)), ("min_global_batch", 2), ("steps", STEPS),
                          ("reduction_values", ("mean",))), prepare=prepare))


__all__ = ["STEPS", "CASE_STEPS", "PHYSICAL_BATCH", "NOISE_Z", "POISSON_PAIR", "default_pair", "pair_local_batch",
           "prepare", "poisson_pair_spec", "cases", "judge", "PROPERTY"]

"""norm_fidelity: the per-sample norms a target clips with equal the reference, in each data layout.

DP meaning: the clip coefficient ``min(1, C/||g_i||)`` bounds each sample's influence only if
``||g_i||`` is that sample's true gradient norm. Inflated norms over-clip (utility lost, silently);
under-counted norms under-clip (a sample can contribute more than C: the privacy guarantee is void).

Each rank reports, per step, the global indices it processed and the norms it clipped them with;
they are compared with float64 per-sample norms of the same samples on one process. A failure is
explained by testing the known bug shapes against the numbers, in this order:

* ``sqrt_n_inflation`` -- every norm is sqrt(N) times the truth: complete norms all-reduced (SUM
  of norm^2) across N ranks that each already held the whole sample;
* ``sample_mixing`` -- on split data, each reported norm is the root-sum-square of the true norms
  of the samples at the same position on every rank: norm^2 all-reduced across ranks holding
  *different* samples;
* ``undercount`` -- every reported norm is below the truth (e.g. computed over the local parameter
  shard only; the message says when the ranks' squares add up to the truth);
* ``mismatch`` -- anything else (wrong samples, wrong shapes, unexplained values).
"""

from __future__ import annotations

import math

import torch

from ..verdict import Verdict
from .compare import fmt, reference_norms, tolerance
from .contract import Case, FuzzRecipe, Outputs, Point, Property

#: diagnosis hypotheses are judged with a looser tolerance than pass/fail: they only name a cause
HYPOTHESIS_RTOL = 1e-6


def cases(point: Point):
    yield point.case(point.spec(global_batch_size=4 * point.world_size, max_grad_norm=1.0), doing="per-sample norms")


def judge(case: Case, runs: Outputs) -> Verdict:
    """The verdict for one case from every rank's ``RankOutput`` (step 0)."""
    spec, ws, outputs = case.spec, case.world_size, runs[0][0]
    rtol, atol = tolerance(spec.dtype)
    ref = reference_norms(spec)
    steps = [o.steps[0] if o.steps else None for o in outputs]
    for r, s in enumerate(steps):
        if s is None:
            return case.verdict("fail", "mismatch", f"rank {r} reported no step at all", {})
        if s.norms is None:
            return case.verdict("skip", None, "the target does not report the per-sample norms it clips with "
                                "(StepOutput.norms is None); nothing to compare")
        want = spec.rank_indices(0, r, ws)
        if list(s.indices) != list(want):
            return case.verdict("fail", "mismatch", f"rank {r} processed samples {list(s.indices)} but the "
                                f"{spec.data_layout} layout gives it {want}: it reads the data wrongly, so its "
                                "norms belong to other samples", {"rank": r, "indices": list(s.indices)})
        if s.norms.numel() != len(s.indices):
            return case.verdict("fail", "mismatch", f"rank {r} reported {s.norms.numel()} norms for "
                                f"{len(s.indices)} samples", {"rank": r})
    got = [s.norms.to(torch.float64).reshape(-1) for s in steps]
    want = [ref[list(s.indices)] for s in steps]
    err = [(g - w).abs() - (atol + rtol * w.abs()) for g, w in zip(got, want)]
    ratios = torch.cat([g / w for g, w in zip(got, want)])
    evidence = {"max_abs_error": max(float((g - w).abs().max()) for g, w in zip(got, want)),
                "ratio_min": float(ratios.min()), "ratio_max": float(ratios.max()),
                "mean_ratio": float(ratios.mean()),
                "rtol": rtol, "atol": atol}
    if all(bool((e <= 0).all()) for e in err):
        return case.verdict("pass", None, f"per-sample norms equal the float64 reference on all {ws} rank(s) "
                            f"(max abs error {fmt(evidence['max_abs_error'])})", evidence)
    return case.verdict("fail", *diagnose(case, got, want, steps, ratios), evidence)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a - b).abs() <= HYPOTHESIS_RTOL * b.abs() + 1e-12).all())


def diagnose(case: Case, got, want, steps, ratios):
    """``(diagnosis, message)`` for norms that do not match."""
    ws, layout = case.world_size, case.spec.data_layout
    where = f"at world_size={ws} ({layout} data)"
    sq = math.sqrt(ws)
    if ws > 1 and _close(ratios, torch.full_like(ratios, sq)):
        return "sqrt_n_inflation", (
            f"per-sample norms inflated by sqrt({ws}) = {sq:.4g} {where}: norms (their squares) all-reduced "
            "across ranks although each rank's norm is already complete (FSDP un-shards parameters for "
            "backward). Clipping then uses norms sqrt(N) too large: every sample is over-clipped.")
    lengths = {len(g) for g in got}
    if ws > 1 and layout == "split" and len(lengths) == 1:
        n = lengths.pop()
        mixed = torch.sqrt(sum(w.pow(2) for w in want))  # position-wise root-sum-square over ranks
        if n and all(_close(g, mixed) for g in got):
            r0 = f"{float(got[0][0]):.4g}"
            return "sample_mixing", (
                f"per-sample norms mix different samples {where}: rank 0's norm of sample "
                f"{steps[0].indices[0]} is {r0}, the root-sum-square of the true norms of samples "
                f"{[s.indices[0] for s in steps]} (position 0 on each rank), not its own "
                f"{float(want[0][0]):.4g}. Norm^2 is all-reduced across ranks that hold different samples; "
                "each sample is clipped by other samples' norms.")
    if bool((ratios < 1).all()):
        note = ""
        if layout == "replicated" and ws > 1 and len({len(g) for g in got}) == 1:
            if _close(torch.sqrt(sum(g.pow(2) for g in got)), want[0]):
                note = (" The ranks' squared norms add up to the true ones: each rank's norm covers only its "
                        "local parameter shard.")
        return "undercount", (
            f"per-sample norms undercount the true norms {where}: ratio reported/true between "
            f"{float(ratios.min()):.4g} and {float(ratios.max()):.4g}.{note} Clipping with too small a norm "
            "lets a sample contribute more than C: a privacy violation.")
    if bool((ratios > 1).all()):
        k = float(ratios.mean())
        kind = f"inflated (ratio {float(ratios.min()):.4g}..{float(ratios.max()):.4g})"
        if _close(ratios, torch.full_like(ratios, k)):
            kind = f"inflated by a constant factor {k:.4g}"
        return "mismatch", (f"per-sample norms {kind} {where}: every sample is over-clipped (utility loss).")
    worst = max(range(len(got)), key=lambda r: float(((got[r] - want[r]).abs() / want[r]).max()))
    return "mismatch", (f"per-sample norms differ from the reference {where}: ratio reported/true between "
                        f"{float(ratios.min()):.4g} and {float(ratios.max()):.4g} (worst on rank {worst}), "
                        "some above and some below the truth.")


PROPERTY = Property(
    id="norm_fidelity",
    meaning=("the per-sample norms the target clips with are the true per-sample gradient norms; if not, "
             "clipping does not bound each sample's influence by C (privacy) or over-clips (utility)"),
    cases=cases, judge=judge, models=("mlp", "transformer"), layouts=("replicated", "split"),
    reductions=("mean", "sum"), dtypes=("float64", "float32"),
    # any shape, layout, reduction and global batch, one step
    fuzz=FuzzRecipe())

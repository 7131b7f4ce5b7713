"""mode_equivalence: two mode labels (environment sets) give the same norms, gradients, parameters.

DP meaning: a fork's fast path (deferred norms, book-keeping, flash) is only as private as the
slow path it claims to equal; if they differ, at most one of them clips and noises what the
analysis assumes -- and users pick the fast one.

The first label of ``modes`` is the baseline; each other label is compared with it on the same
specs (noise 0, clipping active, two steps so state carried between steps is compared too). The
message says which output differs first (norms, then gradient, then parameters), by how much, and
which mode's norms match the float64 reference. A mode whose run hangs or crashes gets that as the
verdict (``hang``/``deadlock``, ``hang``/``timeout`` or ``error``/``rank_crash``), naming the mode.
"""

from __future__ import annotations

from typing import Dict

from ..targets import RunSpec
from ..verdict import Verdict
from .compare import fmt, max_rel_diff, pick_clip_bound, reference_norms, tensors_close, tolerance
from .contract import Case, FuzzRecipe, Outputs, Point, Prepared, Property

STEPS = 2


def prepare(spec: RunSpec) -> Prepared:
    return spec.with_(max_grad_norm=pick_clip_bound(spec) or 1.0)


def cases(point: Point):
    spec = point.spec(steps=STEPS, global_batch_size=4 * point.world_size)
    yield point.case(prepare(spec), doing="the same steps under each mode")


def judge(case: Case, runs: Outputs) -> Verdict:
    spec, ws = case.spec, case.world_size
    base, other = case.modes
    a, b = runs[0][0], runs[1][0]
    rtol, atol = tolerance(spec.dtype)
    evidence: Dict[str, float] = {}
    problem = None
    for k in range(spec.steps):
        for r in range(ws):
            sa, sb = a[r].steps[k], b[r].steps[k]
            if list(sa.indices) != list(sb.indices):
                problem = f"step {k}, rank {r}: the modes processed different samples"
            elif (sa.norms is None) != (sb.norms is None):
                problem = f"step {k}, rank {r}: only one mode reports norms"
            elif sa.norms is not None:
                d = (sa.norms - sb.norms).abs()
                if not bool((d <= atol + rtol * sa.norms.abs()).all()):  # NaN is never equal
                    rel = float((d / sa.norms.abs().clamp_min(1e-300)).max())
                    evidence["norm_rel_diff"] = rel
                    problem = (f"per-sample norms differ at step {k} on rank {r} by up to {fmt(rel)} relative"
                               + _who_matches(case, sa, sb, k))
            if problem is None and not tensors_close(sb.gradient, sa.gradient, rtol, atol):
                err, name = max_rel_diff(sb.gradient, sa.gradient)
                evidence["grad_rel_diff"] = err
                problem = f"gradients differ at step {k} on rank {r} by up to {fmt(err)} relative (worst {name!r})"
            if problem is None and not tensors_close(sb.parameters, sa.parameters, rtol, atol):
                err, name = max_rel_diff(sb.parameters, sa.parameters)
                evidence["param_rel_diff"] = err
                problem = f"parameters differ after step {k} on rank {r} by up to {fmt(err)} relative (worst {name!r})"
            if problem:
                break
        if problem:
            break
    if problem:
        return case.verdict("fail", "mismatch", f"modes {base.label!r} ({base.describe_env()}) and {other.label!r} "
                            f"({other.describe_env()}) are not equivalent at world_size={ws}: {problem}.", evidence)
    return case.verdict("pass", None, f"modes {base.label!r} and {other.label!r} give the same norms, gradients and "
                        f"parameters over {spec.steps} steps at world_size={ws}", evidence)


def _who_matches(case: Case, sa, sb, step: int) -> str:
    if step != 0:
        return ""
    ref = reference_norms(case.spec)[list(sa.indices)]
    ok = [m.label for m, s in zip(case.modes, (sa, sb))
          if bool(((s.norms - ref).abs() <= 1e-9 * ref.abs() + 1e-12).all())]
    if len(ok) == 1:
        bad, s = (case.modes[1], sb) if ok[0] == case.modes[0].label else (case.modes[0], sa)
        ratio = s.norms / ref
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
    compares_modes=True,
    # like clipped_step, over 2 steps (state carried between steps is compared too)
    fuzz=FuzzRecipe(draw=(("layouts", ("split",)), ("min_global_batch", 2), ("steps", STEPS),
                          ("reduction_values", ("mean",))), prepare=prepare))

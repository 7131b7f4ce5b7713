"""mode_equivalence: two mode labels (environment sets) give the same norms, gradients, parameters.

DP meaning: a fork's fast path (deferred norms, book-keeping, flash) is only as private as the
slow path it claims to equal; if they differ, at most one of them clips and noises what the
analysis assumes -- and users pick the fast one.

The first label of ``modes`` is the baseline; each other label is compared with it on the same
specs (noise 0, clipping active, two steps so state carried between steps is compared too). The
message says which output differs first (norms, then gradient, then parameters), by how much, and
which mode's norms match the float64 reference. A mode whose run hangs or crashes gets that as the
verdict (``hang``/``deadlock`` or ``error``/``rank_crash``), naming the mode.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence


from ..harness import Pool
from ..targets import RunSpec
from ..verdict import Verdict
from .clipped_step import pick_clip_bound
from .common import Case, fmt, max_rel_diff, reference_norms, run_cases, tensors_close, tolerance

ID = "mode_equivalence"
MEANING = ("two modes that claim to be equivalent (e.g. deferred vs immediate norms) clip and update "
           "identically; otherwise at most one of them is the mechanism the privacy analysis describes")

DEFAULT_MODELS = ("mlp", "transformer")
DEFAULT_LAYOUTS = ("split",)
DEFAULT_REDUCTIONS = ("mean",)
STEPS = 2


def check(target_ref: str, *, pool: Optional[Pool] = None, world_sizes: Sequence[int] = (1, 2),
          modes: Optional[Dict[str, Dict[str, str]]] = None, grad_sample_mode: str = "ghost_fsdp",
          models: Optional[Sequence[str]] = None, data_layouts: Optional[Sequence[str]] = None,
          reductions: Optional[Sequence[str]] = None, dtype: str = "float64", backend: str = "gloo",
          timeout: float = 60.0) -> List[Verdict]:
    modes = dict(modes or {"default": {}})
    labels = list(modes)
    verdicts: List[Verdict] = []
    pairs: List[tuple] = []
    cases, specs = [], []
    for ws in world_sizes:
        for model in models or DEFAULT_MODELS:
            for layout in data_layouts or DEFAULT_LAYOUTS:
                for red in reductions or DEFAULT_REDUCTIONS:
                    spec = RunSpec(model=model, data_layout=layout, reduction=red, dtype=dtype, steps=STEPS,
                                   grad_sample_mode=grad_sample_mode, global_batch_size=4 * ws)
                    spec = spec.with_(max_grad_norm=pick_clip_bound(spec) or 1.0)
                    if len(labels) < 2:
                        c = Case(ID, target_ref, spec, ws, labels[0], dict(modes[labels[0]]), backend)
                        verdicts.append(c.verdict("skip", None, "mode_equivalence needs at least two mode labels "
                                                  "(--mode-env LABEL:VAR=VAL twice)"))
                        continue
                    first = len(cases)
                    for label in labels:
                        cases.append(Case(ID, target_ref, spec, ws, label, dict(modes[label]), backend))
                        specs.append([spec])
                    pairs += [(first, first + i) for i in range(1, len(labels))]
    outcomes = run_cases(cases, specs, pool, timeout, what="the same steps under each mode")
    for a, b in pairs:
        verdicts.append(judge(cases[a], cases[b], outcomes[a], outcomes[b]))
    return verdicts


def judge(base: Case, other: Case, out_a, out_b) -> Verdict:
    spec, ws = base.spec, base.world_size
    label = f"{base.mode} vs {other.mode}"
    pair = Case(ID, base.target_ref, spec, ws, base.mode, dict(base.env), base.backend,
                seconds=base.seconds + other.seconds)
    extra = [(other.mode, other.env)]  # the repro names both modes' environments
    for c, o in ((base, out_a), (other, out_b)):
        if isinstance(o, Verdict):
            v = pair.verdict(o.status, o.diagnosis, f"mode {c.mode!r} ({_env(c.env)}) did not complete: {o.message}",
                             dict(o.evidence, failed_mode=c.mode), details=o.details, extra_modes=extra)
            v.config["mode"] = label
            return v
    a, b = out_a[0], out_b[0]
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
                if bool((d > atol + rtol * sa.norms.abs()).any()):
                    rel = float((d / sa.norms.abs().clamp_min(1e-300)).max())
                    evidence["norm_rel_diff"] = rel
                    problem = (f"per-sample norms differ at step {k} on rank {r} by up to {fmt(rel)} relative"
                               + _who_matches(base, other, sa, sb, spec, k))
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
        v = pair.verdict("fail", "mismatch", f"modes {base.mode!r} ({_env(base.env)}) and {other.mode!r} "
                         f"({_env(other.env)}) are not equivalent at world_size={ws}: {problem}.", evidence,
                         extra_modes=extra)
    else:
        v = pair.verdict("pass", None, f"modes {base.mode!r} and {other.mode!r} give the same norms, gradients and "
                         f"parameters over {spec.steps} steps at world_size={ws}", evidence, extra_modes=extra)
    v.config["mode"] = label
    return v


def _env(env: Dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(env.items())) or "no env"


def _who_matches(base: Case, other: Case, sa, sb, spec: RunSpec, step: int) -> str:
    if step != 0:
        return ""
    ref = reference_norms(spec)[list(sa.indices)]
    ok = [c.mode for c, s in ((base, sa), (other, sb))
          if bool(((s.norms - ref).abs() <= 1e-9 * ref.abs() + 1e-12).all())]
    if len(ok) == 1:
        bad = other if ok[0] == base.mode else base
        s = sb if bad is other else sa
        ratio = s.norms / ref
        return (f"; mode {ok[0]!r} matches the float64 reference, mode {bad.mode!r} does not (ratio to the "
                f"reference {float(ratio.min()):.4g}..{float(ratio.max()):.4g})")
    if not ok:
        return "; neither mode matches the float64 reference (see norm_fidelity)"
    return ""

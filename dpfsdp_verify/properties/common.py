"""What every property shares: running a target on a worker group, turning a failed group into a
verdict, the float64 reference for a ``RunSpec``, tolerances, config dicts and repro lines.

Data flows one way: ``Case`` (a spec at a world size under a mode) -> ranks (``run_cases``) ->
``RankOutput`` per rank -> the property compares against the reference -> ``Verdict``.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import models, reference
from ..harness import Pool, default_pool
from ..harness.group import BackendUnavailable, GroupResult
from ..targets import RankOutput, RunSpec, run_many_on_rank
from ..verdict import Verdict

#: ``(rtol, atol)`` per dtype for values the target computes with a different evaluation order than
#: the reference (ghost-clipping Gram products, sharded reduce-scatter sums). float64: unit
#: round-off 1.1e-16, sums of <= ~1e3 terms here, so honest differences stay below ~1e-13 relative;
#: 1e-9 keeps 4 orders of margin and is still >= 7 orders below the smallest bug effect the suite
#: names (a factor sqrt(2), a dropped layer). float32: opacus' own per-sample test tolerance.
TOLERANCES = {"float64": (1e-9, 1e-12), "float32": (1e-4, 1e-6), "bfloat16": (2e-2, 1e-3)}

Env = Dict[str, str]


def config_matrix(modes: Optional[Dict[str, Dict[str, str]]], world_sizes: Sequence[int], models: Sequence[str],
                  data_layouts: Sequence[str], reductions: Sequence[str]):
    """Every ``(mode label, env, world_size, model, data_layout, reduction)`` a property's
    arguments select, in report order (``modes=None`` is one unlabelled ``default`` mode)."""
    for label, env in (modes or {"default": {}}).items():
        for ws in world_sizes:
            for model in models:
                for layout in data_layouts:
                    for red in reductions:
                        yield label, dict(env), ws, model, layout, red


def tolerance(dtype: str) -> Tuple[float, float]:
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {', '.join(TOLERANCES)}")
    return TOLERANCES[dtype]


@dataclass
class Case:
    """One configuration a property judges: a spec, at a world size, under a labelled mode."""

    property: str
    target_ref: str
    spec: RunSpec
    world_size: int
    mode: str = "default"
    env: Env = field(default_factory=dict)
    backend: str = "gloo"
    #: wall time of the job(s) this case ran in, shared out among the cases of a job
    seconds: float = 0.0

    def config(self) -> dict:
        return {"world_size": self.world_size, "data_layout": self.layout, "model": self.spec.model,
                "mode": self.mode, "grad_sample_mode": self.spec.grad_sample_mode,
                "reduction": self.spec.reduction}

    @property
    def layout(self) -> str:
        return self.spec.data_layout

    def repro(self, extra_modes: Sequence[Tuple[str, Env]] = ()) -> str:
        """The CLI line that re-runs this property for this model, reduction, world size and mode
        (the CLI has no layout filter: both layouts the property checks are re-run)."""
        parts = ["dpfsdp-verify", "run", "--target", self.target_ref, "--properties", self.property,
                 "--world-sizes", str(self.world_size), "--grad-sample-mode", self.spec.grad_sample_mode,
                 "--models", self.spec.model, "--loss-reductions", self.spec.reduction]
        if self.backend != "gloo":
            parts += ["--backend", self.backend]
        for label, env in [(self.mode, self.env)] + list(extra_modes):
            if env:
                parts += ["--mode-env", f"{label}:" + ",".join(f"{k}={v}" for k, v in sorted(env.items()))]
        return " ".join(shlex.quote(p) for p in parts)

    def verdict(self, status: str, diagnosis: Optional[str] = None, message: str = "", evidence=None,
                seconds: float = 0.0, details: str = "", extra_modes: Sequence[Tuple[str, Env]] = ()) -> Verdict:
        return Verdict(property=self.property, status=status, config=self.config(), diagnosis=diagnosis,
                       message=message, evidence=dict(evidence or {}), repro=self.repro(extra_modes),
                       seconds=round(seconds or self.seconds, 3), details=details)


def failure_verdict(case: Case, res: GroupResult, what: str = "", seconds: float = 0.0, **kw) -> Verdict:
    """A hung or crashed group as this case's verdict (``hang``/``deadlock`` or ``error``/``rank_crash``)."""
    status = "hang" if res.status == "hang" else "error"
    diagnosis = res.diagnosis or ("deadlock" if status == "hang" else "rank_crash")
    lead = f"{what}: " if what else ""
    if status == "hang":
        msg = (f"{lead}the target did not finish under the watchdog ({res.message}). A collective issued by "
               "only some ranks, or in rank-/data-dependent control flow, leaves the others waiting forever.")
    else:
        msg = f"{lead}a rank failed ({res.message})."
    return case.verdict(status, diagnosis, msg, {"harness_status": res.status, "failed_ranks": res.failed_ranks()},
                        seconds=seconds or res.seconds, details=res.details, **kw)


Outcome = Union[List[RankOutput], Verdict]


def run_cases(cases: Sequence[Case], specs_per_case: Sequence[Sequence[RunSpec]], pool: Optional[Pool],
              timeout: float, what: str = "") -> List[Union[List[List[RankOutput]], Verdict]]:
    """Run, for each case, its list of specs; cases sharing (world size, env, backend, target)
    go to the ranks as one job. Returns per case either ``outputs[spec_i][rank]`` or the case's
    failure verdict. A job that *errors* is re-run case by case so the crash lands on the right
    case; a job that *hangs* is not re-run (that would cost a full deadline per case): every case
    in it gets the hang verdict, which says the cases ran together.
    """
    pool = pool or default_pool()
    results: List = [None] * len(cases)
    groups: Dict[tuple, List[int]] = {}
    for i, c in enumerate(cases):
        groups.setdefault((c.world_size, tuple(sorted(c.env.items())), c.backend, c.target_ref), []).append(i)
    for idxs in groups.values():
        _run_group(cases, specs_per_case, idxs, pool, timeout, what, results, allow_split=True)
    return results


def _run_group(cases, specs_per_case, idxs, pool, timeout, what, results, allow_split):
    c0 = cases[idxs[0]]
    flat = [s for i in idxs for s in specs_per_case[i]]
    t0 = time.monotonic()
    try:
        res = pool.run(run_many_on_rank, c0.target_ref, flat, world_size=c0.world_size, backend=c0.backend,
                       env=c0.env or None, timeout=timeout)
    except BackendUnavailable as e:
        for i in idxs:
            results[i] = cases[i].verdict("skip", None, f"backend unavailable: {e}")
        return
    seconds = time.monotonic() - t0
    for i in idxs:
        cases[i].seconds += seconds / len(idxs)
    if res.ok:
        per_rank = res.values()  # [rank][spec]
        pos = 0
        for i in idxs:
            n = len(specs_per_case[i])
            results[i] = [[per_rank[r][pos + j] for r in range(c0.world_size)] for j in range(n)]
            pos += n
        return
    if res.status == "error" and allow_split and len(idxs) > 1:
        for i in idxs:
            _run_group(cases, specs_per_case, [i], pool, timeout, what, results, allow_split=False)
        return
    together = "" if len(idxs) == 1 else f" (ran as one job with {len(idxs) - 1} other configuration(s))"
    for i in idxs:
        results[i] = failure_verdict(cases[i], res, what + together, seconds=seconds / len(idxs))


# -- reference ---------------------------------------------------------------------------------
def reference_model(spec: RunSpec) -> torch.nn.Module:
    return models.build_model(spec.model, spec.model_seed, dtype=torch.float64, **dict(spec.model_kwargs))


def reference_batch(spec: RunSpec, step: int = 0) -> models.Batch:
    """The global batch of ``step`` in float64 (the reference always computes in float64)."""
    return models.make_batch(spec.model, spec.global_batch_size, spec.batch_seed + step, dtype=torch.float64,
                             **dict(spec.model_kwargs))


def reference_norms(spec: RunSpec, step: int = 0) -> torch.Tensor:
    """``[global_batch_size]`` per-sample gradient norms at the initial parameters."""
    g = reference.per_sample_grads(reference_model(spec), reference_batch(spec, step), spec.reduction)
    return reference.per_sample_norms(g)


def processed_indices(outputs: Sequence[RankOutput], step: int, spec: RunSpec) -> List[int]:
    """The global indices that make up the step's batch: every rank's for split data, one copy for
    replicated data (each rank holds all of them)."""
    if spec.data_layout == "replicated" and spec.rank_batches is None:
        return list(range(spec.global_batch_size))
    idx: List[int] = []
    for o in outputs:
        idx += list(o.steps[step].indices)
    return sorted(idx)


def global_loss(outputs: Sequence[RankOutput], step: int, spec: RunSpec) -> float:
    """The batch loss reconstructed from each rank's local loss: a mean of local means weighted by
    local batch size (``mean``) or a sum of local sums (``sum``); any one rank's for replicated data."""
    if spec.data_layout == "replicated" and spec.rank_batches is None:
        return float(outputs[0].steps[step].loss)
    total, n = 0.0, 0
    for o in outputs:
        s = o.steps[step]
        k = len(s.indices)
        if k == 0:
            continue
        total += s.loss * (k if spec.reduction == "mean" else 1)
        n += k
    return total / n if spec.reduction == "mean" else total


def max_rel_diff(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> Tuple[float, str]:
    """``(max over tensors of max|got-want| / max|want|, worst tensor name)``; missing -> inf."""
    worst, name = 0.0, ""
    for n, w in want.items():
        if n not in got:
            return float("inf"), n
        g = got[n].to(torch.float64)
        if g.shape != w.shape:
            return float("inf"), n
        scale = w.abs().max().item()
        d = (g - w).abs().max().item() / max(scale, 1e-300)
        if d > worst:
            worst, name = d, n
    return worst, name


def tensors_close(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], rtol: float, atol: float) -> bool:
    """Every tensor within ``atol + rtol * max|want|`` (a tensor-wise scale: a coordinate near zero
    is judged against its tensor's magnitude, since it is a difference of large terms)."""
    for n, w in want.items():
        g = got.get(n)
        if g is None or g.shape != w.shape:
            return False
        if (g.to(torch.float64) - w).abs().max().item() > atol + rtol * w.abs().max().item():
            return False
    return True


def fmt(x: float) -> str:
    return f"{x:.3g}"

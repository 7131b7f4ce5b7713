"""Every release of a noisy run decomposed into the reference's clipped sum and the noise, and the
noise's statistics, pooled over the runs of a gate run (``releases/judge.py`` collects them).

DP meaning: the Gaussian mechanism's guarantee is for each release ``(sum_i c_i g_i + N(0, (sigma
C)^2 I)) / D`` at every step, on every rank's shard, in whatever dtype, lr and loop shape the user
trains with. The checks that own a run judge what they were built for (a trajectory, a hang, a
resume); the same run is evidence about the noise at every step it released: a noise scale that
depends on the lr, on the dtype, on the world size, on the batch's norms, or changes at step 64,
shows in the first run that exercises it, whoever made that run.

Decomposition (``decompose``), for a run with noise multiplier sigma > 0, at every step t it took
and for each rank r's FSDP shard (dim-0 chunks of every tensor, ``torch.chunk``):

* the released gradient ``g_t`` (what the target reports after the DP step) times D (``spec.divisor``)
  is ``G_t c_t + n_t``: ``G_t`` the float64 reference per-sample gradients of the step's batch at the
  parameters the step started from (the initial model at the first step, else the parameters the
  target itself reported after step t - 1 -- so lr > 0, momentum, a resumed half whose save half is in
  the same case all decompose), ``c_t`` the clip coefficients, ``n_t`` the noise;
* ``c_t`` is not taken from the reference: the released gradient is projected off the span of the
  batch's per-sample gradients (least squares over the B coefficients, B << P coordinates), so the
  noise statistic is ``n_t`` restricted to the (P - B)-dimensional complement -- exactly
  ``(sigma C)^2 chi^2(P - B)`` for correct noise whatever the clip form, and blind to a wrong clip
  coefficient (``clipped_step`` and ``sensitivity_bound`` judge those: a clipping bug is never named
  a noise bug here). Per shard the statistic is ``sum z^2`` with ``z = P_perp n / (sigma C)`` and
  degrees of freedom ``|shard| - sum of the shard's leverages`` (its expectation, exactly), the mean
  ``sum z`` with variance ``|shard| - ||U_shard^T 1||^2`` (exact);
* the raw residual ``D g_t - G_t c_t`` (reference coefficients, opacus' epsilon) is kept for the exact
  checks: the value grid (``grid_fractions``) and repeats (``repeats``).

A run is *decomposable* when it has noise, every step reports its gradient, and the parameters each
step started from are known (lr 0, or the previous step's report, or the case's save half); an
unknown start (a load half without its save half, lr > 0) leaves that step out. bf16 compute
(``bf16-fsdp``, ``bf16-autocast``) decomposes too (its clean sum's ~1e-2 relative rounding is
~1e-5 of the noise's variance on the gate's models), but its value grid is not judged (the rounding
is as coarse as the grids looked for), and a step whose starting parameters put the model beyond
bf16's first-order bound (``precision_bounds.beyond_first_order``: a softmax over logits bf16 rounds
by more than 1, a normalisation over inputs that nearly agree; in float32 a softmax over logits
beyond 1.7e7, once the parameters have moved) is left out: there a correct target's
clean sum is not the reference's to O(u) (gate seed 41100: after 3 steps at lr 0.47 the attention's
logits reached 3e6, bf16 tied two of them, and one sample's clipped backward came out 63 x C).

Statistics (``run_tests``, ``pooled_tests``; thresholds from ``alpha``, the per-test level a gate run's
budget gives): scale per run (two-sided chi-square over all its releases), per step (over its
ranks), per rank (over its steps); the mean per run (two-sided normal). Pooled over runs: all runs,
each dtype/precision, the runs at lr > 0. Deterministic (no alpha): a value grid of 8 (bfloat16) or
11 (float16) significand bits on more than half the values, where continuous noise puts < 5 %
(``GRID_FRACTION``); a (step, rank) shard whose noise equals (or negates) another's to 1e-3 sigma C
on >= ``REPEAT_MIN`` values (two independent Gaussian draws agree that closely with probability
< 1e-25); coordinates released with no noise (``silent``): a raw residual within ``SILENT`` sigma C
of 0 (a Gaussian value that close: probability ``SILENT_P0`` ~ 8e-4), either on too many of one
tensor's (step, rank) shard at once, or on one coordinate at too many of a run's steps, where
"too many" is a count that a correct run reaches with probability < ``SILENT_LEVEL`` (Chernoff
bound of the Binomial tail; over the < 1e6 such counts of a gate run, < 1e-6 in all): a parameter left
out of the noise at some step, or some coordinates from step k on. It is looked for first (exact, and
the cause of any scale finding it comes with). Under bf16 compute the clean sum's rounding (~1e-2 of it) sits
above ``SILENT`` sigma C, so silent coordinates show there only through the scale tests.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ...lazy import torch

from ...lazy import reference
from ...targets import RankOutput, RunSpec
from ..analysis.compare import processed_indices, reference_batch, reference_grads, reference_model, rows, shard_divisor
from ..analysis.memo import Memo
from ..analysis.noise_tails import coarse_grid
from ..analysis.precision_bounds import beyond_first_order, has_softmax
from ..analysis.stats import chi2_two_sided_p, normal_two_sided_p
from .edges import sigma_edge
from .exact import (CLIP_LATITUDE, GRID_FRACTION, GRIDS, REPEAT_EQUAL, REPEAT_MIN, SILENT, SILENT_LEVEL, SILENT_MIN,
                    SILENT_P0, count_on_grid, repeats, silent)
from .signal import signal_terms

#: a batch with more samples than this fraction of the coordinates is not projected (too few left)
MAX_SPAN_FRACTION = 0.5

@dataclass
class Cell:
    """One release of one rank's shard at one step: the projected noise's statistics in units of
    sigma C (``ss`` ~ chi^2(``df``); ``total`` ~ N(0, ``var``))."""

    step: int
    rank: int
    ss: float
    df: float
    total: float
    var: float
    #: min(1, the rank's local batch's largest norm / C) (1 for an empty batch): the factor a noise std
    #: tied to the batch's largest clipped norm would carry here (a cause ``run_tests`` can name)
    own_max: float = 1.0


@dataclass
class RunReleases:
    """Everything ``decompose`` keeps of one noisy run (small: no tensors)."""

    dtype: str
    precision: str
    world_size: int
    lr: float
    momentum: float
    sigma: float
    clip: float
    divisor: float
    sampling: str
    physical_batch_size: int
    phase: str
    cells: List[Cell] = field(default_factory=list)
    #: grid name -> (values on it, values tested)
    grids: Dict[str, Tuple[int, int]] = field(default_factory=dict)
    #: noise on a coarse grid (``noise_tails.coarse_grid`` of the raw residuals, units of sigma C)
    coarse: Optional[Tuple[int, int, float, float]] = None
    #: ``(step a, rank a, step b, rank b, negated, values)`` of the first repeat found
    repeat: Optional[Tuple[int, int, int, int, bool, int]] = None
    #: silent coordinates (``silent``): ``(tensor, rank, steps, silent coordinates of the tensor's
    #: shard, its coordinates, other tensors with some, ranks with some)`` of the rank and tensor with the most
    silent: Optional[Tuple[str, int, Tuple[int, ...], int, int, Tuple[str, ...], Tuple[int, ...]]] = None
    #: steps left out, and why (an unknown starting point)
    skipped: List[Tuple[int, str]] = field(default_factory=list)
    #: the run's first step (k for the ``load`` half of a run resumed after step k, else 0)
    first_step: int = 0
    #: ``(step, rank)`` of the releases whose local batch was empty (a Poisson round, an empty split)
    empty: List[Tuple[int, int]] = field(default_factory=list)
    #: sum over steps of <release x D, clean sum> and of |clean sum|^2, in (sigma C)^2: ``releases/signal.py``
    signal: Tuple[float, float] = (0.0, 0.0)

    @property
    def label(self) -> str:
        bits = [self.dtype + ("" if self.precision == "fp32" else f" ({self.precision})"), f"lr {self.lr:g}",
                f"world_size={self.world_size}"]
        if self.momentum:
            bits.append(f"momentum {self.momentum:g}")
        bits += ["Poisson"] if self.sampling == "poisson" else []
        bits += [f"physical batches of {self.physical_batch_size}"] if self.physical_batch_size else []
        if self.phase:
            bits.append(f"{self.phase} half of a resumed run")
        return ", ".join(bits)


def _row_chunks(shapes: Sequence[torch.Size], ws: int):
    """``(tensor position, rank, its rows, coordinates per row, the tensor's flat offset)`` for every
    non-empty dim-0 chunk of every tensor (``torch.chunk``, FSDP2's sharding; a 0-dim tensor is one row)."""
    offset = 0
    for i, shape in enumerate(shapes):
        rows_ = shape[0] if len(shape) else 1
        per_row = math.prod(shape[1:]) if len(shape) > 1 else 1
        for r, chunk in enumerate(torch.arange(rows_).chunk(ws)):
            if r < ws and len(chunk):
                yield i, r, chunk, per_row, offset
        offset += rows_ * per_row


def shard_index(shapes: Sequence[torch.Size], ws: int) -> List[torch.Tensor]:
    """Each rank's coordinates in the flat vector of ``shapes`` (in order): its dim-0 chunk of every
    tensor (``torch.chunk``, FSDP2's sharding; a 0-dim tensor is one row)."""
    out: List[List[torch.Tensor]] = [[] for _ in range(ws)]
    for _, r, chunk, per_row, offset in _row_chunks(shapes, ws):
        out[r].append((offset + chunk[:, None] * per_row + torch.arange(per_row)[None, :]).reshape(-1))
    return [torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long) for parts in out]


def _start_params(spec: RunSpec) -> Dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in reference_model(spec).named_parameters()}


def _columns(spec: RunSpec, step: int, indices: List[int], params: Optional[Dict[str, torch.Tensor]],
             names: List[str]) -> torch.Tensor:
    """``[P, B]`` float64 per-sample gradients of the step's batch, in ``names`` order: at the
    initial model (cached by ``compare.reference_grads``) when ``params`` is ``None``."""
    if not indices:
        return torch.zeros(0, 0, dtype=torch.float64)
    if params is None:
        grads = rows(reference_grads(spec, step), indices)
    else:
        model = copy.deepcopy(reference_model(spec))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in params:
                    p.copy_(params[n])
        batch = reference_batch(spec, step).select(indices)
        grads = reference.per_sample_grads(model, batch, spec.reduction)
    return torch.cat([grads[n].reshape(len(indices), -1).to(torch.float64) for n in names], dim=1).T


_SPAN_CACHE: "Memo[Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]" = Memo(64)


def _span(spec: RunSpec, step: int, indices: List[int], params, names: List[str], numel: int):
    """``(clean sum, U, norms)``: the reference's clipped sum ``G c`` and an orthonormal basis of the span of
    the batch's per-sample gradients ``G`` (``[P, rank]``), or ``None`` for a batch too large to
    project off (``MAX_SPAN_FRACTION``). At the initial model (``params`` ``None``: lr 0 runs, whose
    repeats share batches) cached: callers must not modify them."""
    if indices and len(indices) > MAX_SPAN_FRACTION * numel:
        return None
    if params is not None:
        return _span_of(spec, step, indices, params, names, numel)
    key = (spec.model, spec.model_seed, spec.batch_seed, spec.reduction, spec.model_kwargs, spec.poisson,
           spec.dataset_size if spec.poisson else spec.global_batch_size, step, tuple(indices),
           spec.max_grad_norm, tuple(names))
    return _SPAN_CACHE.get(key, lambda: _span_of(spec, step, indices, params, names, numel))


def _span_of(spec: RunSpec, step: int, indices: List[int], params, names: List[str], numel: int):
    g = _columns(spec, step, indices, params, names)
    norms = g.pow(2).sum(0).sqrt() if g.numel() else torch.zeros(0, dtype=torch.float64)
    if g.numel():
        coef = reference.clip_coefficients(norms, spec.max_grad_norm)
        clean = g @ coef
        u, s, _ = torch.linalg.svd(g, full_matrices=False)
        u = u[:, s > s.max() * 1e-9] if len(s) and float(s.max()) > 0 else u[:, :0]
    else:
        clean = torch.zeros(numel, dtype=torch.float64)
        u = torch.zeros(numel, 0, dtype=torch.float64)
    return clean, u, norms


def _started_from(spec: RunSpec, first: RankOutput, j: int, start: Optional[Dict[str, torch.Tensor]]):
    """The parameters step ``j`` started from: ``None`` at lr 0 (the span needs none), and where they
    are not in the case (a load half's first step without ``start``)."""
    if spec.lr == 0:
        return None
    return first.steps[j - 1].parameters if j else (start if spec.phase == "load" else None)


def _add_cells(out: RunReleases, raw_cells: List[Tuple[int, int, torch.Tensor]], spec: RunSpec,
               ranks: Sequence[RankOutput], at: Tuple[int, int], index, indices, span, raw: torch.Tensor,
               unit: float) -> None:
    """Step ``at = (j, t)``'s cells, one per rank's shard, appended to ``out.cells`` (and their raw
    residuals in noise units to ``raw_cells``): the residual ``raw`` projected off the batch's span
    ``span = (u, norms)``, in units of the noise std ``unit``."""
    (j, t), (u, norms) = at, span
    position = {i: p for p, i in enumerate(indices)}
    proj = raw - u @ (u.T @ raw) if u.shape[1] else raw
    z = proj / unit
    for r, idx in enumerate(index):
        if not len(idx):
            continue
        ur = u[idx]
        mine = [position[i] for i in ranks[r].steps[j].indices if i in position] if r < len(ranks) else []
        own = min(1.0, float(norms[mine].max()) / spec.max_grad_norm) if mine and not spec.mesh else 1.0
        if r < len(ranks) and not ranks[r].steps[j].indices and not spec.mesh:
            out.empty.append((t, r))
        out.cells.append(Cell(t, r, float(z[idx].pow(2).sum()), float(len(idx) - ur.pow(2).sum()),
                              float(z[idx].sum()), float(len(idx) - ur.sum(0).pow(2).sum()), own))
        raw_cells.append((t, r, raw[idx] / unit))


def _left_out(spec: RunSpec, indices: List[int], params, t: int) -> str:
    """Why step ``t``'s release cannot be decomposed before its span is computed (``""`` where it can): the
    parameters it started from are unknown (a load half's first step at lr > 0), or the compute dtype's rounding
    at them is beyond the first-order bound (``beyond_first_order``; float32 runs are looked at only once their
    parameters moved: the initial models are far inside)."""
    if spec.lr != 0 and params is None and spec.phase == "load":
        return "the parameters it started from (the save half's) are not in this case"
    if spec.precision == "fp32" and (params is None or not has_softmax(spec)):  # float32: only a softmax's logits
        return ""
    beyond = beyond_first_order(spec, indices, params, t if not spec.poisson else 0)
    dtype = "bf16" if spec.precision != "fp32" else spec.dtype
    return (f"{dtype}'s rounding at the parameters it started from is beyond the first-order bound: {beyond}"
            if beyond else "")


def decompose(spec: RunSpec, world_size: int, ranks: Sequence[RankOutput],
              start: Optional[Dict[str, torch.Tensor]] = None,
              earlier: Optional[List[Tuple[int, int, torch.Tensor]]] = None) -> Optional[RunReleases]:
    """The run's releases (module docstring), ``None`` if it released no noise. ``start``: the
    parameters its first step started from where they are not the initial model's (a resumed
    ``load`` half: its ``save`` half's last parameters); ``None`` there with lr > 0 leaves the first
    step out. ``earlier``: the noise cells of the same run's earlier half (a resumed run's ``save``
    half, collected by passing the list to it): repeats are searched across both halves (a resumed
    generator seeded as at the start adds step 0's noise again at step k), and this run's cells are
    appended to it."""
    if spec.noise_multiplier <= 0 or spec.task != "train" or not ranks or not ranks[0].steps:
        return None
    first = ranks[0]
    names = sorted(n for n in first.steps[0].gradient)
    trainable = set(_start_params(spec))
    names = [n for n in names if n in trainable]
    if not names:
        return None
    shapes = [first.steps[0].gradient[n].shape for n in names]
    shards = shard_divisor(spec, world_size)
    index = shard_index(shapes, shards)
    unit = spec.noise_multiplier * spec.max_grad_norm  # the noise's std on the summed gradient
    d = spec.divisor
    out = RunReleases(spec.dtype, spec.precision, world_size, spec.lr, spec.momentum, spec.noise_multiplier,
                      spec.max_grad_norm, d, spec.sampling, spec.physical_batch_size, spec.phase,
                      first_step=spec.first_step)
    grid_on = {g: 0 for g in GRIDS}
    grid_n = 0
    eps = torch.finfo(spec.torch_dtype).eps
    raw_cells: List[Tuple[int, int, torch.Tensor]] = []
    for j, st in enumerate(first.steps):
        t = spec.first_step + j
        params = _started_from(spec, first, j, start)
        indices = processed_indices(ranks, j, spec)
        why = _left_out(spec, indices, params, t)
        if why:
            out.skipped.append((t, why))
            continue
        released = torch.cat([st.gradient[n].reshape(-1).to(torch.float64) for n in names]) * d
        span = _span(spec, t if not spec.poisson else 0, indices, params, names, released.numel())
        if span is None:
            out.skipped.append((t, f"its batch of {len(indices)} samples spans too much of the {released.numel()} "
                                "coordinates"))
            continue
        clean, u, norms = span
        raw = released - clean
        out.signal = signal_terms(out.signal, released, clean, unit)
        _add_cells(out, raw_cells, spec, ranks, (j, t), index, indices, (u, norms), raw, unit)
        if spec.precision == "fp32":
            grid_n += count_on_grid(released, clean, raw, eps, grid_on)
    if not out.cells:
        return out
    out.grids = {g: (grid_on[g], grid_n) for g in GRIDS} if grid_n else {}
    if spec.precision == "fp32":
        out.coarse = coarse_grid(torch.cat([v.reshape(-1) for _, _, v in raw_cells]), SILENT / 2)
        out.silent = silent(raw_cells, _shard_layout(names, shapes, shards))
    out.repeat = repeats((earlier or []) + raw_cells)
    if earlier is not None:
        earlier.extend(raw_cells)
    return out


def _shard_layout(names: Sequence[str], shapes: Sequence[torch.Size], ws: int) -> List[List[Tuple[str, int]]]:
    """Per rank, ``(tensor, coordinates)`` in the order ``shard_index`` lays its shard out."""
    out: List[List[Tuple[str, int]]] = [[] for _ in range(ws)]
    for i, r, chunk, per_row, _ in _row_chunks(shapes, ws):
        out[r].append((names[i], len(chunk) * per_row))
    return out


# -- tests ------------------------------------------------------------------------------------------
@dataclass
class Finding:
    """One failed test: what, where (steps, ranks), how far off, and its p-value (``None``: exact)."""

    kind: str  # "coarse", "silent", "scale", "mean", "grid", "repeat"
    ratio: float = float("nan")
    p: Optional[float] = None
    steps: Tuple[int, ...] = ()
    ranks: Tuple[int, ...] = ()
    detail: str = ""
    #: "run", "step", "rank", "from" (a change part-way: steps from ``steps[0]`` on), "pooled"
    scope: str = "run"


def _scale(cells: Sequence[Cell]) -> Tuple[float, float, float]:
    """``(std ratio, p, df)`` of the pooled scale statistic."""
    ss, df = sum(c.ss for c in cells), sum(c.df for c in cells)
    if df <= 0:
        return float("nan"), 1.0, 0.0
    return math.sqrt(max(ss, 0.0) / df), chi2_two_sided_p(ss, df), df


def tests_of(run: RunReleases) -> int:
    """How many statistical tests ``run_tests`` makes of ``run`` (the Bonferroni count)."""
    steps = len({c.step for c in run.cells})
    ranks = len({c.rank for c in run.cells})
    return 2 + steps + (ranks if ranks > 1 else 0) if run.cells else 0


def exact_finding(run: RunReleases) -> Optional[Finding]:
    """The first exact finding of one run (no alpha): coordinates without noise, noise repeated, a
    value grid; ``None``."""
    if run.coarse is not None:  # a grid rounds values to 0: named before the coordinates it leaves silent
        return Finding("coarse", ratio=run.coarse[2], scope="run",
                       detail=f"{run.coarse[0]} distinct values over {run.coarse[1]}, {run.coarse[3]:.1%} of them 0")
    if run.silent is not None:
        name, r, where_, k, size, also_in, with_some = run.silent
        also = (f" (silent coordinates also in {', '.join(repr(o) for o in also_in)})" if also_in else "")
        return Finding("silent", ratio=k / size, steps=where_, ranks=(r,) + tuple(x for x in with_some if x != r),
                       scope="step", detail=f"{k} of {size} coordinates of {name!r} on rank {r}'s shard{also}")
    if run.repeat is not None:
        ta, ra, tb, rb, neg, m = run.repeat
        return Finding("repeat", steps=(ta, tb), ranks=(ra, rb), scope="run",
                       detail=f"{'negated ' if neg else ''}noise repeated on {m} values")
    for name, (on, n) in run.grids.items():
        if n >= 64 and on > GRID_FRACTION * n:
            return Finding("grid", ratio=on / n, detail=name, scope="run")
    return None


def _log_likelihood(cells: Sequence[Cell], scales: Sequence[float]) -> float:
    """Gaussian log-likelihood (up to a constant) of the cells' noise at std ``scales`` x sigma*C/D each."""
    return sum(-c.df * math.log(s) - c.ss / (2 * s * s) for c, s in zip(cells, scales))


def max_norm_finding(cells: Sequence[Cell], ratio: float, p: float, alpha: float) -> Optional[Finding]:
    """The noise std tied to each local batch's largest clipped norm (scope ``max_norm``): every cell
    scaled back by its ``own_max`` fits at ``alpha``, and that explains the cells better than one
    constant ratio does (a log-likelihood at least the constant's, less 1 for its fitted parameter):
    noise too small by one factor everywhere fits scaled-back cells too when few are below C, and is
    not this cause. ``None`` otherwise (and where a local batch's largest clipped norm is 0)."""
    if not any(c.own_max < 1 for c in cells) or not all(c.own_max > 0 for c in cells) or not ratio > 0:
        return None
    ss, df = sum(c.ss / c.own_max ** 2 for c in cells), sum(c.df for c in cells)
    tied = _log_likelihood(cells, [c.own_max for c in cells])
    if not (chi2_two_sided_p(ss, df) >= alpha and tied >= _log_likelihood(cells, [ratio] * len(cells)) - 1):
        return None
    below = sorted({(c.step, c.rank) for c in cells if c.own_max < 1})
    return Finding("scale", ratio=ratio, p=p, steps=tuple(sorted({t for t, _ in below})),
                   ranks=tuple(sorted({r for _, r in below})), scope="max_norm", detail=f"{len(below)} of {len(cells)}")


def run_tests(run: RunReleases, alpha: float) -> Optional[Finding]:
    """The first failure of one run's releases (exact checks first, then the tests at ``alpha``
    each), or ``None``."""
    if not run.cells:
        return None
    exact = exact_finding(run)
    if exact is not None:
        return exact
    ratio, p, _ = _scale(run.cells)
    steps = sorted({c.step for c in run.cells})
    per_step = {t: _scale([c for c in run.cells if c.step == t]) for t in steps}
    bad_steps = [t for t in steps if not per_step[t][1] >= alpha]
    ranks = sorted({c.rank for c in run.cells})
    per_rank = {r: _scale([c for c in run.cells if c.rank == r]) for r in ranks} if len(ranks) > 1 else {}
    bad_ranks = [r for r in ranks if r in per_rank and not per_rank[r][1] >= alpha]
    if not p >= alpha or bad_steps or bad_ranks:
        tied = max_norm_finding(run.cells, ratio, p, alpha)
        if tied is not None:
            return tied
        # where: from a step on (a change part-way), on some ranks, or everywhere
        if bad_steps and len(steps) > 2:
            k = bad_steps[0]
            later = [t for t in steps if t >= k]
            rest = _scale([c for c in run.cells if c.step >= k])
            before = _scale([c for c in run.cells if c.step < k])
            if k > steps[0] and before[1] >= alpha and len(bad_steps) >= max(1, len(later) // 2):
                return Finding("scale", ratio=rest[0], p=min(per_step[t][1] for t in bad_steps), steps=tuple(later),
                               scope="from", detail=f"before step {k}: {before[0]:.3f}")
        if bad_ranks and len(bad_ranks) < len(ranks):
            others = _scale([c for c in run.cells if c.rank not in bad_ranks])
            worst = min(bad_ranks, key=lambda r: per_rank[r][1])
            return Finding("scale", ratio=per_rank[worst][0], p=per_rank[worst][1], ranks=tuple(bad_ranks),
                           scope="rank", detail=f"other ranks: {others[0]:.3f}")
        if bad_steps and len(bad_steps) < len(steps) and p >= alpha:
            worst = min(bad_steps, key=lambda t: per_step[t][1])
            return Finding("scale", ratio=per_step[worst][0], p=per_step[worst][1], steps=tuple(bad_steps),
                           scope="step")
        return Finding("scale", ratio=ratio, p=min([p] + [per_step[t][1] for t in bad_steps]), steps=tuple(steps),
                       scope="run")
    total = sum(c.total for c in run.cells)
    var = sum(c.var for c in run.cells)
    pm = normal_two_sided_p(total / math.sqrt(var)) if var > 0 else 1.0
    if not pm >= alpha:
        return Finding("mean", ratio=total / var if var > 0 else float("nan"), p=pm, steps=tuple(steps),
                       scope="run")
    return None


def pooled_groups(runs: Sequence[RunReleases]) -> Dict[str, List[RunReleases]]:
    """The groups of runs tested pooled: every run, each dtype (and precision), the runs at lr > 0."""
    groups: Dict[str, List[RunReleases]] = {"every noisy run": list(runs)}
    for r in runs:
        key = r.dtype + ("" if r.precision == "fp32" else f" {r.precision}")
        groups.setdefault(f"the {key} runs", []).append(r)
    moving = [r for r in runs if r.lr]
    if moving:
        groups["the runs at lr > 0"] = moving
    return {k: v for k, v in groups.items() if any(r.cells for r in v)}


def pooled_tests(runs: Sequence[RunReleases], alpha: float) -> List[Tuple[str, float, float, float]]:
    """``(group, std ratio, p, degrees of freedom)`` of every pooled group (``pooled_groups``) whose
    scale test fails at ``alpha``."""
    out = []
    for name, group in pooled_groups(runs).items():
        ratio, p, df = _scale([c for r in group for c in r.cells])
        if not p >= alpha:
            out.append((name, ratio, p, df))
    return out


def contrasts(run: RunReleases, runs: Sequence[RunReleases], finding: Optional[Finding] = None
              ) -> Dict[str, Tuple[str, float]]:
    """What the other runs released, against which a finding in ``run`` names its cause: the pooled
    std ratio of the runs in another dtype (``"dtype"``), at another world size (``"world_size"``, same
    dtype), at lr 0 (``"lr"``, for a run at lr > 0), at sigma 1 and at C = 1 (``"sigma"``, ``"clip"``, for
    a run at another: there a std that leaves sigma or C out, or has it twice, is right), all but the world
    size's at ``run``'s world size (a 3-rank-only bug is not "only the float64 runs are off" because the
    other dtypes ran at 1 and 2 ranks): ``{key: (what they are, ratio)}`` for the groups that exist.
    ``"<key>_edge"`` (``edges.sigma_edge``): ``run``'s sigma is above / below every sigma of that group's. With
    a ``finding`` of a place (from a step on, at some steps or ranks) only the other runs' releases there
    count (``at_place``): noise
    halved from step 64 in every run is not "scaled by the lr" in the one lr-0.5 run it shows in just
    because the lr-0 runs, most of which stop before step 64, are right as a whole."""
    out: Dict[str, Tuple[str, float]] = {}
    # each group differs from ``run`` in its own axis and holds the world size (the world size: the dtype) fixed
    same_ws = [r for r in runs if r.world_size == run.world_size]
    kind = (run.dtype, run.precision)
    groups = {
        "dtype": ([r for r in same_ws if (r.dtype, r.precision) != kind],
                  f"the runs in other dtypes than {run.dtype} at world size {run.world_size}"),
        "world_size": ([r for r in runs if r.world_size != run.world_size and (r.dtype, r.precision) == kind],
                       f"the {run.dtype} runs at other world sizes than {run.world_size}"),
        "lr": ([r for r in same_ws if not r.lr] if run.lr else [], "the runs at lr 0"),
        "sigma": ([r for r in same_ws if r.sigma == 1] if run.sigma != 1 else [], "the runs at sigma 1"),
        "clip": ([r for r in same_ws if r.clip == 1] if run.clip != 1 else [], "the runs at C = 1"),
    }
    for key, (group, what) in groups.items():
        cells = [c for r in group for c in r.cells if at_place(c, finding)]
        if cells:
            out[key] = (what, _scale(cells)[0])
            out.update({f"{key}_edge": e for e in [sigma_edge(run.sigma, group)] if e})
    return out


def at_place(cell: Cell, finding: Optional[Finding]) -> bool:
    """Whether ``cell`` (a step and rank of some run) lies where ``finding`` was found: at or after its
    first step (scope ``from``), at one of its steps (``step``), on one of its ranks (``rank``);
    anywhere for a whole run's finding or none."""
    if finding is None:
        return True
    if finding.scope == "from":
        return cell.step >= finding.steps[0]
    if finding.scope == "step":
        return cell.step in finding.steps
    if finding.scope == "rank":
        return cell.rank in finding.ranks
    return True


def detectable_ratio(df: float, alpha: float) -> float:
    """The std error (fraction) a scale test over ``df`` degrees of freedom detects at ``alpha``
    with ~99 % probability (normal approximation of chi^2: z_alpha/2 + z_0.99 standard errors of
    the variance ratio, sqrt(2/df) each)."""
    if df <= 0:
        return float("inf")
    z = _z(alpha / 2) + 2.326
    return 1 - math.sqrt(max(0.0, 1 - z * math.sqrt(2 / df)))


def _z(p: float) -> float:
    lo, hi = 0.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(mid / math.sqrt(2)) > p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


__all__ = ["max_norm_finding", "GRIDS", "GRID_FRACTION",
           "CLIP_LATITUDE", "REPEAT_MIN", "REPEAT_EQUAL", "SILENT", "SILENT_P0",
           "SILENT_LEVEL", "SILENT_MIN", "Cell", "RunReleases", "Finding", "shard_index", "decompose", "silent",
           "repeats", "tests_of", "exact_finding", "run_tests", "pooled_groups", "pooled_tests", "at_place",
           "contrasts", "detectable_ratio"]

"""Which parameters' share of a per-sample norm is wrong, and by what factor, read from the norms
alone: the explanation ``norm_fidelity`` gives when no known bug shape fits, named by the model's
own parameter names -- what a user checking their own model (``docs/models.md``) needs to find
the layer a target gets wrong.

A sample's squared norm is the sum of its parameters' shares ``s_p,i = ||g_p,i||^2``. A target that
gets the parameters ``P`` (one parameter, or every parameter of one module) wrong by one factor
``k`` on their per-sample gradients -- left out (``k = 0``), summed twice (``k = 2``), a norm
class's weight gradient scaled -- gives ``n_i^2 = ||g_i||^2 + (k^2 - 1) sum_{p in P} s_p,i``: its
squared norms minus the true ones are a multiple of ``P``'s shares over the samples. That multiple
is fitted by least squares for every candidate ``P``; the candidates whose residual is within the
tolerance are the explanation (several when their shares are proportional on these samples: all are
named). Single parameters are tried before modules (the more specific reading first); a set that
holds the whole norm (a model of one parameter) is not tried: that is one factor on every norm. When
no one set fits, two parameters at a factor each are tried (``pair_fits``, on >= 4 samples); when
nothing fits, ``unnamed_reason`` says why no parameter is named.

DP meaning: ``k < 1`` undercounts the sample's norm (it can contribute more than C: a privacy
violation); ``k > 1`` over-clips (utility).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

from ...lazy import torch
from ...targets import RunSpec
from ..analysis.compare import reference_grads, reference_model

#: how close to 0 a fitted factor is read as "left out"
LEFT_OUT = 1e-3


class Share:
    """A fit: the parameters ``names`` carry factor ``k`` on their per-sample gradients."""

    def __init__(self, names: List[str], k: float, residual: float):
        self.names, self.k, self.residual = names, k, residual

    def excess(self, parts: Dict[str, "torch.Tensor"]) -> "torch.Tensor":
        """The squared norms' excess over the truth this fit predicts, from the true ``parts``."""
        return (self.k ** 2 - 1) * torch.stack([parts[n] for n in self.names]).sum(0)

    def describe(self) -> str:
        names = ", ".join(repr(n) for n in self.names)
        plural = "s" if len(self.names) > 1 else ""
        if self.k <= LEFT_OUT:
            return f"leave out parameter{plural} {names} (its per-sample gradient contributes nothing: factor 0)"
        return (f"count parameter{plural} {names} with a factor {self.k:.4g} on its per-sample gradient "
                f"({self.k ** 2:.4g} x its share of the squared norm)")


class Combined(Share):
    """A fit of two parameters at a factor each (``parts``): both are named, each with its factor; its
    ``k`` is the smaller one (below 1: a share is undercounted)."""

    def __init__(self, parts: List[Share], residual: float):
        super().__init__([n for p in parts for n in p.names], min(p.k for p in parts), residual)
        self.parts = parts

    def excess(self, parts: Dict[str, "torch.Tensor"]) -> "torch.Tensor":
        return sum((p.excess(parts) for p in self.parts), torch.zeros_like(next(iter(parts.values()))))

    def describe(self) -> str:
        return " and ".join(p.describe() for p in self.parts)


def candidates(spec: RunSpec) -> List[List[str]]:
    """The parameter sets tried, in order: each trainable parameter alone, then each module's
    trainable parameters together (modules of two or more)."""
    grads = reference_grads(spec)
    singles = [[n] for n in grads]
    groups = []
    for name, module in reference_model(spec).named_modules():
        own = [f"{name}.{n}" if name else n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        own = [n for n in own if n in grads]
        if len(own) > 1:
            groups.append(own)
    return singles + groups


def shares(spec: RunSpec, indices: Sequence[int]) -> Dict[str, "torch.Tensor"]:
    """``{parameter: [len(indices)]}`` squared per-sample gradient norms of each trainable parameter."""
    rows = torch.as_tensor(list(indices), dtype=torch.long)
    return {n: g[rows].flatten(1).pow(2).sum(1) for n, g in reference_grads(spec).items()}


def fit_shares(spec: RunSpec, indices: Sequence[int], got_sq: "torch.Tensor", rtol: float) -> List[Share]:
    """The candidate parameter sets whose one factor explains the squared norms ``got_sq`` of the
    samples ``indices`` (within ``rtol`` of each true squared norm), best first; ``[]`` if none."""
    parts = shares(spec, indices)
    if not parts or not len(indices):
        return []
    true_sq = torch.stack(list(parts.values())).sum(0)
    d = got_sq.to(torch.float64) - true_sq
    allowed = 2 * rtol * true_sq + 1e-24
    if bool((d.abs() <= allowed).all()):
        return []  # nothing to explain
    found: List[Share] = []
    for names in candidates(spec):
        s = torch.stack([parts[n] for n in names]).sum(0)
        den = float(s @ s)
        if den <= 0 or bool(((true_sq - s).abs() <= allowed).all()):
            continue  # no share, or the whole norm: a factor on every norm, not one parameter's
        a = float(d @ s) / den
        resid = (d - a * s).abs()
        k2 = 1.0 + a
        if bool((resid <= allowed).all()) and k2 >= -2 * rtol and abs(a) > 2 * rtol:
            found.append(Share(names, math.sqrt(max(k2, 0.0)), float((resid / true_sq.clamp_min(1e-300)).max())))
    found.sort(key=lambda f: f.residual)
    best = [f for f in found if len(f.names) == len(found[0].names)] if found else []
    return best or pair_fits(parts, d, allowed, rtol)


#: fewest samples a two-parameter fit is made on (two factors from >= 4 equations: 2 to spare)
PAIR_MIN_SAMPLES = 4


def pair_fits(parts: Dict[str, "torch.Tensor"], d: "torch.Tensor", allowed: "torch.Tensor", rtol: float
              ) -> List[Share]:
    """Two parameters each off by its own factor (``d`` = the squared norms' excess over the truth,
    least squares over the pair's shares), best first; ``[]`` with fewer than ``PAIR_MIN_SAMPLES``
    samples or when no pair explains ``d`` within ``allowed``."""
    names = [n for n, s in parts.items() if float(s.abs().sum()) > 0]
    if len(d) < PAIR_MIN_SAMPLES:
        return []
    found: List[Share] = []
    for i, p in enumerate(names):
        for q in names[i + 1:]:
            x = torch.stack([parts[p], parts[q]], 1)
            sol = torch.linalg.lstsq(x, d.unsqueeze(1)).solution.squeeze(1)
            resid = (d - x @ sol).abs()
            a = [float(v) for v in sol]
            if bool((resid <= allowed).all()) and all(1 + v >= -2 * rtol and abs(v) > 2 * rtol for v in a):
                found.append(Combined([Share([n], math.sqrt(max(1 + v, 0.0)), 0.0) for n, v in zip((p, q), a)],
                                      float((resid / (d.abs() + allowed)).max())))
    return sorted(found, key=lambda f: f.residual)


def describe_fits(found: List[Share]) -> Tuple[str, str]:
    """``(diagnosis, what the target does)`` for ``fit_shares``' answer (non-empty)."""
    first = found[0]
    what = first.describe()
    if len(found) > 1:
        what += " -- or equally well on these samples: " + "; ".join(f.describe() for f in found[1:4])
    return ("undercount" if first.k < 1 else "mismatch"), what


def norm_share_diagnosis(spec: RunSpec, got: Sequence["torch.Tensor"], steps, rtol: float, subject: str,
                         where: str) -> Optional[Tuple[str, str]]:
    """``(diagnosis, message)`` naming the parameters whose share of the reported norms ``got`` (per
    rank, of the samples ``steps[r].indices``) is off by one factor; ``None`` where none fits."""
    indices = [i for s in steps for i in s.indices]
    if not indices:
        return None
    got_sq = torch.cat([g.reshape(-1).to(torch.float64) for g in got]).pow(2)
    found = fit_shares(spec, indices, got_sq, rtol)
    if not found:
        return None
    diagnosis, what = describe_fits(found)
    consequence = ("a sample's norm then misses part of that share, so it can contribute more than C: a privacy "
                   "violation" if diagnosis == "undercount" else "every sample whose share is large is over-clipped "
                   "(utility loss)")
    return diagnosis, f"{subject} {where} {what}; {consequence}."


def unnamed_reason(samples: int) -> str:
    """Why a norm failure names no parameter: what was tried on how many ``samples``."""
    pairs = (" nor any two parameters at a factor each" if samples >= PAIR_MIN_SAMPLES else
             f" (two parameters at a factor each need >= {PAIR_MIN_SAMPLES} samples)")
    return (f" No parameter is named: no single parameter or module at one factor{pairs} explains the reported "
            f"norms of these {samples} samples -- the error is not a fixed factor on some parameters' per-sample "
            "gradients (it varies by sample: e.g. a sequence layer's norm taken per token, or other samples' norms).")


def clip_share_diagnosis(spec: RunSpec, indices: Sequence[int], coef: "torch.Tensor", expected: "torch.Tensor",
                         tol: float, where: str) -> Optional[Tuple[str, str]]:
    """``(diagnosis, message)`` naming the parameters whose share of the norms a target *clips with*
    is off by one factor, read from the recovered clip coefficients ``coef`` (``expected``: the true
    ones): a clipped sample's coefficient is ``C / n_i`` (up to the gradient's overall scale, taken
    from the sample the least clipped), so ``n_i`` is read back and fitted as ``norm_share_diagnosis``
    does. The fit is then checked on every judged coefficient. ``None`` where none fits."""
    from ...lazy import reference

    c = spec.max_grad_norm
    scale = float(coef.max()) / float(expected.max())
    if not scale > 0:
        return None
    read = coef / scale
    clipped = read < 1 - tol
    if int(clipped.sum()) < 2:
        return None
    idx = [i for i, on in zip(indices, clipped.tolist()) if on]
    found = fit_shares(spec, idx, (c / read[clipped]).pow(2), max(tol, 1e-9))
    parts = shares(spec, indices)
    true_sq = torch.stack(list(parts.values())).sum(0)
    kept = []
    for f in found:
        hyp = (true_sq + f.excess(parts)).clamp_min(0).sqrt()
        shape = reference.clip_coefficients(hyp, c)
        k = float(coef @ shape) / float(shape @ shape)
        if float((coef - k * shape).abs().max()) / max(1.0, abs(k)) <= tol:
            kept.append(f)
    if not kept:
        return None
    diagnosis, what = describe_fits(kept)
    return diagnosis, f"the norms it clips with {where} {what}."


__all__ = ["LEFT_OUT", "Share", "Combined", "PAIR_MIN_SAMPLES", "pair_fits", "unnamed_reason", "candidates", "shares",
           "fit_shares", "describe_fits", "norm_share_diagnosis", "clip_share_diagnosis"]

"""Upstream opacus' per-sample gradients on the real architectures, one process, no FSDP, per parameter.

For each model of ``dpfsdp_verify.models.real`` (float64 throughout): the reference is a loop, one
autograd pass per sample; opacus is ``prepare_module`` as ``make_private`` calls it, in
``grad_sample_mode="hooks"`` (per-sample gradients in ``p.grad_sample``, their norms compared) and
``"ghost"`` (ghost clipping: per-sample norms in ``p._norm_sample``). Each trainable parameter, by
the model's own name, is ``exact`` (its squared norm within 1e-9 of the sample's total squared norm,
on every sample), ``wrong`` (the median ratio opacus / reference is printed as the factor),
``missing`` (opacus left it without a per-sample value: its norm would be left out of the clipping
norm) or the mode ``crash``es (the innermost opacus / transformers frame is printed).

    python scripts/real_model_norms.py [gpt2 llama ...] [--json FILE]

This is how docs/findings.md's real-architecture findings were measured; tests/models/test_real.py
pins the same table.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings
from typing import Any, Dict, List

import torch

from dpfsdp_verify.models.real import REAL_MODELS

BATCH, SEED = 4, 0
RTOL = 1e-9


def _slice(inputs: Any, index) -> Any:
    return {k: v[index] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[index]


def _call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _f64(inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return {k: _f64(v) for k, v in inputs.items()}
    return inputs.double() if inputs.is_floating_point() else inputs


def reference_norms(spec, model, inputs, targets) -> Dict[str, torch.Tensor]:
    """``{name: [n]}``: each sample's gradient norm per trainable parameter, one backward per sample."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    rows: Dict[str, List[torch.Tensor]] = {k: [] for k in params}
    for i in range(targets.shape[0]):
        loss = spec.loss(_call(model, _slice(inputs, slice(i, i + 1))), targets[i:i + 1]).sum()
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        for k, g in zip(params, grads):
            rows[k].append(torch.zeros((), dtype=torch.float64) if g is None else g.double().norm())
    return {k: torch.stack(v) for k, v in rows.items()}


def _frame(exc: BaseException) -> str:
    """The innermost frame in opacus / transformers / peft that the exception went through."""
    frames = traceback.extract_tb(exc.__traceback__)
    for f in reversed(frames):
        for pkg in ("opacus", "transformers", "peft"):
            marker = f"/site-packages/{pkg}/"
            if marker in f.filename:
                return f"{pkg}/{f.filename.split(marker, 1)[1]}:{f.lineno}"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def opacus_norms(model, spec, inputs, targets, mode: str) -> Dict[str, Any]:
    """``{name: [n] or None}`` (None: opacus left no per-sample value) under ``mode``."""
    from opacus.grad_sample.utils import prepare_module

    kw = {"max_grad_norm": 1.0} if mode == "ghost" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gsm = prepare_module(model, grad_sample_mode=mode, batch_first=True, loss_reduction="sum", **kw)
        loss = spec.loss(_call(gsm, inputs), targets).sum()
        loss.backward()
    out: Dict[str, Any] = {}
    for k, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if mode == "ghost":
            ns = getattr(p, "_norm_sample", None)
            out[k] = None if ns is None else ns.detach().double()
        else:
            gs = getattr(p, "grad_sample", None)
            out[k] = None if gs is None else gs.detach().double().flatten(1).norm(dim=1)
    return out


def classify(ref: torch.Tensor, got, total: torch.Tensor) -> str:
    """``exact`` when every sample's squared norm of this parameter is within ``RTOL`` of the
    sample's total squared norm (what clipping uses; a share that is 0 in exact arithmetic, as a key
    projection's bias under softmax, comes out ~1e-20 by ghost clipping's Gram-matrix form), else
    ``wrong xF`` (F the median ratio over the samples where the reference is not ~0) or ``wrong shape``."""
    if got is None:
        return "missing"
    if got.shape != ref.shape:
        return f"wrong shape {tuple(got.shape)}"
    if bool(((got.pow(2) - ref.pow(2)).abs() <= RTOL * total.pow(2)).all()):
        return "exact"
    live = ref.pow(2) > RTOL * total.pow(2)
    factor = (got[live] / ref[live]).median().item() if live.any() else float("nan")
    return f"wrong x{factor:.4g}"


def table(name: str) -> Dict[str, Any]:
    spec = REAL_MODELS[name]()
    inputs, targets = spec.batch(BATCH, SEED)
    inputs = _f64(inputs)
    ref = reference_norms(spec, spec.build(SEED).double(), inputs, targets)
    result: Dict[str, Any] = {"model": name, "parameters": {}}
    for mode in ("hooks", "ghost"):
        try:
            got = opacus_norms(spec.build(SEED).double(), spec, inputs, targets, mode)
        except Exception as exc:  # noqa: BLE001 - every crash is a finding, reported with its frame
            result[mode] = f"crash {type(exc).__name__} at {_frame(exc)}: {str(exc).splitlines()[0][:160]}"
            continue
        result[mode] = "ran"
        total = torch.stack([r.pow(2) for r in ref.values()]).sum(0).sqrt()
        for k, r in ref.items():
            result["parameters"].setdefault(k, {})[mode] = classify(r, got.get(k), total)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", default=list(REAL_MODELS))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    results = []
    for name in args.models:
        r = table(name)
        results.append(r)
        print(f"== {name}: hooks {r['hooks']}; ghost {r['ghost']}")
        for k, v in r["parameters"].items():
            if any(x != "exact" for x in v.values()):
                print(f"   {k}: " + ", ".join(f"{m} {x}" for m, x in v.items()))
        exact = [k for k, v in r["parameters"].items() if all(x == "exact" for x in v.values())]
        print(f"   exact in every mode that ran: {len(exact)} of {len(r['parameters'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

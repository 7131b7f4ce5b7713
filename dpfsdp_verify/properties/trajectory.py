"""trajectory: K DP steps under FSDP at N ranks equal K steps of the reference on one process.

DP meaning: the model released after training must be the one the DP analysis describes; a
drift (state that leaks between steps, a step applied twice, parameters that go stale on a shard)
trains a different model than the one whose noise and clipping were accounted for.

Noise 0, C between the middle two step-0 reference norms (clipping active), plain SGD; the batch
loss before each step (reconstructed from the ranks' local losses) and the final parameters are
compared with ``reference.dp_sgd_trajectory``. K is 6 on the mlp and 3 on the transformer (option
``steps``): a bug that switches on a few steps into training (a warm-up, a cache) is seen on the
mlp if it starts by step index 5. Under Poisson sampling the K steps are the first K of Poisson
sampling over as many epochs as they need (``Point.spec``), each step's reference batch the union
of what the ranks drew, normalised by opacus' expected batch size int(q*N); a realised batch that
differs from it shows a realised-batch normaliser (named in the message; the pass message says in
how many steps the two differed). Diagnosis ``mismatch``; the message names the first step whose
loss drifts.
"""

from __future__ import annotations

from .. import reference
from ..verdict import Verdict
from .compare import (close, fmt, global_loss, max_rel_diff, pick_clip_bound, processed_indices,
                      reference_batch, reference_model, tensors_close, tolerance)
from .contract import Case, Outputs, Point, Property

#: steps per model unless the option ``steps`` is given: a bug that switches on at step k is seen
#: only if step k is taken and then compared (its effect shows in the loss of step k + 1, or in
#: the final parameters). The mlp is cheap: 6 steps catch anything that starts by step index 4
#: through the losses and by 5 through the parameters; the transformer keeps 3.
STEPS = {"mlp": 6}
DEFAULT_STEPS = 3


def cases(point: Point):
    steps = point.param("steps") or STEPS.get(point.model, DEFAULT_STEPS)
    spec = point.spec(steps=steps, global_batch_size=4 * point.world_size, lr=0.5)
    if spec.poisson:
        # as many epochs as the steps need (int(1/q) steps each): all ``steps`` are taken
        spec = spec.with_(epochs=-(-steps // spec.steps_per_epoch))
    yield point.case(spec.with_(max_grad_norm=pick_clip_bound(spec) or 1.0), doing=f"{steps} DP steps")


def judge(case: Case, runs: Outputs) -> Verdict:
    spec, ws, outputs = case.spec, case.world_size, runs[0][0]
    rtol, atol = tolerance(spec.dtype)
    n_steps = min(len(o.steps) for o in outputs)
    if n_steps != spec.nominal_steps:
        return case.verdict("fail", "mismatch", f"the ranks reported {[len(o.steps) for o in outputs]} steps; "
                            f"{spec.nominal_steps} were asked for")
    n_steps = spec.nominal_steps
    batches = [reference_batch(spec, k).select(processed_indices(outputs, k, spec)) for k in range(n_steps)]
    ref = reference.dp_sgd_trajectory(reference_model(spec), batches, lr=spec.lr, max_grad_norm=spec.max_grad_norm,
                                      reduction=spec.reduction, expected_batch_size=spec.expected_batch_size,
                                      empty_steps=spec.poisson)
    losses = [global_loss(outputs, k, spec) if len(batches[k]) else float("nan") for k in range(n_steps)]
    # an empty Poisson batch has no loss: None in the report (NaN is not JSON)
    evidence = {"losses": [x if x == x else None for x in losses],
                "reference_losses": [x if x == x else None for x in ref.losses], "max_grad_norm": spec.max_grad_norm}
    sizes = [len(b) for b in batches]
    # under Poisson "mean" the divisor is int(q*N) whatever was drawn: a step whose realised batch
    # differs from it is where a realised-batch normaliser shows (the pass message says how many)
    off = sum(0 < n != spec.expected_batch_size for n in sizes) if spec.poisson and spec.reduction == "mean" else 0
    if spec.poisson:
        evidence.update({"realised_batches": sizes, "expected_batch": spec.expected_batch_size})
    for k, (got, want) in enumerate(zip(losses, ref.losses)):
        if sizes[k] and not close(got, want, rtol, atol):  # an empty Poisson batch has no loss
            p_err = max_rel_diff(outputs[0].steps[-1].parameters, ref.parameters)[0]
            return case.verdict("fail", "mismatch", (
                f"training drifts from the single-process trajectory at step {k} of {n_steps} "
                f"(world_size={ws}): loss {got:.10g} vs reference {want:.10g}"
                + (f": update {k - 1} is the first that differs" if k > 0 else ": the initial model already differs")
                + (f", after {k - 1} matching update(s) (state carried between steps is suspect)" if k > 1 else "")
                + f"; final parameters differ by up to {fmt(p_err)} relative."
                + _realised_normaliser(spec, batches, outputs, off, rtol, atol)), evidence)
    for r, o in enumerate(outputs):
        if not tensors_close(o.steps[-1].parameters, ref.parameters, rtol, atol):
            err, name = max_rel_diff(o.steps[-1].parameters, ref.parameters)
            return case.verdict("fail", "mismatch", (
                f"rank {r}: every loss matches but the parameters after {n_steps} steps differ from the "
                f"reference by up to {fmt(err)} relative (worst {name!r}) at world_size={ws}: the last update, "
                f"{n_steps - 1}, is the first that differs." + _realised_normaliser(spec, batches, outputs, off, rtol,
                                                                                   atol)), evidence)
    exercised = (f"; realised batch != int(q*N) = {spec.expected_batch_size} in {off} of {n_steps} steps (empty batches aside)"
                 if spec.poisson and spec.reduction == "mean" else "")
    return case.verdict("pass", None, f"{n_steps} steps at world_size={ws} follow the single-process trajectory "
                        f"(losses {', '.join(f'{x:.6g}' if x == x else 'none (empty batch)' for x in losses)}{exercised})", evidence)


def _realised_normaliser(spec, batches, outputs, off: int, rtol: float, atol: float) -> str:
    """A sentence if the run is the reference trajectory normalised by each step's realised batch."""
    if not off:
        return ""
    alt = reference.dp_sgd_trajectory(reference_model(spec), batches, lr=spec.lr, max_grad_norm=spec.max_grad_norm,
                                      reduction=spec.reduction, expected_batch_size=None, empty_steps=True)
    if all(tensors_close(o.steps[-1].parameters, alt.parameters, rtol, atol) for o in outputs):
        return (f" It equals the trajectory normalised by each step's *realised* batch size "
                f"({', '.join(str(len(b)) for b in batches)}) instead of opacus' expected batch size int(q*N) = "
                f"{spec.expected_batch_size}: the divisor depends on what was drawn, not the fixed one whose "
                "sensitivity C/int(q*N) the accounting assumes.")
    return ""


PROPERTY = Property(
    id="trajectory",
    meaning=("K DP-SGD steps under FSDP at N ranks release the same model (losses, parameters) as K steps "
             "on one process: the model the DP analysis describes"),
    cases=cases, judge=judge, models=("mlp", "transformer"), layouts=("split",), reductions=("mean", "sum"),
    params=(("steps", None),), samplings=("fixed", "poisson"))

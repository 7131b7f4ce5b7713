"""What the runner checks of every run before a property judges it (``runner.py``): the ranks
processed exactly the samples they were given (fixed batches: ``data_problem``; Poisson sampling:
``poisson_problem``), gradient accumulation split every step as asked (``physical_problem``), the
accountant counted one DP step per released update (``privacy_steps_problem``), frozen parameters
were left alone (``frozen_problem``), nothing is NaN or inf (``non_finite``, ``all_padding_note``),
and float32 ran without TF32 (``tf32_problem``); plus where the ranks computed (``device_facts``,
every verdict's evidence).

DP meaning: a rank that trains on other samples than it was given, a step count the accountant
got wrong, or a frozen parameter that moved breaks the guarantee before any property's own check
applies. Plain functions of specs and rank outputs: the runner words them into verdicts.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

from ...lazy import torch

from ...lazy import models
from ...harness.rank_groups import grouped
from ...targets import RankOutput, RunSpec
from ..analysis.compare import frozen_parameters, reference_batch
from ..analysis.findings import HistoryFinding
from ..wording.accountant import history_message


def frozen_problem(spec: RunSpec, outputs: Sequence[RankOutput]) -> Optional[Tuple[str, dict]]:
    """``(message, evidence)`` if a frozen parameter got a gradient (or noise) or moved on any rank
    at any step; ``None`` if every frozen parameter was left exactly alone. Exact comparison: a
    frozen parameter is not trained, so nothing about it may change, not even by rounding."""
    frozen = frozen_parameters(spec)
    if not frozen:
        return None
    for o in outputs:
        for k, s in enumerate(o.steps):
            for n, init in frozen.items():
                g = s.gradient.get(n)
                if g is not None and bool((torch.as_tensor(g) != 0).any()):
                    g = torch.as_tensor(g, dtype=torch.float64)
                    return (f"rank {o.rank}, step {k}: frozen parameter {n!r} (requires_grad=False) received "
                            f"a gradient or noise: {int((g != 0).sum())} of {g.numel()} released coordinates are "
                            f"non-zero (largest {float(g.abs().max()):.3g}). A frozen parameter is not trained: "
                            "its gradient is not in the per-sample norms the clipping bounds, so any signal on it "
                            "is unclipped (a privacy violation), and noise on it only corrupts the frozen base",
                            {"frozen_parameter": n, "rank": o.rank, "step": k})
                p = s.parameters.get(n)
                if p is not None and not torch.equal(torch.as_tensor(p, dtype=torch.float64), init):
                    diff = float((torch.as_tensor(p, dtype=torch.float64) - init).abs().max())
                    return (f"rank {o.rank}, step {k}: frozen parameter {n!r} (requires_grad=False) changed by up "
                            f"to {diff:.3g}: the optimizer updated a parameter the user froze. Its update is not "
                            "covered by the clipping (norms are over trainable parameters) nor, unless noised, by "
                            "the noise: a privacy violation, and the pretrained base drifts",
                            {"frozen_parameter": n, "rank": o.rank, "step": k, "max_change": diff})
    return None


def device_facts(outputs: Sequence[RankOutput]) -> Dict[str, object]:
    """What every verdict's evidence says about where the ranks computed: ``device`` (each rank's,
    in rank order, joined when they differ: ``cuda:0, cuda:1``) and, on CUDA, ``numerics`` (the
    TF32 switches in force after the run, ``targets.util.numerics``). ``{}`` for outputs from an
    older rank that did not say."""
    devices = list(dict.fromkeys(o.device for o in outputs if getattr(o, "device", "")))
    if not devices:
        return {}
    facts: Dict[str, object] = {"device": ", ".join(devices)}
    how = next((o.numerics for o in outputs if getattr(o, "numerics", None)), None)
    if how:
        facts["numerics"] = dict(how)
    return facts


def tf32_problem(spec: RunSpec, outputs: Sequence[RankOutput]) -> Optional[str]:
    """Why a float32 case cannot be judged: a rank computed it with TF32 in force (the suite turns
    it off before each run, ``targets.util.float32_numerics``; the target turned it back on), and
    the float32 tolerances are derived for IEEE float32, ten times finer than TF32's rounding.
    ``None`` otherwise (float64, bf16 precisions, the CPU)."""
    if spec.compute_dtype != torch.float32:
        return None
    on = sorted({k for o in outputs for k, v in (getattr(o, "numerics", None) or {}).items() if v})
    if not on:
        return None
    return (f"the target computed float32 with TF32 in force ({', '.join(on)} = True after its run; the suite "
            "sets them False before it): float32 tolerances assume IEEE float32 rounding, TF32 keeps 10 mantissa "
            "bits (~1e-3 relative). Leave torch.backends.cuda.matmul.allow_tf32 / torch.backends.cudnn.allow_tf32 "
            "as the suite sets them, or run --dtypes float64")


def non_finite(outputs: Sequence[RankOutput]) -> Optional[str]:
    """Where the first NaN/inf is in what the ranks reported (loss, norms, gradient, parameters),
    as "rank r, step k: gradient 'fc1.weight' has 3 NaN and 0 inf of 48 values"; ``None`` if all
    is finite."""
    for o in outputs:
        for k, s in enumerate(o.steps):
            if not math.isfinite(s.loss):
                return f"rank {o.rank}, step {k}: the loss is {s.loss}"
            named = [("per-sample norms", "", s.norms)] if s.norms is not None else []
            named += [("gradient", n, t) for n, t in s.gradient.items()]
            named += [("parameter", n, t) for n, t in s.parameters.items()]
            for what, name, t in named:
                t = torch.as_tensor(t)
                if not bool(torch.isfinite(t).all()):
                    label = f"{what} {name!r}" if name else what
                    return (f"rank {o.rank}, step {k}: {label} has {int(torch.isnan(t).sum())} NaN and "
                            f"{int(torch.isinf(t).sum())} inf of {t.numel()} values")
    return None


def all_padding_note(spec: RunSpec, outputs: Sequence[RankOutput]) -> str:
    """For a non-finite release on a token batch: which processed sequences are all padding (no
    target other than ``ignore_index``) and whether the non-finite per-sample norms are exactly
    theirs, as a sentence to append (``""`` if no processed sequence is all padding)."""
    empty_at: List[str] = []
    for o in outputs:
        for k, s in enumerate(o.steps):
            if not len(s.indices):
                continue
            batch = reference_batch(spec, k)
            if batch.loss != "token_cross_entropy":
                return ""
            rows = batch.targets[torch.as_tensor(list(s.indices), dtype=torch.long)]
            empty = (rows != models.IGNORE_INDEX).sum(dim=1) == 0
            if not bool(empty.any()):
                continue
            where = [i for i, e in zip(s.indices, empty.tolist()) if e]
            if s.norms is not None and len(s.norms) == len(s.indices):
                bad = ~torch.isfinite(torch.as_tensor(s.norms, dtype=torch.float64))
                if bool(bad.any()) and bool((bad == empty).all()):
                    return (f" The non-finite per-sample norms (rank {o.rank}, step {k}) are exactly those of the "
                            f"sequence(s) {where} that are all padding (no real token): a per-sequence mean over "
                            "zero tokens is 0/0 = NaN. Such a sequence must contribute nothing (loss 0, gradient 0), "
                            "and one NaN poisons every sample's released gradient.")
            empty_at.append(f"rank {o.rank} step {k}: {where}")
    if not empty_at:
        return ""
    return (f" The processed batches hold all-padding sequences ({'; '.join(empty_at)}): a per-sequence mean over "
            "zero real tokens (0/0) gives NaN; such a sequence must contribute nothing.")


def data_problem(spec: RunSpec, world_size: int, outputs: Sequence[RankOutput]) -> Optional[str]:
    """How what the ranks say they processed differs from what ``spec`` gave them (steps taken;
    per step, the global indices observed in the data: missing, duplicated or foreign samples);
    ``None`` if it is exactly that (order within a local batch does not matter)."""
    counts = [len(o.steps) for o in outputs]
    # a resumed run's half takes steps first_step..end_step-1 (``RunSpec.resume_at``), numbered so
    asked = spec.end_step - spec.first_step
    if any(c != asked for c in counts):
        half = f" ({spec.phase} half of a run resumed at step {spec.resume_at})" if spec.phase else ""
        took = grouped({r: str(c) for r, c in enumerate(counts)}, between=" took ", sep=", ")
        return (f"{took} step(s) where {asked} were asked for{half}: a rank that returns early, or takes extra "
                "steps, trains on other data than its peers")
    for k in range(spec.first_step, spec.end_step):
        for r, o in enumerate(outputs):
            got, want = sorted(o.steps[k - spec.first_step].indices), sorted(spec.rank_indices(k, r, world_size))
            if got != want:
                missing = sorted(set(want) - set(got))
                foreign = sorted(set(got) - set(want))
                dup = sorted({i for i in got if got.count(i) > 1})
                parts = [f"{label} {v}" for label, v in (("missing", missing), ("foreign", foreign),
                                                         ("duplicated", dup)) if v]
                peers = ""
                if spec.mesh and spec.layout.tensor_parallel:
                    layout = spec.layout
                    peers = (f" (on {layout.label} the {layout.shape[1]} tensor-parallel peers of a data replica share "
                             f"its samples: the batch is split over the {layout.data_degree} data replicas only)")
                return (f"rank {r}, step {k}: processed samples {got} but was given {want} ({'; '.join(parts)}): "
                        f"the data path does not feed each rank the samples it was given{peers}")
    return None


def poisson_problem(spec: RunSpec, world_size: int, outputs: Sequence[RankOutput]
                    ) -> Optional[Tuple[str, str, dict]]:
    """What is wrong with a Poisson run's data, as ``(diagnosis, message, evidence)``, or ``None``.
    Indices are random, so they are checked for what Poisson sampling guarantees: every rank took
    the same number of steps (``step_divergence``: evidence = each rank's step count and local
    batch sizes), no more than asked for, every index is a dataset index, and no sample is in a
    step twice, across all ranks (each sample's Bernoulli draw is made once) (``mismatch``)."""
    counts = [len(o.steps) for o in outputs]
    sizes = [[len(s.indices) for s in o.steps] for o in outputs]
    brief = [x if len(x) <= 64 else f"{len(x)} steps, {sum(1 for b in x if b == 0)} empty, mean "
             f"{sum(x) / max(1, len(x)):.3g}" for x in sizes]
    evidence = {"step_counts": counts, "local_batch_sizes": brief}
    if len(set(counts)) > 1:
        return ("step_divergence", (
            "the ranks took different numbers of steps: "
            f"{grouped({r: str(c) for r, c in enumerate(counts)}, ': ', ', ')} "
            f"(nominal {spec.nominal_steps}: {spec.epochs} epoch(s) of int(1/q) = {spec.steps_per_epoch}). "
            "Under FSDP every step joins collectives, so the rank with more steps waits forever in the next "
            "one; and the accountant's step count is no longer one number. Typical cause: each rank draws "
            "its Poisson mask from its own random stream and skips its empty local batches."), evidence)
    if spec.task == "train" and counts and counts[0] == 0 and spec.nominal_steps > 0:
        return ("mismatch", f"no rank took a step of the {spec.nominal_steps} nominal Poisson steps: does the target "
                "implement RunSpec.sampling? (a target that ignores it runs the fixed path with steps=0)", evidence)
    if counts and counts[0] > spec.end_step - spec.first_step:
        return ("mismatch", f"the ranks took {counts[0]} steps; at most {spec.end_step - spec.first_step} are possible "
                f"({spec.epochs} epoch(s) of {spec.steps_per_epoch})", evidence)
    for k in range(counts[0] if counts else 0):
        seen: Dict[int, int] = {}
        for r, o in enumerate(outputs):
            for i in o.steps[k].indices:
                if not 0 <= i < spec.dataset_size:
                    return ("mismatch", f"rank {r}, step {k}: drew index {i}, not a dataset index (0.."
                            f"{spec.dataset_size - 1}): the data path feeds samples that are not in the dataset",
                            evidence)
                if i in seen:
                    return ("mismatch", f"step {k}: sample {i} was processed by rank {seen[i]} and again by "
                            f"rank {r}: each sample's inclusion must be one Bernoulli draw per step; a sample "
                            "counted twice has twice the influence the clip bound allows", evidence)
                seen[i] = r
    return None


def physical_problem(spec: RunSpec, outputs: Sequence[RankOutput]) -> Optional[Tuple[str, str, dict]]:
    """What is wrong with the physical passes the ranks report under gradient accumulation
    (``spec.physical_batch_size`` p > 0), as ``(diagnosis, message, evidence)``, or ``None``: each
    step must say how it was split (a target that ignores p would run unsplit and pass every
    comparison), every pass must hold at most p samples and the passes all of the step's samples
    (``mismatch``), and the ranks must run equally many passes per step (``step_divergence``: under
    FSDP every pass joins collectives)."""
    p = spec.physical_batch_size
    if not p:
        return None
    counts = [[len(s.physical_batches or ()) for s in o.steps] for o in outputs]
    evidence = {"physical_passes_per_step": counts}
    for o in outputs:
        for k, s in enumerate(o.steps):
            sizes = s.physical_batches
            if not sizes:
                return ("mismatch", f"rank {o.rank}, step {k}: no physical passes reported for physical_batch_size={p} "
                        "(StepOutput.physical_batches): does the target implement gradient accumulation?", evidence)
            if max(sizes) > p or sum(sizes) != len(s.indices):
                return ("mismatch", f"rank {o.rank}, step {k}: physical passes of sizes {list(sizes)} for a local "
                                    "batch "
                        f"of {len(s.indices)} with physical_batch_size={p}: each pass must hold at most p samples and "
                        "the passes together exactly the step's samples", evidence)
    steps = min((len(c) for c in counts), default=0)
    for k in range(steps):
        per_rank = [c[k] for c in counts]
        if len(set(per_rank)) > 1:
            return ("step_divergence", (
                f"step {k}: the ranks ran different numbers of physical passes "
                f"({grouped({r: str(n) for r, n in enumerate(per_rank)}, ': ', ', ')}; every rank's passes per step in "
                "the evidence). "
                "Under FSDP every pass joins collectives: passes that differ pair across logical steps and the "
                "rank with more passes waits forever at the end"), evidence)
    return None


def privacy_steps_problem(spec: RunSpec, outputs: Sequence[RankOutput]) -> Optional[Tuple[str, str, dict]]:
    """What is wrong with the privacy step counts a run reports (``StepOutput.privacy_steps``), as
    ``(diagnosis, message, evidence)``, or ``None`` (also where no step reports a count). The
    accountant composes one DP step per released update: after step j of a run it has counted
    ``first_step + j + 1`` on every rank -- not one per physical pass, not only the steps whose
    local batch held a sample. A resumed run's ``load`` half must count one per step from where
    it starts; where it starts (the steps restored from the checkpoint) is checkpoint_resume's to
    judge, against its ``save`` half. ``step_count_wrong``."""
    # Optional[int] each: a row with a None returns below before any arithmetic on it
    counts: List[List[Any]] = [[s.privacy_steps for s in o.steps] for o in outputs]
    if all(c is None for row in counts for c in row):
        return None
    evidence = {"privacy_steps": counts}
    for o, row in zip(outputs, counts):
        if any(c is None for c in row):
            return ("step_count_wrong", f"rank {o.rank} reports no privacy step count (StepOutput.privacy_steps) after "
                    f"some steps: {row}. A target that reports the count reports it after every DP step", evidence)
    # the counts each rank should report, and what a count per physical pass / per non-empty batch would be
    resumed = spec.phase == "load"
    for o, row in zip(outputs, counts):
        start = (row[0] - 1) if resumed and row else spec.first_step
        want = [start + j + 1 for j in range(len(row))]
        if row == want:
            continue
        passes = [start + sum(len(s.physical_batches or (0,)) for s in o.steps[:j + 1]) for j in range(len(row))]
        nonempty = [start + sum(1 for s in o.steps[:j + 1] if len(s.indices)) for j in range(len(row))]
        k = next(j for j, (g, w) in enumerate(zip(row, want)) if g != w)
        if spec.physical_batch_size and row == passes:
            how = "it counts one step per physical pass (its count is the passes run so far), not one per DP step"
        elif row == nonempty:
            how = "it does not count the steps whose local batch on this rank was empty, though they were taken"
        elif k and row[k] == row[k - 1]:
            how = f"its count does not advance at step {spec.first_step + k}"
        else:
            how = "it does not count one per DP step"
        if row[k] > want[k]:
            meaning = ("the accountant composes more steps than were released: the reported epsilon is too large "
                       "(over-reported, and the accountant does not count DP steps)")
        else:
            meaning = ("PRIVACY VIOLATION in the accounting: the accountant composes fewer steps than were released, "
                       "so the reported epsilon is smaller than the run's privacy loss")
        ranks = "" if all(r == counts[0] for r in counts) else (
            "; the ranks' counts differ (" + ", ".join(f"rank {x.rank}: {r}" for x, r in zip(outputs, counts)) + ")")
        return ("step_count_wrong", f"rank {o.rank}: the privacy step count (StepOutput.privacy_steps) after each step "
                f"is {row}, expected {want}: {how}{ranks}. {meaning[0].upper() + meaning[1:]}.", evidence)
    if any(r != counts[0] for r in counts):
        return ("step_count_wrong", "the ranks' privacy step counts differ: " + ", ".join(
            f"rank {x.rank}: {r}" for x, r in zip(outputs, counts)) + ". The accountant's step count is one number for "
            "the run: ranks that disagree report different epsilons for the same release", evidence)
    return None


#: told sigma and q compared with the run's to rounding (relative)
TOLD_RTOL = 1e-9


def _expand(history) -> List[Tuple[float, float]]:
    return [(float(s), float(q)) for s, q, n in history for _ in range(int(n))]


def _step_count_how(spec: RunSpec, outputs: Sequence[RankOutput], told: int) -> str:
    """Which miscount a told step count that is not the steps taken is (``HistoryFinding.how``)."""
    steps = len(outputs[0].steps)
    if spec.physical_batch_size and told == _passes_counted(spec, outputs):
        return "per_pass"
    if spec.phase == "load" and told == steps:
        return "lost_restored"
    if spec.phase == "load" and told == spec.first_step + steps + spec.first_step:
        return "restored_twice"
    return "load_other" if spec.phase == "load" else "not_per_step"


def _told_parameter_finding(spec: RunSpec, history, resume_at: Optional[int]) -> Optional[HistoryFinding]:
    """A told sigma other than the run's, or (Poisson) a told q other than the configured one."""
    told = _expand(history)
    sigma = float(spec.noise_multiplier)
    wrong = sorted({s for s, _ in told if abs(s - sigma) > TOLD_RTOL * max(sigma, 1e-300)})
    if wrong:
        return HistoryFinding("sigma", history, resume_at, wrong=tuple(wrong), expected=sigma)
    if spec.poisson:
        q = float(spec.sample_rate)
        wrong = sorted({r for _, r in told if abs(r - q) > TOLD_RTOL * q})
        if wrong:
            return HistoryFinding("rate", history, resume_at, wrong=tuple(wrong), expected=q,
                                  physical_batch_size=spec.physical_batch_size)
    return None


def _epsilon_finding(spec: RunSpec, outputs: Sequence[RankOutput], history, resume_at: Optional[int],
                     evidence: Dict[str, Any]) -> Optional[HistoryFinding]:
    """A reported epsilon the ranks disagree on, or outside the interval a valid epsilon of the told
    history lies in (``accounting_bounds``: the sound floor .. the classic RDP conversion), whatever
    the accountant's kind; fills ``evidence``."""
    reported = [o.epsilon for o in outputs]
    if not (spec.accountant_delta > 0 and any(r is not None for r in reported) and float(spec.noise_multiplier) > 0):
        return None
    from ...targets import accounting, accounting_bounds
    from ..analysis.accountant import derived_deltas

    if any(r != reported[0] for r in reported):
        return HistoryFinding("epsilons_differ", history, resume_at, reported=reported)
    delta = spec.accountant_delta
    want = accounting.epsilon(history, delta)
    got = float(cast(float, reported[0]))  # every rank's the same, one not None
    low = accounting_bounds.epsilon_floor(history, delta)
    high = accounting_bounds.classic_epsilon(history, delta) * (1 + 1e-6)
    evidence.update(reported_epsilon=got, independent_epsilon=want, delta=delta, epsilon_interval=[low, high])
    if low <= got <= high:
        return None
    # named for a hard-coded delta or another step count only where the reported epsilon is exactly
    # (1e-6) the suite's RDP epsilon of the told history at that delta or of that count: the best
    # explanation, not one that fits by chance
    other = accounting.delta_of(history, got, delta, extra=derived_deltas(spec))
    steps = accounting.steps_of(history, got, delta) if other is None else None
    return HistoryFinding("epsilon", history, resume_at, delta=delta, want=want, got=got,
                          accountant=outputs[0].accountant, floor=low, ceiling=high, at_delta=other, at_steps=steps,
                          steps_how="" if steps is None else _epsilon_steps_how(spec, outputs, steps))


#: the diagnosis of an accountant finding with a direction (``HistoryFinding.direction``)
DIRECTION_DIAGNOSES = {"under": "epsilon_under_reported", "over": "epsilon_over_reported"}


def _epsilon_steps_how(spec: RunSpec, outputs: Sequence[RankOutput], steps: int) -> str:
    """Which count an epsilon of ``steps`` steps is (``HistoryFinding.steps_how``)."""
    if spec.phase == "load" and steps == len(outputs[0].steps):
        return "since_resume"
    return "per_pass" if spec.physical_batch_size and steps == _passes_counted(spec, outputs) else ""


def _passes_counted(spec: RunSpec, outputs: Sequence[RankOutput]) -> int:
    """The steps an accountant counting one per physical pass reports: the restored steps of a
    resumed ``load`` half, then each step's passes."""
    return spec.first_step + sum(len(s.physical_batches or (0,)) for s in outputs[0].steps)


def accountant_history_problem(spec: RunSpec, outputs: Sequence[RankOutput]) -> Optional[Tuple[str, str, dict]]:
    """What is wrong with the accountant a run reports at its end (``RankOutput.accountant_history``,
    ``epsilon``), as ``(diagnosis, message, evidence)``, or ``None`` (also where no rank reports
    one). On every run of every property, whatever its loop shape: every rank reports the same
    history; its steps add up to the DP steps the run took -- ``first_step`` restored ones included
    in a resumed ``load`` half, one per logical step under gradient accumulation (never one per
    physical pass); every sigma it was told is the run's noise multiplier; under Poisson sampling
    every q it was told is the configured q (fixed batches have no rate: not judged); and an epsilon
    it reports lies in the interval of the valid epsilons of that history (``targets.accounting_bounds``:
    not below the sound floor, not above the classic RDP conversion), whatever its kind (RDP, PRV,
    GDP). ``epsilon_under_reported`` where what it reports (or the told sigma or q implies) is smaller
    than the run's privacy loss, ``epsilon_over_reported`` where larger, ``accountant_mismatch`` otherwise.
    Deterministic. What the told sigma is against the *measured* noise is
    noise_calibration's (``analysis/accountant.py``). The message is ``wording.accountant``'s."""
    histories = [o.accountant_history for o in outputs]
    if all(h is None for h in histories):
        return None
    evidence: Dict[str, Any] = {"accountant_history": histories[0], "accountant": outputs[0].accountant}
    resume_at = spec.resume_at if spec.phase == "load" else None
    first = list(map(tuple, histories[0] or ()))
    if any(h is None for h in histories) or any(list(map(tuple, h or ())) != first for h in histories):
        found = HistoryFinding("ranks_disagree", resume_at=resume_at,
                               told_by=tuple((o.rank, o.accountant_history) for o in outputs))
        return "accountant_mismatch", history_message(found), evidence
    history = cast(list, histories[0])  # every rank's, none None (checked above)
    told, taken = len(_expand(history)), spec.first_step + len(outputs[0].steps)
    if told != taken:
        found = HistoryFinding("step_count", history, resume_at, told_steps=told, taken=taken,
                               how=_step_count_how(spec, outputs, told), first_step=spec.first_step,
                               after_resume=told - len(outputs[0].steps))
        return "accountant_mismatch", history_message(found), dict(evidence, steps_taken=taken)
    problem = (_told_parameter_finding(spec, history, resume_at)
               or _epsilon_finding(spec, outputs, history, resume_at, evidence))
    if problem is None:
        return None
    return DIRECTION_DIAGNOSES.get(problem.direction, "accountant_mismatch"), history_message(problem), evidence


__all__ = ["accountant_history_problem", "TOLD_RTOL", "frozen_problem", "device_facts", "tf32_problem", "non_finite",
           "all_padding_note", "data_problem", "poisson_problem", "physical_problem", "privacy_steps_problem"]

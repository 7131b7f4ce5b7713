"""Run a property: plan its cases, run them on worker groups, judge them -- the one loop every
property (and the fuzzer) goes through.

Data flows one way: ``Options`` -> ``Property.plan`` -> ``Case``s -> ranks (``run_cases``) ->
``outputs[mode][spec][rank]`` -> ``Property.judge`` -> ``Verdict``. A case whose run hung or
crashed gets that as its verdict here (``hang``/``deadlock``, ``hang``/``timeout`` or
``error``/``rank_crash``), never an exception; a backend that cannot give the ranks is a ``skip``
with the reason. Only a deadlock the harness *proved* is ``deadlock`` (``step_divergence`` when the
ranks' progress trails show different step counts); a deadline that passed unproven is
``timeout``, naming the busy rank(s). A case's deadline is ``case_deadline``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union, cast

from ...harness import DEFAULT_TIMEOUT_S, JobPool, default_pool
from ...harness.group import BackendUnavailable, GroupResult, NotRunHere
from ...config.modes import Mode
from ...models.errors import Float64Unsupported
from ...targets import RankOutput, RunSpec, progress, run_many_on_rank
from ...targets.crash_site import CrashSite, locate
from ...verdict import Verdict, config_label
from .contract import DEFAULT_PRECISION_FACT, Case, Options, Outputs, Property, modes_problem
from .own_models import float64_skip
from .session import Session, listener_of
from .threads import one_thread
from ..wording.failures import FailureFinding, failure_details, failure_lead, failure_message, in_mode
from .prechecks import (accountant_history_problem, all_padding_note, data_problem, device_facts, frozen_problem,
                        non_finite, physical_problem, poisson_problem, privacy_steps_problem, tf32_problem)


#: ``fuzz(prop, opts, pool) -> verdicts``: a property's fuzz runs (``dpfsdp_verify.fuzz.fuzz_examples``
#: with the number of examples bound), handed in by the caller: the runner never imports the fuzzer
Fuzzer = Callable[[Property, Options, Optional[JobPool]], List[Verdict]]


def case_deadline(deadline: Optional[float], timeout: float) -> float:
    """The watchdog deadline of a job whose case states ``deadline`` (``None``: none), under the
    user's ``timeout``: ``min(timeout, max(deadline, deadline * timeout / DEFAULT_TIMEOUT_S))``.

    A built-in deadline is a share of the default timeout (``DEFAULT_TIMEOUT_S``): at the
    default it is what the case states; a longer timeout raises it in proportion (a target slow
    enough to need twice the timeout gets twice the deadline in every case); a shorter one caps
    it -- no job ever runs longer than the timeout the user gave."""
    if deadline is None:
        return timeout
    return min(timeout, max(deadline, deadline * timeout / DEFAULT_TIMEOUT_S))


def run_property(prop: Property, opts: Options, pool: Optional[JobPool] = None, fuzz: Optional[Fuzzer] = None,
                 session: Optional[Session] = None) -> List[Verdict]:
    """Every verdict of ``prop`` under ``opts``, in report order; then, with ``fuzz``, its fuzz
    runs' verdicts where it has a recipe and the modes suit it; ``session``: the run's ledger and
    listener (``session.Session``). (The gate's scheduler runs the same three steps,
    ``plan_property``, ``judge_cases`` + ``in_plan_order``, ``fuzz_property``, pipelined:
    ``gate/scheduler.py``.)"""
    opts, items, cases = plan_property(prop, opts)
    verdicts = in_plan_order(items, judge_cases(prop, cases, pool, opts.timeout, session))
    return verdicts + fuzz_property(prop, opts, pool, fuzz)


def plan_property(prop: Property, opts: Options) -> Tuple[Options, list, List[Case]]:
    """``prop``'s options with its defaults, its plan (cases and plan-time verdicts, in report
    order) and the plan's cases."""
    opts = prop.with_defaults(opts)
    items = prop.plan(opts)
    return opts, items, [c for c in items if isinstance(c, Case)]


def in_plan_order(items: Sequence[Union[Case, Verdict]], judged: Sequence[Verdict]) -> List[Verdict]:
    """The plan's verdicts in report order: each case's verdict (``judged``, in case order) where the
    plan has the case."""
    it = iter(judged)
    return [next(it) if isinstance(item, Case) else item for item in items]


def fuzz_property(prop: Property, opts: Options, pool: Optional[JobPool], fuzz: Optional[Fuzzer]) -> List[Verdict]:
    """With ``fuzz``, ``prop``'s fuzz runs' verdicts (its recipe, modes that suit it; ``opts`` with its
    defaults); a bug of the fuzzer is its ``internal_error`` verdict (the matrix's verdicts stand)."""
    if fuzz is None or (prop.fuzz is None and prop.explore is None) or modes_problem(prop, opts.modes):
        return []
    t0 = time.monotonic()
    try:
        return fuzz(prop, opts, pool)
    except Exception as e:  # the fuzzer's bug: the matrix's verdicts still stand
        return [prop.internal_error(opts, "fuzzing", e, time.monotonic() - t0)]


def check_example(prop: Property, opts: Options, spec: RunSpec, world_size: int, pool: JobPool,
                  modes: Sequence[Mode] = (), session: Optional[Session] = None) -> Verdict:
    """The verdict of one fuzzed ``spec`` at ``world_size`` (``Property.fuzz_case``: a spec the
    recipe cannot use is a ``skip``). ``modes`` (default: the options' first mode group) holds one
    mode, or two for a property that compares modes (the first is compared with the second)."""
    modes = tuple(modes) or prop.mode_groups(opts.modes, opts.params)[0]
    # the reference in this process on one thread, as the ranks run: one switch per example
    with one_thread():
        case = prop.fuzz_case(opts, spec, world_size, modes)
        if isinstance(case, Verdict):
            return case
        outcome = run_cases([case], pool, opts.timeout)[0]
        return settle(prop, case, outcome, session)


def judge_cases(prop: Property, cases: Sequence[Case], pool: Optional[JobPool], timeout: float,
                session: Optional[Session] = None) -> List[Verdict]:
    """Run ``cases`` and judge each (``judge_case``), or give it its run's failure verdict; with a
    ``session`` listener (``session.Session``), each as soon as its runs are in, told to it (the
    verdicts are the same; only when they are judged differs, and so the order in which the
    session's ledger takes the cases' runs)."""
    listener = listener_of(session)
    if listener is None:
        outcomes = run_cases(cases, pool, timeout)
        return [settle(prop, case, outcome, session) for case, outcome in zip(cases, outcomes)]
    judged: Dict[int, Verdict] = {}

    def ready(i: int, outcome) -> None:
        judged[i] = settle(prop, cases[i], outcome, session)
        listener(cases[i], judged[i])

    run_cases(cases, pool, timeout, on_ready=ready)
    return [judged[i] for i in range(len(cases))]


def settle(prop: Property, case: Case, outcome: Union[Verdict, Outputs], session: Optional[Session] = None
           ) -> Verdict:
    """A case's verdict: its run's failure verdict or ``judge_case``'s, unless its model (one of its
    own) cannot run in float64, which is a ``skip`` saying why either way (``own_models``)."""
    skipped = float64_skip(case)
    if skipped is not None:
        return skipped
    return outcome if isinstance(outcome, Verdict) else judge_case(prop, case, outcome, session)


def judge_case(prop: Property, case: Case, outputs: Outputs, session: Optional[Session] = None) -> Verdict:
    """What every property requires before its own judgement, then ``prop.judge``; every verdict's
    evidence names the device the ranks computed on and, on CUDA, the TF32 switches in force
    (``prechecks.device_facts``):

    * a target that cannot do what was asked (``RankOutput.unsupported``, e.g. no data pipeline to
      sample from) is a ``fail`` saying so: what a target cannot do is a verdict, never a skip (a
      user who accepts it says so explicitly) -- but an explored draw (``Case.explored``) of a feature
      the target does not declare is a ``skip``: the fixed cases give that verdict, once; one that
      *refuses* the configuration (it raised ``targets.Refused``, e.g. for tied parameters) is
      ``fail`` / ``refused`` with its reason;
    * every rank took the steps it was asked for and processed exactly the samples it was given
      (read back from the data, not echoed): otherwise ``fail`` / ``mismatch`` -- no property can
      compare against the reference on other data. A Poisson run's samples are random: its ranks
      must have taken the same number of steps (else ``fail`` / ``step_divergence``, with each
      rank's step count and local batch sizes), drawn valid dataset indices, and no sample twice
      within a step across ranks (else ``fail`` / ``mismatch``); under gradient accumulation every
      step says how it was split into physical passes, and the ranks ran equally many
      (``prechecks.physical_problem``);
    * a target that reports its privacy step count counts one per DP step on every rank
      (``prechecks.privacy_steps_problem``: else ``fail`` / ``step_count_wrong``);
    * a target that reports its accountant reports, at the end of every run, a history of the steps
      the run took (restored ones included) at the run's sigma and q, and the RDP epsilon of it
      (``prechecks.accountant_history_problem``: else ``fail`` / ``accountant_mismatch``, given once the
      property's own judgement passed, so that a property judging the accountant itself -- against
      the noise it measured -- words that finding, and a property's own failure is not hidden);
    * a float32 case computed with TF32 in force (the target re-enabled it) cannot be judged at
      float32 tolerances: a ``fail`` saying so (``prechecks.tf32_problem``);
    * a frozen parameter (``requires_grad=False``: a fine-tuned model's base) received no
      gradient, no noise and no update, exactly (else ``fail`` / ``frozen_updated``);
    * everything reported is finite: otherwise ``fail`` / ``non_finite`` naming the tensor, step
      and rank -- no comparison or test statistic may read NaN as agreement.
    """
    verdict = _judge_case(prop, case, outputs, session)
    if outputs and outputs[0]:
        verdict.evidence = {**device_facts(outputs[0][0]), **verdict.evidence}
    return verdict


def _judge_case(prop: Property, case: Case, outputs: Outputs, session: Optional[Session]) -> Verdict:
    accountant = None  # the first run whose accountant is wrong: judged once the property's own verdict passes
    for mode, runs in zip(case.modes, outputs):
        for spec, ranks in zip(case.specs, runs):
            spec = mode.apply(spec)
            where = f" (mode {mode.label!r})" if len(case.modes) > 1 else ""
            refused = next((o.refused for o in ranks if o.refused), None)
            if refused:
                return case.verdict("fail", "refused", f"the target refuses this configuration: {refused}{where}",
                                    {"refused_ranks": [o.rank for o in ranks if o.refused]})
            unsupported = next((o.unsupported for o in ranks if o.unsupported), None)
            if unsupported and case.facts.get(DEFAULT_PRECISION_FACT) and spec.precision != "fp32":
                return case.verdict("skip", None, (
                    f"not run: {unsupported}{where}. A run without --precisions judges each bf16 form once where "
                    "the target declares it; --precisions asks for it (then an undeclared form fails)"))
            if unsupported and case.explored:  # the fixed cases give that verdict, once
                return case.verdict("skip", None, f"explored configuration not run: {unsupported}{where}")
            if unsupported:
                return case.verdict("fail", None, f"not checkable on this target: {unsupported}{where}")
            tf32 = tf32_problem(spec, ranks)
            if tf32:
                return case.verdict("fail", None, f"not checkable on this target: {tf32}{where}")
            # fixed batches are compared with what was given; Poisson draws with what sampling guarantees
            if spec.poisson:
                found = poisson_problem(spec, case.world_size, ranks)
            else:
                problem = data_problem(spec, case.world_size, ranks)
                found = ("mismatch", problem, {}) if problem else None
            found = found or physical_problem(spec, ranks) or privacy_steps_problem(spec, ranks)
            if accountant is None:
                told = accountant_history_problem(spec, ranks)
                accountant = (told[0], told[1] + where, told[2]) if told else None
            if found:
                diagnosis, message, evidence = found
                return case.verdict("fail", diagnosis, message + where, evidence)
            if spec.task == "train":
                frozen = frozen_problem(spec, ranks)
                if frozen:
                    return case.verdict("fail", "frozen_updated", frozen[0] + where, frozen[1])
            problem = non_finite(ranks)
            if problem:
                return case.verdict("fail", "non_finite", f"non-finite values released: {problem}{where}. A DP "
                                    "step must release finite values; NaN/inf noise or clip coefficients make the "
                                    "update meaningless and its privacy analysis void."
                                    + all_padding_note(spec, ranks))
    if session is not None:  # every noisy run is evidence for the noise at every step (releases/judge.py)
        session.feed(case, outputs)
    try:
        verdict = prop.judge(case, outputs)
    except Float64Unsupported as e:  # a model of its own that has no float64 reference (docs/models.md)
        return case.verdict("skip", None, f"{e}: the model cannot run in float64, so there is no float64 reference "
                                          "to judge it against (docs/models.md)")
    if accountant is not None and verdict.status == "pass":
        # after the property's own verdict: a property that judges the accountant itself against what it
        # measured (noise_calibration) words its finding with the measured mechanism
        diagnosis, message, evidence = accountant
        return case.verdict("fail", diagnosis, message, {**verdict.evidence, **evidence})
    return verdict


# -- running -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Run:
    """What one mode of one case asks of the ranks; cases asking the same share one run."""

    target_ref: str
    backend: str
    world_size: int
    mode: Mode
    specs: Tuple[RunSpec, ...]
    isolate_key: Optional[int] = None
    deadline: Optional[float] = None
    fresh_groups: int = 0
    fresh_jobs: Tuple[int, ...] = ()


@dataclass
class _Failed:
    result: GroupResult
    others_in_job: int  # how many other runs shared the job
    seconds: float
    #: each rank's progress trail of its last run (``targets.progress``), read after the failure
    trails: Optional[list] = None
    #: the job's hang was put on this run alone: the ranks' trails show it running (else the hang is
    #: the whole job's)
    attributed: bool = False


@dataclass(frozen=True)
class _NotRun:
    """A run left out after its job hung in another one, ``hung`` (``_split_at_hang``): it has no
    verdict of its own -- no hang is claimed for a configuration that did not hang."""

    hung: _Run
    #: the hang was a proven deadlock (else the job's deadline passed)
    proven: bool


def run_cases(cases: Sequence[Case], pool: Optional[JobPool], timeout: float,
              on_ready: Optional[Callable[[int, Any], None]] = None, shared: Optional[Dict[Any, list]] = None
              ) -> List[Union[List[List[List[RankOutput]]], Verdict]]:
    """For each case, ``outputs[mode][spec][rank]`` or the case's failure verdict; ``on_ready(i,
    that)`` is called for case ``i`` as soon as the job that settles its last run has ended (a
    job's runs are settled when it returns, its retries and splits included), once per case.
    ``shared``: the outputs of runs made by earlier calls, by run (the gate's, across properties:
    ``gate/scheduler.py``): a run asked again -- the same target, backend, world size, mode, specs
    and deadline, in a warm group -- takes them instead of running again, and this call's
    finished runs are added.

    Runs sharing (world size, env, backend, target) go to the ranks as one job (one job per case
    for ``Case.isolate``; ``Case.fresh_groups`` cases in groups of ranks started for them, ``_run_fresh``).
    A job that *errors* is re-run run by run so the crash lands on the right case. A job that
    *hangs* is told apart by its ranks' progress trails (``_split_at_hang``): the hang verdict goes
    to the one run the ranks were in, the runs that had ended are run again for their own verdicts,
    and the runs not yet begun are run again after a proven deadlock (a proof costs ~1 s) -- unless
    the job hung in its very first run with none finished (a target that hangs everywhere would
    cost a proof per run) or its deadline passed unproven (another deadline per retry): those are
    ``skip`` verdicts, "not run", naming the configuration that hung.
    """
    pool = pool or default_pool()
    runs_of = [[_Run(c.target_ref, c.backend, c.world_size, m, tuple(m.apply(s) for s in c.specs),
                     i if c.isolate or c.fresh_groups else None, c.deadline, c.fresh_groups, c.fresh_jobs)
                for m in c.modes]
               for i, c in enumerate(cases)]
    unique = list(dict.fromkeys(r for runs in runs_of for r in runs))
    done: Dict[_Run, Union[list, str, _NotRun, _Failed]] = {}  # outputs, a skip's reason, or why not
    seconds: Dict[_Run, float] = {}
    jobs: Dict[tuple, List[_Run]] = {}
    for r in unique:
        if shared is not None and r in shared:
            done[r] = shared[r]
        else:
            jobs.setdefault((r.world_size, r.mode.env, r.backend, r.target_ref, r.isolate_key), []).append(r)
    case_of: Dict[_Run, Case] = {}
    for case, runs in zip(cases, runs_of):
        for r in runs:
            case_of.setdefault(r, case)
    out: Dict[int, Any] = {}

    def settle() -> None:  # every case whose runs are all in, in case order
        for i, (case, runs) in enumerate(zip(cases, runs_of)):
            if i not in out and all(r in done for r in runs):
                out[i] = _outcome(case, runs, done, seconds, case_of)
                if on_ready is not None:
                    on_ready(i, out[i])

    for runs in jobs.values():
        if runs[0].fresh_groups:
            _run_fresh(runs[0], pool, timeout, done, seconds)
        else:
            _run_job(runs, pool, timeout, done, seconds, allow_split=True)
        if on_ready is not None:
            settle()
    settle()
    if shared is not None:
        shared.update((r, cast(list, done[r])) for r in unique
                      if r.isolate_key is None and not r.fresh_groups and isinstance(done[r], list))
    return [out[i] for i in range(len(cases))]


def _outcome(case: Case, runs: List[_Run], done: dict, seconds: dict, case_of: Dict[_Run, Case]):
    """``case``'s outputs, or its failure verdict, once every one of its ``runs`` is in ``done``."""
    case.seconds += sum(seconds.get(r, 0.0) for r in runs)
    failed = next(((i, done[r]) for i, r in enumerate(runs) if not isinstance(done[r], list)), None)
    if failed is None:
        return [done[r] for r in runs]
    if isinstance(failed[1], str):
        return case.verdict("skip", None, failed[1])
    if isinstance(failed[1], _NotRun):
        return not_run_verdict(case, case_of[failed[1].hung], failed[1].proven)
    return failure_verdict(case, cast(_Failed, failed[1]), failed[0])  # not a list, str or _NotRun


def _run_job(runs: List[_Run], pool: JobPool, timeout: float, done: dict, seconds: dict, allow_split: bool,
             any_finished: bool = False) -> None:
    """Run ``runs`` as one job and put each one's outputs (or failure) in ``done``. ``any_finished``:
    a run of the job this one retries has finished (``_split_at_hang``)."""
    r0 = runs[0]
    checkpoints = tempfile.mkdtemp(prefix="dpfsdp-checkpoints-")
    flat = [with_checkpoint_dir(s, checkpoints) for r in runs for s in r.specs]
    t0 = time.monotonic()
    trail_dir = tempfile.mkdtemp(prefix="dpfsdp-progress-")
    try:
        res = pool.run(run_many_on_rank, r0.target_ref, flat, world_size=r0.world_size, backend=r0.backend,
                       env=r0.mode.env_dict or None, timeout=min(case_deadline(r.deadline, timeout) for r in runs),
                       evidence=progress.watch(trail_dir, r0.world_size), progress_dir=trail_dir)
        trails = progress.read(trail_dir, r0.world_size) if not res.ok else None
    except BackendUnavailable as e:
        for r in runs:
            done[r] = _unavailable(e)
        return
    finally:
        shutil.rmtree(trail_dir, ignore_errors=True)
        shutil.rmtree(checkpoints, ignore_errors=True)
    share = (time.monotonic() - t0) / len(runs)
    for r in runs:
        seconds[r] = seconds.get(r, 0.0) + share
    if res.ok:
        per_rank = res.values()  # [rank][spec]
        pos = 0
        for r in runs:
            n = len(r.specs)
            done[r] = [[per_rank[k][pos + j] for k in range(r0.world_size)] for j in range(n)]
            pos += n
        return
    if res.status == "error" and allow_split and len(runs) > 1:
        for r in runs:
            _run_job([r], pool, timeout, done, seconds, allow_split=False)
        return
    if res.status == "hang" and len(runs) > 1 \
            and _split_at_hang(runs, res, trails, share, pool, timeout, done, seconds, any_finished):
        return
    for r in runs:
        done[r] = _Failed(res, len(runs) - 1, share, trails)


def _split_at_hang(runs: List[_Run], res: GroupResult, trails: Optional[list], share: float, pool: JobPool,
                   timeout: float, done: dict, seconds: dict, any_finished: bool) -> bool:
    """A job of several runs hung: put the hang on the run the ranks were in (``progress.hung_run_index``:
    the first run some rank had not ended), run the ones that ended again in a job of their own (their
    outputs died with the hung job), and the ones after it again in another -- which may hang in its
    turn and is split the same way. The runs after it are left out (``_NotRun``) when the deadline
    passed unproven (a retry could wait a whole deadline again) or when the job hung in its first run
    and no run of it (or of the job it retries) has finished: a target that hangs in every
    configuration would cost a deadlock proof per run. False when the trails cannot tell (a rank
    left none): the hang is then the whole job's."""
    index = progress.hung_run_index(trails)
    ends = [sum(len(r.specs) for r in runs[:i + 1]) for i in range(len(runs))]
    if index is None or index >= ends[-1]:
        return False
    k = next(i for i, end in enumerate(ends) if index < end)
    done[runs[k]] = _Failed(res, len(runs) - 1, share, trails, attributed=True)
    before, after = runs[:k], runs[k + 1:]
    proven = res.diagnosis in PROVEN
    if after and not (proven and (k > 0 or any_finished)):
        for r in after:
            done[r] = _NotRun(runs[k], proven)
        after = []
    if after:
        _run_job(after, pool, timeout, done, seconds, allow_split=True, any_finished=any_finished or k > 0)
    if before:
        _run_job(before, pool, timeout, done, seconds, allow_split=True, any_finished=True)
    return True


def _run_fresh(r: _Run, pool: JobPool, timeout: float, done: dict, seconds: dict) -> None:
    """Each of the first ``r.fresh_groups`` specs of ``r`` as the first job of a worker group started for
    it (the rest run with the last of them): every group is spawned first (their start-ups
    overlap), then each runs its job and is closed."""
    t0 = time.monotonic()
    groups = []
    checkpoints = tempfile.mkdtemp(prefix="dpfsdp-checkpoints-")
    try:
        try:
            for _ in range(r.fresh_groups):
                groups.append(pool.fresh_group(r.world_size, r.backend, r.mode.env_dict or None))
        except BackendUnavailable as e:
            done[r] = _unavailable(e)
            return
        outs = []
        specs = [with_checkpoint_dir(s, checkpoints) for s in r.specs]
        counts = r.fresh_jobs or (1,) * (r.fresh_groups - 1) + (len(specs) - r.fresh_groups + 1,)
        jobs = [specs[sum(counts[:i]):sum(counts[:i + 1])] for i in range(len(counts))]
        for g, specs in zip(groups, jobs):
            trail_dir = tempfile.mkdtemp(prefix="dpfsdp-progress-")
            try:
                res = g.run(run_many_on_rank, (r.target_ref, specs), {"progress_dir": trail_dir},
                            timeout=min([timeout] + ([r.deadline] if r.deadline else [])),
                            evidence=progress.watch(trail_dir, r.world_size))
                trails = progress.read(trail_dir, r.world_size) if not res.ok else None
            finally:
                shutil.rmtree(trail_dir, ignore_errors=True)
            if not res.ok:
                done[r] = _Failed(res, 0, time.monotonic() - t0, trails)
                return
            per_rank = res.values()  # [rank][spec]
            outs += [[per_rank[k][j] for k in range(r.world_size)] for j in range(len(specs))]
        done[r] = outs
    finally:
        for g in groups:
            g.close()
        shutil.rmtree(checkpoints, ignore_errors=True)
        seconds[r] = seconds.get(r, 0.0) + time.monotonic() - t0


def _unavailable(e: BackendUnavailable) -> str:
    """The skip reason of a run the pool could not give ranks to."""
    return str(e) if isinstance(e, NotRunHere) else f"backend unavailable: {e}"


def with_checkpoint_dir(spec: RunSpec, root: str) -> RunSpec:
    """``spec`` with a resumed run's relative ``checkpoint_dir`` placed under ``root`` (a temporary
    directory of the job, removed after it): the ``save`` and ``load`` halves naming the same
    directory meet there, and each case's checkpoints are its own."""
    if not spec.phase or os.path.isabs(spec.checkpoint_dir):
        return spec
    path = os.path.join(root, spec.checkpoint_dir)
    os.makedirs(path, exist_ok=True)
    return spec.with_(checkpoint_dir=path)


#: what torch's DTensor says when an in-place op (SGD's ``param.add_(grad)``) meets an operand in a
#: placement it cannot take without changing the parameter's (torch 2.13: "aten.add_.Tensor: in-place
#: operations that require placement changes are not supported. The input has placement ...")
PLACEMENT_ERRORS = ("in-place operations that require placement changes are not supported",)
#: a group's hang diagnoses that are proofs (``harness/proof.py``): a deadlock from the ranks' probes,
#: a step divergence from their progress trails while they were stalled
PROVEN = ("deadlock", "step_divergence")


def placement_crash(res: GroupResult) -> Optional[int]:
    """The first rank whose job raised DTensor's refusal of an in-place op across placements
    (``PLACEMENT_ERRORS``), or ``None``."""
    return next((r for r in res.failed_ranks() if (error := res.results[r].error) is not None
                 and any(m in error.message for m in PLACEMENT_ERRORS)), None)


def not_run_verdict(case: Case, hung: Case, proven: bool) -> Verdict:
    """The ``skip`` of a case left out after its job hung in ``hung`` (``_split_at_hang``)."""
    why = ("it hung in its first configuration before any other finished (a target that hangs in every "
           "configuration would cost a deadlock proof each)" if proven
           else "its deadline passed in that configuration, unproven (a retry could wait a whole deadline again)")
    where = f"{hung.property} [{config_label(hung.config())}]"
    return case.verdict("skip", None, f"not run: the job it shared hung in {where}; {why}. For its verdict run "
                        "it on its own (--properties, --world-sizes, --models, --loss-reductions, --dtypes narrow the "
                        "matrix).", {"not_run_after_hang_in": hung.config()})


def failure_finding(res: GroupResult, trails: list) -> FailureFinding:
    """What a hung or crashed group result is (``wording.failures.FailureFinding``): a hang is a
    deadlock only when proven (``timeout`` without a diagnosis); ranks whose step or pass counts
    diverged are a ``step_divergence``; a rank refused an in-place op across DTensor placements a
    ``placement_mismatch``; any other error a ``rank_crash``."""
    status = "hang" if res.status == "hang" else "error"
    # a hang is a deadlock only when proven; without a diagnosis nothing was
    diagnosis = res.diagnosis or ("timeout" if status == "hang" else "rank_crash")
    found = FailureFinding(status, diagnosis, "rank_crash", res.message, trails, list(res.busy_ranks), res.fired_at)
    placement_rank = placement_crash(res) if status == "error" else None
    if status == "hang" and diagnosis == "timeout":
        return replace(found, kind="timeout")
    if status == "hang" and diagnosis in PROVEN and progress.diverged(trails) and not progress.passes_diverged(trails):
        return replace(found, diagnosis="step_divergence", kind="step_divergence")
    if (status == "error" or diagnosis in PROVEN) and progress.diverged(trails) \
            and any(t.accumulating for t in trails):
        # gradient accumulation: passes, not only steps, must agree; a crash here is the same divergence
        # (a pass's collectives met another kind of collective on a peer, e.g. a gradient gather)
        outcome = ("crashed" if status == "error" else "stalled" if res.diagnosis == "step_divergence" else "hangs")
        return replace(found, diagnosis="step_divergence", kind="pass_divergence", outcome=outcome)
    if status == "hang":
        return replace(found, kind="deadlock")
    if placement_rank is not None:
        return replace(found, diagnosis="placement_mismatch", kind="placement_mismatch", placement_rank=placement_rank)
    return found


def failure_evidence(res: GroupResult, found: FailureFinding) -> Dict[str, Any]:
    """The evidence of a failure's verdict: the harness's status and failed ranks, what the kind of
    failure rests on, and every rank's progress."""
    trails = found.trails
    evidence: Dict[str, Any] = {"harness_status": res.status, "failed_ranks": res.failed_ranks()}
    if found.kind == "timeout":
        evidence["busy_ranks"] = list(res.busy_ranks)
    elif found.kind in ("step_divergence", "pass_divergence"):
        evidence.update({"step_counts": [t.begun for t in trails], "steps_finished": [t.finished for t in trails],
                         "local_batch_sizes": [t.sizes for t in trails]})
        if found.kind == "pass_divergence":
            evidence["physical_passes_per_step"] = [t.pass_counts for t in trails]
    elif found.kind == "placement_mismatch":
        evidence["placement_error_rank"] = found.placement_rank
    if trails:
        evidence["progress"] = progress.evidence(trails)
    return evidence


def crash_site(res: GroupResult, target_ref: str) -> Optional[CrashSite]:
    """Where the first rank that raised did (``targets.crash_site``), or ``None`` when no rank sent
    a traceback (a rank process that died, an error the job could not send)."""
    for r in res.failed_ranks():
        error = res.results[r].error
        if error is not None and error.frames:
            return locate(r, error.type, error.message, error.frames, target_ref)
    return None


def failure_verdict(case: Case, failed: _Failed, mode_index: int = 0) -> Verdict:
    """A hung or crashed run as the case's verdict (``hang``/``deadlock``, ``hang``/``timeout``,
    ``error``/``rank_crash``, or ``error``/``placement_mismatch`` when a rank's error is DTensor's
    refusal of an in-place op across placements, ``placement_crash``): ``failure_finding``'s finding,
    worded by ``wording.failures``."""
    res = failed.result
    found = failure_finding(res, failed.trails or [])
    evidence = failure_evidence(res, found)
    site = crash_site(res, case.target_ref) if found.status == "error" else None
    if site is not None:
        evidence["crash"] = site.evidence()
        found = replace(found, site=site.phrase())
    msg = failure_message(found, failure_lead(case.doing, failed.attributed, failed.others_in_job))
    if len(case.modes) > 1:
        mode = case.modes[mode_index]
        msg = in_mode(mode.label, mode.describe_env(), msg)
        evidence["failed_mode"] = mode.label
    return case.verdict(found.status, found.diagnosis, msg, evidence, seconds=failed.seconds,
                        details=failure_details(found, res.details))


__all__ = ["Fuzzer", "case_deadline", "run_property", "plan_property", "in_plan_order", "fuzz_property",
           "check_example", "one_thread", "judge_cases",
           "judge_case", "settle", "run_cases",
           "with_checkpoint_dir", "PLACEMENT_ERRORS", "placement_crash", "not_run_verdict", "failure_finding",
           "failure_evidence", "crash_site", "failure_verdict"]

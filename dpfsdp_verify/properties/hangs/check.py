"""deadlock_free: every run finishes under the watchdog, including uneven, single-sample and empty
local batches.

DP meaning: none directly -- but a DP job that hangs on some batch compositions is one that users
work around by changing sampling (dropping Poisson sampling, padding batches), which silently
changes the privacy accounting. Poisson sampling makes uneven and empty local batches normal.

Every scenario runs with noise on and C between the two largest norms of its batch (``upper_clip``: the
outcome does not depend on C; the runs feed the release judge, ``releases/judge.py``, where a noise
scale tied to the batch's norms shows). Scenarios (each its own job, so a hang is attributed to it),
two steps each:
``even`` (the plain split), ``uneven`` (rank 0 gets more samples than the last rank), ``single``
(one sample per rank), ``empty`` (the last rank gets none). Any hang is ``hang``/``deadlock``
with the harness's account of where the collective sequences diverge; a crash is
``error``/``rank_crash``; a rank that returns early (fewer steps than asked) fails ``mismatch``.
Nothing a target cannot do is skipped: a target that crashes on an empty local batch gets that
as its verdict (a user who accepts it says so explicitly).

Poisson scenarios (at world size > 1, a single rank cannot diverge; once per world size, for the
first model / reduction / dtype of the run): DP-SGD's own sampling, run
as a user runs it (``RunSpec.sampling = "poisson"``): a dataset the world size does not divide
(``N = 2 * ws + 1``), q = 1/ceil(N/ws) (opacus' q for one sample per local batch: an expected
local batch of about one, so empty local batches are common), ``EPOCHS`` epochs, seeded
``same`` (``poisson_same``) or ``per_rank`` (``poisson_per_rank``); ``poisson_unseeded`` (each
rank seeds from the OS) runs only when named in ``local_batches``: its outcome is random by
construction, and a gate's verdict must be reproducible. A Poisson run that hangs because the
ranks took different numbers of steps is ``hang`` / ``step_divergence``, told in DP terms from the
ranks' progress trails ("rank 0 ended its run after 5 step(s); rank 1 began step 6 ... and never
finished it") plus the harness's account of the collective it waits in.

Deadlines: a deadlock is *proven* within ~1-2 s whatever the deadline (the harness's
``proof.py``); the deadline only ends a run nothing proved stuck, and that is ``hang`` /
``timeout`` naming the busy rank, never ``deadlock``. The Poisson and accumulation scenarios state
built-in deadlines, ``POISSON_DEADLINE_S`` / ``ACCUM_DEADLINE_S`` (a correct run takes about a
second; the margin is for targets slower per step), which ``runner.case_deadline`` turns into the job's deadline under
the user's
timeout: ``min(timeout, max(D, D * timeout / DEFAULT_TIMEOUT_S))`` for a built-in ``D``
-- at the default timeout the built-in one, raised in proportion by a longer ``--timeout``, never
longer than the ``--timeout`` given. The other scenarios run under the timeout itself.


Beyond the matrix (``horizon.py``): at the wide world size (3 ranks) the ``uneven_accum`` scenario
alone (pass counts agreed with some ranks only, ``rank ^ 1``, diverge there); and one long run
at the largest world size, ``poisson_horizon``: ``Options.horizon`` steps of Poisson sampling
(``per_rank`` seeding, an expected local batch of 16, noise on), where a collective that some
ranks issue every k steps, or a sampler that changes after some epochs, hangs.

Beyond the fixed cases (``--explore``, docs/explore.md): configurations drawn from the space --
world sizes up to 4 on 2 cores, fixed batches of 1..64 per rank or Poisson sampling (runs of up to
200 steps), accumulation in physical batches, the models' variants, dtypes and bf16 forms, lr and C
anywhere among the norms -- each run for at least ``EXPLORE_MIN_STEPS`` steps with noise on
(``EXPLORE_SIGMA``): it must finish on every rank (a hang is proven and shrunk to the smallest
configuration), and its releases feed the release judge.

``history_twice`` (once, at the run's largest world size): noisy Poisson runs of 2 and 5 steps at one
(sigma, q, delta), then 5 at another sigma, then at another q, in the same rank processes, each asked for
its epsilon: an epsilon cached per process by a key without the steps, sigma or q fails one of them
(docs/properties.md, the accountant's interval).

Gradient-accumulation scenarios (world size > 1, once per world size like the Poisson ones;
``RunSpec.physical_batch_size`` = ``ACCUM_P`` = 1, so a rank's physical passes per step are its
local batch size): ``uneven_accum`` (the ``uneven`` split, fixed batches, ``STEPS`` logical
steps) and ``poisson_per_rank_accum`` (the ``poisson_per_rank`` scenario, ``ACCUM_EPOCHS``
epoch(s)). Every physical pass is a full FSDP forward/backward, so ranks that run different numbers
of passes pair their collectives across logical steps (same shapes: no error) until one rank
ends and the other waits forever: ``hang`` / ``step_divergence``, the message giving each rank's
logical steps and physical passes per step. A correct implementation has the ranks agree on the
pass count (e.g. the maximum, padding with empty passes). Their built-in deadline is
``ACCUM_DEADLINE_S`` (see Deadlines).
"""

from __future__ import annotations

from typing import Any, Dict, List

from ...verdict import Verdict
from ...targets import RunSpec
from ...targets.base import capped_epochs
from ..analysis.accountant import drawn_delta
from ..analysis.clipfit import clip_at_quantile, upper_clip
from ..engine.contract import Case, ExploreRecipe, Outputs, Point, Prepared, Property
from ..engine.horizon import horizon_labels, horizon_point, noisy_long_spec

STEPS = 2
#: an explored configuration (``explore_prepare``): at least this many steps, at the drawn noise
#: multiplier (``knobs["noise_multiplier"]``; this one where none was drawn)
EXPLORE_MIN_STEPS, EXPLORE_SIGMA = 2, 1.0
#: where a drawn resume point's checkpoint goes (the runner puts it under a directory of its own)
EXPLORE_CHECKPOINT = "explored"
EPOCHS = 4
#: ``history_twice`` (``history_twice_case``): the first two runs' steps, and their noise multiplier
TWICE_STEPS, TWICE_SIGMA = (2, 5), 1.7
#: ``history_twice``'s Poisson sampling: q, and samples per rank (an empty local batch 0.75^16 = 1 %)
TWICE_Q, TWICE_PER_RANK = 0.25, 16
#: its runs as ``(steps, sigma, q)``, in order: each changes one component of the history against the run
#: before it (the steps, then sigma, then q), so a cache keyed without any one of them returns an earlier
#: run's epsilon for one of them (a cache by (sigma, q, delta): the second; by (steps, delta): the third)
TWICE_RUNS = ((TWICE_STEPS[0], TWICE_SIGMA, TWICE_Q), (TWICE_STEPS[1], TWICE_SIGMA, TWICE_Q),
              (TWICE_STEPS[1], 2.3, TWICE_Q), (TWICE_STEPS[1], 2.3, 0.5))
#: built-in watchdog for a Poisson scenario at the default timeout (module docstring): a correct
#: one finishes in ~1 s on 2 loaded cores; 12 steps of a target taking ~2 s each still fit
POISSON_DEADLINE_S = 30.0
POISSON_SEEDINGS = ("same", "per_rank", "unseeded")
#: the Poisson scenarios run unless ``local_batches`` names others
POISSON_DEFAULT = ("poisson_same", "poisson_per_rank")
#: physical batch of the accumulation scenarios: one sample per pass
ACCUM_P = 1
ACCUM_EPOCHS = 1
#: built-in watchdog for an accumulation scenario at the default timeout (a correct one: ~1 s on 2
#: loaded cores; 3 steps of a target taking ~1 s each, e.g. ``SlowCorrect``, need ~6 s with start-up)
ACCUM_DEADLINE_S = 15.0
ACCUM_SCENARIOS = ("uneven_accum", "poisson_per_rank_accum")
#: the accumulation scenarios run unless ``local_batches`` names others (on a target that diverges each
#: costs a worker-group restart: the divergence ends in a crash at the suite's gather, or a hang)
ACCUM_DEFAULT = ACCUM_SCENARIOS

def scenarios(ws: int) -> Dict[str, tuple]:
    """``{name: split}`` where ``split[r]`` lists rank r's global indices (same split every step)."""
    b = 2 * ws
    out = {"even": tuple(tuple(range(r, b, ws)) for r in range(ws)), "single": tuple((r,) for r in range(ws))}
    if ws > 1:
        uneven: List[List[int]] = [[] for _ in range(ws)]
        for i in range(b):  # rank 0 gets one extra, the last rank one fewer
            uneven[0 if i == b - 1 else i % ws].append(i)
        out["uneven"] = tuple(tuple(u) for u in uneven)
        empty = [list(range(r, b, ws - 1)) for r in range(ws - 1)] + [[]]
        out["empty"] = tuple(tuple(e) for e in empty)
    return out


def poisson_spec(point: Point, seeding: str):
    ws = point.world_size
    n = 2 * ws + 1
    return upper_clip(point.spec(sampling="poisson", dataset_size=n, sample_rate=1 / -(-n // ws), epochs=EPOCHS,
                                 seeding=seeding, steps=0, noise_multiplier=1.0), planning=point.planning)


def cases(point: Point):
    """One case per scenario, each its own job so that a hang is pinned on the scenario. The
    Poisson scenarios run before ``empty``: a target that crashes there, or hangs in a Poisson
    scenario, costs one replacement worker group, not two."""
    only = point.param("local_batches")
    fixed = []
    for name, split in scenarios(point.world_size).items():
        if only is not None and name not in only:
            continue
        sizes = [len(s) for s in split]
        spec = upper_clip(point.spec(steps=STEPS, global_batch_size=2 * point.world_size, noise_multiplier=1.0,
                                     rank_batches=(split,) * STEPS), planning=point.planning)
        fixed.append(point.case(spec, labels={"local_batches": name}, facts={"local_batch_sizes": sizes},
                                doing=f"{name} local batches {sizes}", isolate=True))
    if (only is None or "history_twice" in only) and point.world_size == max(point.options.world_sizes) and \
            point.first_of_axes(PROPERTY.models, PROPERTY.reductions, PROPERTY.dtypes):
        fixed.append(history_twice_case(point))
    last = [c for c in fixed if c.labels["local_batches"] == "empty"]
    yield from (c for c in fixed if c not in last)
    if point.world_size > 1 and point.first_of_axes(PROPERTY.models, PROPERTY.reductions, PROPERTY.dtypes):
        # one rank cannot diverge; the sampler does not depend on model, reduction or dtype
        for seeding in POISSON_SEEDINGS:
            name = f"poisson_{seeding}"
            if name not in (POISSON_DEFAULT if only is None else only):
                continue
            spec = poisson_spec(point, seeding)
            yield point.case(spec, labels={"local_batches": name}, doing=(
                f"Poisson sampling, dataset of {spec.dataset_size}, q=1/{spec.steps_per_epoch}, {EPOCHS} epochs "
                f"of {spec.steps_per_epoch} steps, seeding {seeding!r}"), isolate=True, deadline=POISSON_DEADLINE_S)
        yield from accum_cases(point, only)
    if horizon_point(point, PROPERTY.models, PROPERTY.reductions, PROPERTY.dtypes) and (
            only is None or "poisson_horizon" in only):
        # the long run (horizon.py): a collective only some ranks issue every k steps, or a sampler that
        # changes after some epochs, hangs here and nowhere in the short scenarios
        # the gate's one noisy long run, which noise_calibration judges step by step too: one job for both
        spec = noisy_long_spec(point)
        yield point.case(spec, labels={"local_batches": "poisson_horizon", **horizon_labels(spec)}, doing=(
            f"Poisson sampling, dataset of {spec.dataset_size}, q=1/{spec.steps_per_epoch}, {spec.steps} steps "
            f"({spec.epochs} epochs), seeding 'per_rank' (long run)"), isolate=True)
    yield from last


def history_twice_case(point: Point) -> Case:
    """Noisy Poisson runs in the same rank processes, one after the other, asked at the same delta
    (``TWICE_RUNS``: 2 then 5 steps at one sigma and q, then another sigma, then another q): each epsilon
    must be that of its own history (the runner's accountant precheck judges each), so an epsilon cached
    per process by (sigma, q, delta) whatever the steps (``fixtures.interval_specimens:EpsilonCachedPerProcess``)
    fails the second, and one cached by (steps, delta) whatever sigma
    (``fixtures.review_r6_specimens:EpsilonCacheKeyedBySteps``) the third. Once per gate run (the
    largest of the run's world sizes, after its other fixed
    scenarios but ``empty``; the first model, reduction, dtype)."""
    ws = point.world_size
    # Poisson: the told q is the configured one (a fixed run's q is 1/steps, which would differ)
    specs = [upper_clip(point.spec(sampling="poisson", dataset_size=TWICE_PER_RANK * ws, sample_rate=q,
                                   epochs=-(-n // int(1 / q)), seeding="same", steps=n, noise_multiplier=sigma),
                        planning=point.planning)
             for n, sigma, q in TWICE_RUNS]
    delta = drawn_delta(specs[0])
    specs = [s.with_(accountant_delta=delta) for s in specs]
    runs = ", ".join(f"{n} steps at sigma {sigma:g}, q {q:g}" for n, sigma, q in TWICE_RUNS)
    return point.case(specs[0], specs, labels={"local_batches": "history_twice"},
                      isolate=True,
                      doing=f"{len(TWICE_RUNS)} noisy runs ({runs}) in the same rank processes, asked for their "
                            "epsilon at one delta")


def accum_cases(point: Point, only):
    """The gradient-accumulation scenarios (module docstring) named in ``only`` (``None``: all)."""
    for name in ACCUM_SCENARIOS:
        if name not in (ACCUM_DEFAULT if only is None else only):
            continue
        if name == "uneven_accum":
            split = scenarios(point.world_size)["uneven"]
            spec = upper_clip(point.spec(steps=STEPS, global_batch_size=2 * point.world_size, noise_multiplier=1.0,
                                         rank_batches=(split,) * STEPS, physical_batch_size=ACCUM_P),
                              planning=point.planning)
            what = f"uneven local batches {[len(s) for s in split]}"
        else:
            spec = poisson_spec(point, "per_rank").with_(epochs=ACCUM_EPOCHS, physical_batch_size=ACCUM_P)
            what = (f"Poisson sampling, dataset of {spec.dataset_size}, q=1/{spec.steps_per_epoch}, {ACCUM_EPOCHS} "
                    f"epoch(s), seeding 'per_rank'")
        yield point.case(spec, labels={"local_batches": name}, isolate=True, deadline=ACCUM_DEADLINE_S,
                         doing=f"{what}, gradient accumulation in physical batches of {ACCUM_P}")


def wide(point: Point):
    """At the wide world size (``horizon.py``): the ``uneven_accum`` scenario, where ranks that agree
    on the physical pass count with some peers only (``rank ^ 1``) diverge from the third rank on.
    It may be the first job of the gate's 3-rank group, which imports the target first: it gets the
    whole timeout, not the scenario's short deadline (a deadlock is still proven in seconds)."""
    for case in accum_cases(point, ("uneven_accum",)):
        case.deadline = None
        yield case


def explore_prepare(spec: RunSpec, knobs: Dict[str, Any]) -> Prepared:
    """An explored configuration (docs/explore.md) as a noisy training run: at least
    ``EXPLORE_MIN_STEPS`` steps (a divergence needs a step after the one that diverges), the drawn
    noise multiplier (``knobs["noise_multiplier"]``, ``EXPLORE_SIGMA`` where none was drawn: sigma 1
    hides a noise std or a told sigma that is a wrong function of sigma) and C at the drawn quantile
    of the reference norms, at the drawn lr
    (a long run's: 0), checkpointed at the drawn resume point and resumed in fresh ranks where one
    was drawn (``knobs["resume_fraction"]``). The run must finish on every rank; what it releases
    (both halves of a resumed run) feeds the release judge (``releases/judge.py``) like every run of
    the gate: the noise of a drawn world size, dtype, precision, lr, batch, loop shape and resume
    point is judged there. Each is asked for its epsilon (``accountant.drawn_delta``)."""
    steps = max(EXPLORE_MIN_STEPS, spec.steps)
    fields: Dict[str, Any] = dict(steps=steps, noise_multiplier=float(knobs.get("noise_multiplier", EXPLORE_SIGMA)),
                                  max_grad_norm=clip_at_quantile(spec, float(knobs.get("clip_quantile", 0.5))))
    if spec.poisson:  # twice the epochs the steps need, as the draws have (strategies.explore_specs)
        fields["epochs"] = capped_epochs(steps, spec.steps_per_epoch)
    fraction = knobs.get("resume_fraction")
    if fraction is not None and not spec.physical_batch_size:
        # a drawn resume point k in 1..steps-1: written as the save half (contract.resumed_halves runs both)
        fields.update(resume_at=1 + int(float(fraction) * (steps - 1)), phase="save", checkpoint_dir=EXPLORE_CHECKPOINT)
    ready = spec.with_(**fields)
    # every noisy draw is asked for its epsilon (both halves of a resumed one): the runner's accountant
    # precheck judges it against the interval of valid epsilons of the told history at the drawn sigma,
    # q, steps and resume point; the target's accountant cost is bounded by the draw count (--explore)
    return ready.with_(accountant_delta=drawn_delta(ready))


def _judge_explored(case: Case, runs: Outputs) -> Verdict:
    outputs = runs[0][0]
    counts = [len(o.steps) for o in outputs]
    sizes = [[len(s.indices) for s in o.steps] for o in outputs]
    if len(runs[0]) > 1:  # a drawn resume point: the load half ran in fresh ranks (contract.resumed_halves)
        after = [len(o.steps) for o in runs[0][1]]
        return case.verdict("pass", None, (
            f"explored configuration: every rank took {counts[0]} step(s), was checkpointed, and, resumed in fresh "
            f"rank processes, took {after[0]} more (local batch sizes {sizes} then "
            f"{[[len(s.indices) for s in o.steps] for o in runs[0][1]]}) and finished"),
            {"step_counts": counts, "step_counts_after_resume": after, "resume_at": case.spec.resume_at,
             "local_batch_sizes": sizes})
    return case.verdict("pass", None, (
        f"explored configuration: every rank took {counts[0]} step(s) (local batch sizes {sizes}) and finished"),
        {"step_counts": counts, "local_batch_sizes": sizes})


def judge(case: Case, runs: Outputs) -> Verdict:
    if case.explored:
        return _judge_explored(case, runs)
    if case.labels.get("local_batches") == "history_twice":
        return case.verdict("pass", None, (
            f"{case.doing}: every rank took {[len(r[0].steps) for r in runs[0]]} step(s) and finished (each run's "
            "epsilon judged against its own history)"), {"step_counts": [len(r[0].steps) for r in runs[0]]})
    if case.spec.physical_batch_size:
        outputs = runs[0][0]
        passes = [[len(s.physical_batches or ()) for s in o.steps] for o in outputs]
        return case.verdict("pass", None, (
            f"{case.doing}: every rank took {len(outputs[0].steps)} logical step(s) with the same physical passes per "
            f"step {passes[0]} (local batch sizes {[[len(s.indices) for s in o.steps] for o in outputs]}) and "
            "finished"), {"step_counts": [len(o.steps) for o in outputs], "physical_passes_per_step": passes})
    if case.spec.poisson:
        outputs = runs[0][0]
        sizes = [[len(s.indices) for s in o.steps] for o in outputs]
        return case.verdict("pass", None, (
            f"Poisson sampling ({case.spec.seeding!r} seeding): every rank took {len(outputs[0].steps)} steps "
            f"(local batch sizes {sizes}) and finished"), {"step_counts": [len(o.steps) for o in outputs],
                                                         "local_batch_sizes": sizes})
    return case.verdict("pass", None, f"{STEPS} steps with {case.labels['local_batches']} local batches "
                        f"{case.facts['local_batch_sizes']} finished on all {case.world_size} rank(s)")


PROPERTY = Property(
    id="deadlock_free", diagnoses=(),
    meaning=("every run finishes, whatever the local batch sizes (uneven, one sample, empty): a job that "
             "hangs on some batches pushes users to sampling that breaks the privacy accounting"),
    cases=cases, judge=judge, models=("mlp",), layouts=("split",), reductions=("mean",),
    params=(("local_batches", None),), wide=wide,
    explore=ExploreRecipe(draw=(("resume", True), ("noise", True)), prepare=explore_prepare))


__all__ = ["STEPS", "EPOCHS", "POISSON_DEADLINE_S", "POISSON_SEEDINGS", "POISSON_DEFAULT", "ACCUM_P", "ACCUM_EPOCHS",
           "ACCUM_DEADLINE_S", "ACCUM_SCENARIOS", "ACCUM_DEFAULT", "scenarios", "poisson_spec", "cases", "accum_cases",
           "wide", "judge", "PROPERTY"]

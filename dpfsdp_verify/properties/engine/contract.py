"""The property contract: what a property declares, and the few types every property speaks.

A property is one module that builds a ``Property``:

* what it means: ``id``, ``meaning`` (one line, in DP terms), default ``models`` / ``layouts`` /
  ``reductions``, its own ``params`` (e.g. how many noise draws) with defaults;
* which cases it runs: ``cases(point)`` for each ``Point`` of the options' matrix (world size x
  mode x model x data layout x reduction x dtype x sampling) yields ``Case``s -- specs to run on the
  ranks -- or a ready ``Verdict`` (a skip);
* how it judges: ``judge(case, outputs)`` -> ``Verdict`` from ``outputs[mode][spec][rank]``
  (``RankOutput``s). It is called only when every run of the case finished; a hang or a crash
  becomes the case's verdict in the runner (``runner.py``), never in a property;
* optionally how it is fuzzed: a ``FuzzRecipe`` (data: which ``strategies.run_specs`` to draw
  from, and the property's ``prepare`` of a drawn spec).

Everything that runs a property -- the gate, the fuzzer, tests -- goes through ``Options`` (one
frozen value instead of a dozen keywords) and ``runner.run_property`` (``properties.run`` is the
Python API's entry point). A property whose
``compares_modes`` is set (``mode_equivalence``) gets points with two modes (the first label vs
each other one) and needs at least two modes (``modes_problem``), unless it brings its own pair
for a run given one mode (``Property.default_pair``: e.g. the same step unsplit vs in physical
batches, ``RunSpec`` changes rather than environments).

Sampling is an axis like the others: a property lists the samplings it runs under by default
(``samplings``: ``fixed`` given batches, ``poisson`` DP-SGD's own sampling, under each of its
``seedings``), and ``Point.spec`` builds the Poisson spec of a Poisson point, so every property on
the axis runs on the DP default path without a code path of its own. ``samplings=None`` marks a
property off the axis (it runs its fixed point whatever the options select). ``deadlock_free`` is a
``fixed`` property that draws its own Poisson scenarios (``local_batches``); ``sampling_accounting``
runs under ``poisson`` only.

Randomness: ``Options.seed`` is the run's statistical seed. A property whose verdicts rest on
random draws derives every seed it uses from it (``Point.seed``), so each gate run (which picks a
fresh seed and prints it) tests fresh randomness and ``--seed`` replays a run exactly.
"""

from __future__ import annotations

import builtins
import shlex
import traceback
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union, cast

from ...config import modes as modes_mod
from ...harness import DEFAULT_TIMEOUT_S
from ...config.modes import Mode
from ...models.errors import Float64Unsupported
from ...targets import RankOutput, RunSpec
from ...config.defaults import DEFAULT_GRAD_SAMPLE_MODE, DEFAULT_WORLD_SIZES, POISSON_DEFAULTS
from ...config.space import seed_for as _seed_for
from ...verdict import INTERNAL_ERROR, Verdict
from ..analysis.accountant import asked_delta
from .recipes import ExploreRecipe, FuzzRecipe, Prepared, explored_keys, unchanged
from .rules import modes_problem, precision_problem, sampling_problem

#: ``outputs[mode][spec][rank]``: what each rank returned for each spec, under each of the case's modes
Outputs = Sequence[Sequence[Sequence[RankOutput]]]


@dataclass(frozen=True)
class Options:
    """How to run properties: the target, where and what. ``None`` in ``models`` / ``data_layouts``
    / ``reductions`` / ``dtypes`` means each property's own defaults. ``params`` are property-specific knobs
    (``(name, value)`` pairs; each property lists the ones it takes in ``Property.params``)."""

    target: str = "opacus"
    world_sizes: Tuple[int, ...] = DEFAULT_WORLD_SIZES
    modes: Tuple[Mode, ...] = modes_mod.DEFAULT_MODES
    grad_sample_mode: str = DEFAULT_GRAD_SAMPLE_MODE
    models: Optional[Tuple[str, ...]] = None
    data_layouts: Optional[Tuple[str, ...]] = None
    reductions: Optional[Tuple[str, ...]] = None
    dtypes: Optional[Tuple[str, ...]] = None
    backend: str = "gloo"
    timeout: float = DEFAULT_TIMEOUT_S
    params: Tuple[Tuple[str, Any], ...] = ()
    #: ``fixed`` / ``poisson`` (``None``: each property's own); Poisson points run under each of
    #: ``seedings`` (``None``: each property's own), with q = ``sample_rate`` over a dataset of
    #: ``dataset_size`` samples (``None``: 0.25 and 8 x world size, ``POISSON_DEFAULTS``)
    samplings: Optional[Tuple[str, ...]] = None
    seedings: Optional[Tuple[str, ...]] = None
    sample_rate: Optional[float] = None
    dataset_size: Optional[int] = None
    #: the run's statistical seed (module docstring)
    seed: int = 0
    #: mixed-precision forms (``targets.base.PRECISIONS``; ``None``: ``fp32`` only); a property runs
    #: those it declares in ``Property.precisions``
    precisions: Optional[Tuple[str, ...]] = None
    #: a world size >= 3 where each property with ``Property.wide`` runs those few cases (bugs keyed on
    #: the rank index: ``rank % 2``, ``LOCAL_RANK``, ``rank ^ 1``, a shard offset) when it is not
    #: among ``world_sizes`` (there the whole matrix runs); 0: none. The gate's default is
    #: ``horizon.WIDE_WORLD_SIZE``; the Python API's is 0
    wide_world_size: int = 0
    #: why ``wide_world_size`` cannot run here ("" when it can): the backend cannot give its ranks
    #: (nccl on fewer GPUs). Its cases are then ``skip`` verdicts saying so and the run goes on
    #: (the gate's default wide world size only: one a user names explicitly is a usage error)
    wide_unavailable: str = ""
    #: an even world size >= 4 (nodes of 2 ranks: ``harness.node_env``) where each property with
    #: ``Property.nodes`` runs its one or two cases (bugs from the fourth rank on or across nodes:
    #: ``horizon.py``) when it is not among ``world_sizes``; 0: none. The gate's default is
    #: ``horizon.NODE_WORLD_SIZE``; the Python API's is 0
    node_world_size: int = 0
    #: why ``node_world_size`` cannot run here ("" when it can), as ``wide_unavailable``
    node_unavailable: str = ""
    #: steps of the long-horizon run each property with one runs (``horizon.py``: bugs that start
    #: late); 0: none. The gate's default is ``horizon.HORIZON_STEPS``; the Python API's is 0
    horizon: int = 0
    #: 2-D meshes (``dpfsdp_verify.targets.mesh`` names, e.g. ``"hsdp:2x2"``) each property that runs on
    #: meshes runs at, besides ``world_sizes`` (``()``: none)
    meshes: Tuple[str, ...] = ()
    #: a dry run's plan (``run --dry-run``): what a case derives from the float64 reference (clip
    #: bounds picked between reference norms, the parameters' shapes) is left to the run, so planning
    #: imports no torch; every case is the same, only its C is not known yet. The cases read it as
    #: ``Point.planning`` and hand it to ``compare.norm_picked`` / ``compare.planned`` and the helpers
    #: built on them
    planning: bool = False

    def __post_init__(self):
        problem = precision_problem(self.precisions, self.dtypes)
        if problem:
            raise ValueError(problem)
        problem = sampling_problem(self.samplings, self.seedings, self.sample_rate, self.dataset_size,
                                   max(self.world_sizes + (self.wide_world_size, self.node_world_size)
                                       if self.world_sizes else (1,)))
        if problem:
            raise ValueError(problem)
        if self.wide_world_size and self.wide_world_size < 3:
            raise ValueError(f"wide world size {self.wide_world_size}: must be >= 3 (or 0: none); 1 and 2 ranks "
                             "are the matrix's own")
        if self.node_world_size and (self.node_world_size < 4 or self.node_world_size % 2):
            raise ValueError(f"node world size {self.node_world_size}: must be even and >= 4 (nodes of 2 ranks; or "
                             "0: none)")
        if self.horizon < 0:
            raise ValueError(f"horizon {self.horizon}: must be >= 0 steps (0: none)")

    @classmethod
    def build(cls, target: str, **kw) -> "Options":
        """From the Python API's keywords (lists, ``{label: env}`` modes); keywords that are not
        fields go to ``params`` (``Property.options`` refuses those the property does not take)."""
        known = {f.name for f in fields(cls)}
        params = {k: kw.pop(k) for k in list(kw) if k not in known}
        for key in ("world_sizes", "models", "data_layouts", "reductions", "dtypes", "samplings", "seedings",
                    "precisions", "meshes"):
            if kw.get(key) is not None:
                kw[key] = tuple(kw[key])
        kw["modes"] = modes_mod.from_mapping(kw.get("modes"))
        kw["params"] = tuple(sorted({**dict(kw.get("params", ())), **params}.items()))
        return cls(target=target, **kw)

    def with_(self, **changes) -> "Options":
        return replace(self, **changes)


@dataclass
class Case:
    """One configuration a property judges: ``specs`` run, in order, at ``world_size`` under each
    of ``modes`` (one mode; two for a comparing property). ``spec`` is the configuration's own spec
    (what ``config()`` and the repro line describe). A fixed case's ``specs`` that
    ``analysis.accountant.asked_delta`` picks are asked for their epsilon at a delta drawn from the
    spec (resumed, accumulated, >= 3-rank, mesh and long noisy runs)."""

    property: str
    target_ref: str
    spec: RunSpec
    world_size: int
    modes: Tuple[Mode, ...] = modes_mod.DEFAULT_MODES
    specs: Tuple[RunSpec, ...] = ()
    backend: str = "gloo"
    #: extra ``config`` entries that tell this case from its siblings (e.g. ``local_batches``)
    labels: Dict[str, Any] = field(default_factory=dict)
    #: evidence every verdict of this case carries (pass, fail, hang or crash alike)
    facts: Dict[str, Any] = field(default_factory=dict)
    #: what the ranks do, for failure messages ("one DP step with noise 0")
    doing: str = ""
    #: run in a job of its own, so that a hang is pinned on this case alone
    isolate: bool = False
    #: ``k > 0``: run each of the first ``k`` specs as the first job of rank processes started for
    #: it alone (not the warm pool) -- what separate training jobs are, for state a target keeps per
    #: process (a generator created once per process); the remaining specs run after the k-th, in
    #: its processes. Implies ``isolate``
    fresh_groups: int = 0
    #: with ``fresh_groups``: how many specs each of the fresh groups runs, in order (``()``: one
    #: each for the first ``fresh_groups - 1``, the rest in the last) -- e.g. the ``save`` halves of resumed runs in
    #: one set of processes and the ``load`` halves in the next (``RunSpec.resume_at``)
    fresh_jobs: Tuple[int, ...] = ()
    #: a built-in watchdog deadline (seconds) for this case's job, stated for the default timeout;
    #: what the job gets under the options' timeout is ``case_deadline`` (never more than the
    #: timeout, raised in proportion when the timeout is raised)
    deadline: Optional[float] = None
    #: wall time of the job(s) this case ran in, shared out among the cases of a job
    seconds: float = 0.0
    #: the run's statistical seed (``Options.seed``), for the repro line
    seed: int = 0
    #: a fuzzed case: the spec as hypothesis drew it (before the recipe's ``prepare``); its repro
    #: line is ``dpfsdp-verify replay`` of exactly that spec
    drawn: Optional[RunSpec] = None
    #: an explored case (``--explore``, docs/explore.md): ``drawn`` is the spec exactly as run (the
    #: recipe's ``prepare`` already applied), replayed with ``replay --exact``
    explored: bool = False

    def __post_init__(self):
        self.specs = tuple(self.specs) or (self.spec,)
        if not self.explored and self.drawn is None:  # the runs asked for their epsilon (accountant.asked_delta)
            self.specs = tuple(s.with_(accountant_delta=asked_delta(s, self.world_size)) for s in self.specs)
        if self.fresh_jobs and (len(self.fresh_jobs) != self.fresh_groups or sum(self.fresh_jobs) != len(self.specs)):
            raise ValueError(f"fresh_jobs {self.fresh_jobs} must give each of the {self.fresh_groups} fresh groups its "
                             f"number of specs, {len(self.specs)} in all")

    @builtins.property  # the field ``property`` shadows the builtin in this class body
    def mode(self) -> Mode:
        return self.modes[0]

    def config(self) -> dict:
        # the keys only some runs have: fixed sampling adds nothing, so configs of fixed runs are unchanged
        run_keys = {}
        if self.spec.poisson:
            run_keys = dict(sampling="poisson", sample_rate=round(self.spec.sample_rate, 6),
                            dataset_size=self.spec.dataset_size, epochs=self.spec.epochs, seeding=self.spec.seeding)
        if self.spec.physical_batch_size:  # accumulation adds a key; configs of other runs are unchanged
            run_keys["physical_batch_size"] = self.spec.physical_batch_size
        if self.spec.precision != "fp32":  # so does mixed precision
            run_keys["precision"] = self.spec.precision
        if self.drawn is not None:  # a fuzzed shape is told apart by its layer sizes
            run_keys["model_kwargs"] = dict(self.spec.model_kwargs)
        if self.explored:  # so is an explored configuration, by what was drawn beyond the matrix's axes
            run_keys["explore"] = explored_keys(self.spec)
        if self.spec.mesh:  # a 2-D mesh adds a key; 1-D configs are unchanged
            run_keys["mesh"] = self.spec.mesh
        if self.spec.resume_at:  # so does a resumed run (an explored resume point; checkpoint_resume's label)
            run_keys["resume_at"] = self.spec.resume_at
        return {"world_size": self.world_size, "data_layout": self.spec.data_layout, "model": self.spec.model,
                "mode": " vs ".join(m.label for m in self.modes), "grad_sample_mode": self.spec.grad_sample_mode,
                "reduction": self.spec.reduction, "dtype": self.spec.dtype, **run_keys, **self.labels}

    def repro(self) -> str:
        """The CLI line that re-runs this property for this model, reduction, world size and modes
        (the CLI has no layout filter: both layouts the property checks are re-run); for a fuzzed
        case the ``replay`` line of its drawn spec."""
        if self.drawn is not None:
            return self._replay_line(self.drawn)
        where = ["--meshes", self.spec.mesh] if self.spec.mesh else ["--world-sizes", str(self.world_size)]
        parts = ["dpfsdp-verify", "run", "--target", self.target_ref, "--properties", self.property,
                 *where, "--grad-sample-mode", self.spec.grad_sample_mode,
                 "--models", self.spec.model, "--loss-reductions", self.spec.reduction, "--dtypes", self.spec.dtype]
        if self.backend != "gloo":
            parts += ["--backend", self.backend]
        if self.spec.precision != "fp32":
            parts += ["--precisions", self.spec.precision]
        spec = self.spec
        parts += ["--sampling", spec.sampling]
        if spec.poisson:
            parts += ["--seeding", spec.seeding, "--sample-rate", repr(spec.sample_rate),
                      "--dataset-size", str(spec.dataset_size)]
        if self.seed:
            parts += ["--seed", str(self.seed)]
        parts += modes_mod.cli_args(self.modes)
        p = self.spec.physical_batch_size or next((v for m in self.modes for k, v in m.spec
                                                   if k == "physical_batch_size"), None)
        if p and self.labels.get("local_batches") is None:  # deadlock_free's scenarios fix their own p
            parts += ["--physical-batch-size", str(p)]
        if self.labels.get("resume_at"):
            parts += ["--resume-at", str(self.labels["resume_at"])]
        if self.labels.get("audit_canaries"):  # the privacy audit's size
            parts += ["--audit-canaries", str(self.labels["audit_canaries"]), "--audit-steps",
                      str(self.labels["audit_steps"]), "--audit-confidence", str(self.labels["audit_confidence"])]
        return " ".join(shlex.quote(p) for p in parts)

    def _replay_line(self, drawn: RunSpec) -> str:
        parts = ["dpfsdp-verify", "replay", "--target", self.target_ref, "--property", self.property,
                 "--world-size", str(self.world_size), "--spec", drawn.to_json()]
        if self.explored:
            parts.append("--exact")
        if self.backend != "gloo":
            parts += ["--backend", self.backend]
        parts += modes_mod.cli_args(self.modes, always=len(self.modes) > 1)
        return " ".join(shlex.quote(p) for p in parts)

    def verdict(self, status: str, diagnosis: Optional[str] = None, message: str = "", evidence=None,
                seconds: float = 0.0, details: str = "") -> Verdict:
        return Verdict(property=self.property, status=status, config=self.config(), diagnosis=diagnosis,
                       message=message, evidence={**self.facts, **dict(evidence or {})}, repro=self.repro(),
                       seconds=round(seconds or self.seconds, 3), details=details)


@dataclass(frozen=True)
class Point:
    """One point of the options' matrix, handed to ``Property.cases``."""

    property: str
    options: Options
    modes: Tuple[Mode, ...]
    world_size: int
    model: str
    data_layout: str
    reduction: str
    dtype: str = "float64"
    #: how many points the property's matrix has (e.g. to share a false-alarm budget among them)
    matrix_size: int = 1
    sampling: str = "fixed"
    #: the Poisson seeding policy of a ``poisson`` point (``None`` for ``fixed``)
    seeding: Optional[str] = None
    #: the mixed-precision form (``targets.base.PRECISIONS``)
    precision: str = "fp32"
    #: the 2-D mesh of a mesh point (``Options.meshes``), ``""`` for a 1-D one
    mesh: str = ""

    def spec(self, **fields_) -> RunSpec:
        """The point's ``RunSpec`` (model, layout, reduction, dtype, grad_sample_mode) plus ``fields_``.
        At a ``poisson`` point (unless ``fields_`` names ``sampling``) the spec is DP-SGD's own
        sampling: q and the dataset size from the options (``POISSON_DEFAULTS`` otherwise), the
        point's seeding, one epoch, ``steps`` as given (default 1), the sampling seed from the run's
        seed. Every rank stops after ``steps`` steps, so the ranks stay in lock-step whatever the
        sampler does (a property that needs the whole epoch sets ``steps=0``)."""
        if self.sampling == "poisson" and "sampling" not in fields_:
            q, per_rank = POISSON_DEFAULTS
            fields_ = {"steps": 1, **fields_, "sampling": "poisson",
                       "sample_rate": self.options.sample_rate or q,
                       "dataset_size": self.options.dataset_size or per_rank * self.world_size,
                       "epochs": 1, "seeding": self.seeding or "same", "sampling_seed": self.poisson_seed()}
        if self.mesh:
            fields_ = {"mesh": self.mesh, **fields_}
        return RunSpec(model=self.model, data_layout=self.data_layout, reduction=self.reduction,
                       dtype=self.dtype, grad_sample_mode=self.options.grad_sample_mode, precision=self.precision,
                       **fields_)

    def case(self, spec: RunSpec, specs: Sequence[RunSpec] = (), **kw) -> Case:
        """A ``Case`` of this point running ``specs`` (default: just ``spec``)."""
        return Case(self.property, self.options.target, spec, self.world_size, self.modes, tuple(specs),
                    self.options.backend, seed=self.options.seed, **kw)

    @builtins.property  # ``property`` is a field here
    def planning(self) -> bool:
        """Whether this point is planned by a dry run (``Options.planning``): hand it to
        ``compare.norm_picked`` / ``planned`` and the clip helpers built on them."""
        return self.options.planning

    def seed_for(self, *names) -> int:
        """The seed of this property's random stream ``names`` in this run: ``space.seed_for`` of the
        run's seed (``Options.seed``), the property id and ``names`` (e.g. ``point.seed_for("fresh_job",
        ws)``) -- a stable hash, so no two streams share a seed by accident and ``--seed`` replays each."""
        return _seed_for(self.options.seed, self.property, *names)

    def poisson_seed(self) -> int:
        """The sampling seed of this point's Poisson runs (``Point.spec``; the properties that build a
        Poisson spec of their own use it too, so their batches are the point's)."""
        return self.seed_for("poisson", "sampling", self.world_size, self.seeding)

    def seed(self, base: int) -> int:
        """Legacy: the seed a stream whose fixed seed was ``base`` takes in this run. New code names
        its stream (``seed_for``); ``tests/test_space.py`` refuses a literal ``base``."""
        return _seed_for(self.options.seed, self.property, "legacy", base)

    def first_of_axes(self, models: Sequence[str], reductions: Sequence[str], dtypes: Sequence[str]) -> bool:
        """Whether this is the first point of its world size and mode(s) along the model, reduction
        and dtype axes (the options' lists, else the property's defaults given here): for cases
        that do not depend on those axes (e.g. sampling), run once per world size, not per point."""
        o = self.options
        return (self.model == (o.models or models)[0] and self.reduction == (o.reductions or reductions)[0]
                and self.dtype == (o.dtypes or dtypes)[0])

    def param(self, name: str) -> Any:
        """The property's own option ``name`` (its default unless the options set it)."""
        return dict(self.options.params)[name]


#: a ``Case.facts`` key: a bf16 case a run without ``--precisions`` adds (``clipped_step``); a target
#: that does not declare the form gets a ``skip`` there (``runner``), not the failing "not checkable"
#: verdict ``--precisions`` gives
DEFAULT_PRECISION_FACT = "default_precision"


@dataclass(frozen=True)
class Property:
    """A property (module docstring). ``properties.run(prop, target_ref, pool=None, **options)``
    runs it -> ``[Verdict]`` (keywords of ``Options``, plus the property's own ``params``)."""

    id: str
    meaning: str
    cases: Callable[[Point], Iterable[Union[Case, Verdict]]]
    judge: Callable[[Case, Outputs], Verdict]
    models: Tuple[str, ...] = ("mlp", "transformer")
    layouts: Tuple[str, ...] = ("split",)
    reductions: Tuple[str, ...] = ("mean",)
    #: the dtypes the property runs in unless the options name others: float64 (the reference's
    #: own precision: the tightest check) and, where the cost is worth it, float32 (what DP
    #: training runs in; tolerances per dtype are in ``compare.TOLERANCES``)
    dtypes: Tuple[str, ...] = ("float64",)
    #: the diagnoses its own ``judge`` gives (beyond ``verdict.RUN_DIAGNOSES``, which the runner
    #: gives for any property)
    diagnoses: Tuple[str, ...] = ("mismatch",)
    #: property-specific options and their defaults (``Options.params``)
    params: Tuple[Tuple[str, Any], ...] = ()
    #: samplings the property runs under (module docstring); the options' ``samplings`` select
    #: among them. ``None``: it draws its own sampling scenarios and is not on the axis
    samplings: Optional[Tuple[str, ...]] = ("fixed",)
    #: Poisson seeding policies its Poisson points run under unless the options name others
    seedings: Tuple[str, ...] = ("same",)
    #: the mixed-precision forms it judges (``fp32`` always; the options' ``precisions`` select
    #: among them): a property whose tolerances are derived for bf16 compute lists the bf16 forms
    precisions: Tuple[str, ...] = ("fp32",)
    #: points carry two modes (the first label vs each other one); needs two or more modes
    compares_modes: bool = False
    #: for a comparing property given one mode (no ``--mode-env``, or one): the two modes it compares
    #: instead, built from that mode and the property's params (``modes.Mode.spec`` changes under
    #: the same environment); raises ``ValueError`` for a param it cannot use
    default_pair: Optional[Callable[[Mode, Dict[str, Any]], Tuple[Mode, Mode]]] = None
    fuzz: Optional[FuzzRecipe] = None
    #: how exploration draws its configurations (``ExploreRecipe``; ``None``: not explored)
    explore: Optional[ExploreRecipe] = None
    #: for a property whose verdicts rest on random draws: the bound on the probability that a
    #: correct target fails any of the verdicts of one run of the property (``None``: deterministic,
    #: a correct target never fails)
    false_alarm_rate: Optional[float] = None
    #: raises ``ValueError`` for values of its own ``params`` it cannot run (given them with their
    #: defaults filled in); ``options`` calls it, and the gate turns it into exit 2
    check_params: Optional[Callable[[Dict[str, Any]], None]] = None
    #: the cases it runs at the options' ``wide_world_size`` (``horizon.py``), given the first point of
    #: each sampling of its matrix at that world size: the checks a bug keyed on the rank index hits
    wide: Optional[Callable[[Point], Iterable[Union[Case, Verdict]]]] = None
    #: the cases it runs at the options' ``node_world_size`` (``horizon.py``: 2 simulated nodes x 2
    #: local ranks), given the first point of each sampling of its matrix there
    nodes: Optional[Callable[[Point], Iterable[Union[Case, Verdict]]]] = None
    #: it runs on the options' 2-D ``meshes`` (fixed split batches, fp32; ``docs/meshes.md``);
    #: a property that does not is told so in one ``skip`` verdict per mesh
    meshes: bool = False
    #: not run by a gate run that names no ``--properties`` (it runs when named: e.g. ``privacy_audit``)
    opt_in: bool = False

    def options(self, target_ref: str, **kw) -> Options:
        """``Options`` from keywords; ``TypeError`` for a keyword neither ``Options`` nor this
        property knows (a misspelt option must not be silently ignored)."""
        opts = Options.build(target_ref, **kw)
        unknown = sorted(set(dict(opts.params)) - set(dict(self.params)))
        if unknown:
            raise TypeError(f"{self.id}: unknown option(s) {', '.join(unknown)}; its own options: "
                            f"{', '.join(dict(self.params)) or 'none'}")
        opts = self.with_defaults(opts)
        self.modes_for(opts.modes, opts.params)  # a param the built-in pair cannot use: ValueError now
        if self.check_params is not None:
            self.check_params(dict(opts.params))
        return opts

    def with_defaults(self, opts: Options) -> Options:
        """``opts`` with this property's ``params`` defaults filled in (what ``Point.param`` reads)."""
        return opts.with_(params=tuple(sorted({**dict(self.params), **dict(opts.params)}.items())))

    def sampling_points(self, opts: Options) -> List[Tuple[str, Optional[str]]]:
        """``(sampling, seeding)`` pairs this property runs under for ``opts`` (``[("fixed", None)]``
        for a property off the axis)."""
        if self.samplings is None:
            return [("fixed", None)]
        return [(s, seeding) for s in self.samplings if opts.samplings is None or s in opts.samplings
                for seeding in ((opts.seedings or self.seedings) if s == "poisson" else (None,))]

    def modes_for(self, modes: Sequence[Mode], params: Sequence[Tuple[str, Any]] = ()) -> Tuple[Mode, ...]:
        """The modes this property runs under ``modes``: its ``default_pair`` (from ``params`` over
        the property's defaults) where it compares modes and was given only one, else ``modes``."""
        if self.compares_modes and len(modes) == 1 and self.default_pair is not None:
            return tuple(self.default_pair(modes[0], {**dict(self.params), **dict(params)}))
        return tuple(modes)

    def mode_groups(self, modes: Sequence[Mode], params: Sequence[Tuple[str, Any]] = ()) -> List[Tuple[Mode, ...]]:
        """The modes each point (or fuzz run) runs under: each mode alone, or for a property that
        compares modes the first mode with each other one (its ``default_pair`` when given one
        mode; none if it has no pair)."""
        modes = self.modes_for(modes, params)
        if self.compares_modes:
            return [(modes[0], other) for other in modes[1:]]
        return [(m,) for m in modes]

    def precision_points(self, opts: Options) -> List[str]:
        """The precisions this property runs for ``opts``: those selected (``fp32`` when none is)
        that it judges."""
        return [p for p in (opts.precisions or ("fp32",)) if p in self.precisions]

    def points(self, opts: Options) -> List[Point]:
        """The matrix in report order: world size, mode(s), sampling, model, layout, reduction,
        precision, dtype. A bf16 precision computes over float32 parameters: its dtype is float32."""
        groups = self.mode_groups(opts.modes, opts.params)
        axes = [(ws, modes, sampling, model, layout, red, prec, dtype) for ws in opts.world_sizes
                for modes in groups for sampling in self.sampling_points(opts)
                for model in opts.models or self.models for layout in opts.data_layouts or self.layouts
                for red in opts.reductions or self.reductions for prec in self.precision_points(opts)
                for dtype in ((opts.dtypes or self.dtypes) if prec == "fp32" else ("float32",))]
        points = [Point(self.id, opts, modes, ws, model, layout, red, dtype, len(axes), sampling, seeding, prec)
                  for ws, modes, (sampling, seeding), model, layout, red, prec, dtype in axes]
        return points + self.mesh_points(opts, groups)

    def mesh_points(self, opts: Options, groups) -> List[Point]:
        """The points of the options' 2-D meshes: fixed split batches in fp32, per mesh, mode(s),
        model, reduction and dtype (none for a property that does not run on meshes)."""
        if not self.meshes or not opts.meshes:
            return []
        from ...targets.mesh import Mesh

        axes = [(mesh, modes, model, red, dtype) for mesh in opts.meshes for modes in groups
                for model in opts.models or self.models for red in opts.reductions or self.reductions
                for dtype in opts.dtypes or self.dtypes]
        return [Point(self.id, opts, modes, Mesh.parse(mesh).world_size, model, "split", red, dtype, len(axes),
                      mesh=mesh) for mesh, modes, model, red, dtype in axes]

    def plan(self, opts: Options) -> List[Union[Case, Verdict]]:
        """Every case (or ready verdict) for ``opts``, in report order."""
        problem = modes_problem(self, opts.modes)
        if problem:
            return [self.skip(opts, f"{problem} ({modes_mod.TWO_MODES_EXAMPLE})")]
        if not self.precision_points(opts):
            return [self.skip(opts, f"{self.id} is judged under precision {','.join(self.precisions)} only (its "
                                    f"tolerances are derived for those); the selected precision is "
                                    f"{','.join(opts.precisions or ())}", precision=",".join(opts.precisions or ()))]
        if not self.sampling_points(opts):
            on_axis = cast(Tuple[str, ...], self.samplings)  # None: sampling_points is never empty
            return [self.skip(opts, f"{self.id} runs under {' and '.join(on_axis)} sampling only; the "
                                    f"selected sampling is {','.join(opts.samplings or ())}",
                              sampling=",".join(opts.samplings or ()))]
        unmeshed = [] if self.meshes else [
            self.skip(opts, f"{self.id} does not run on 2-D meshes (docs/meshes.md says which properties do)",
                      world_size=None, mesh=mesh) for mesh in opts.meshes]
        items = [item for point in self.points(opts) for item in self.point_cases(point)]
        return items + self.wide_plan(opts) + self.nodes_plan(opts) + unmeshed

    def point_cases(self, point: Point) -> List[Union[Case, Verdict]]:
        """``cases(point)``; where planning them needs the float64 reference of a model of one's own that
        has none (a clip bound picked among its norms), the point's one ``skip`` saying why."""
        try:
            return list(self.cases(point))
        except Float64Unsupported as e:
            return [point.case(point.spec(), doing="planning").verdict(
                "skip", None, f"{e}: the model cannot run in float64, so there is no float64 reference to judge it "
                              "against (docs/models.md)")]

    def wide_plan(self, opts: Options) -> List[Union[Case, Verdict]]:
        """The ``wide`` cases at ``opts.wide_world_size`` (none when it is 0, is one of the
        ``world_sizes`` -- the whole matrix runs there -- or the property has none): ``wide`` is
        given the first point of each sampling (and seeding) of the matrix at that world size."""
        return self._reach_plan(opts, self.wide, opts.wide_world_size, opts.wide_unavailable)

    def nodes_plan(self, opts: Options) -> List[Union[Case, Verdict]]:
        """The ``nodes`` cases at ``opts.node_world_size`` (2 simulated nodes of 2 ranks), as
        ``wide_plan`` gives the ``wide`` ones."""
        return self._reach_plan(opts, self.nodes, opts.node_world_size, opts.node_unavailable)

    def _reach_plan(self, opts: Options, hook, w: int, unavailable: str) -> List[Union[Case, Verdict]]:
        if hook is None or not w or w in opts.world_sizes:
            return []
        firsts: Dict[Tuple[str, Optional[str]], Point] = {}
        for point in self.points(opts.with_(world_sizes=(w,))):
            firsts.setdefault((point.sampling, point.seeding), point)
        items = [item for point in firsts.values() for item in hook(point)]
        if unavailable:  # the machine cannot give these ranks: say so per case, run the rest
            return [item.verdict("skip", None, unavailable) if isinstance(item, Case) else item
                    for item in items]
        return items

    def fuzz_case(self, opts: Options, spec: RunSpec, world_size: int, modes: Sequence[Mode]) -> Union[Case, Verdict]:
        """The case of one fuzzed ``spec`` at ``world_size`` under ``modes``, after the recipe's
        ``prepare``; the ``skip`` verdict when ``prepare`` cannot use it."""
        ready = cast(FuzzRecipe, self.fuzz).prepare(spec)  # only a fuzzable property's cases are fuzzed
        case = Case(self.id, opts.target, ready if isinstance(ready, RunSpec) else spec, world_size, tuple(modes),
                    backend=opts.backend, doing="fuzzed configuration", drawn=spec)
        return case.verdict("skip", None, ready) if isinstance(ready, str) else case

    def explore_case(self, opts: Options, spec: RunSpec, knobs: Dict[str, Any], world_size: int,
                     modes: Sequence[Mode]) -> Union[Case, Verdict]:
        """The case of one explored ``spec`` (its recipe's ``prepare`` applied with ``knobs``), or the
        ``skip`` verdict saying why it cannot run."""
        assert self.explore is not None, f"{self.id} has no explore recipe"
        ready = self.explore.prepare(spec, knobs)
        case = self.exact_case(opts, ready if isinstance(ready, RunSpec) else spec, world_size, modes, knobs)
        return case.verdict("skip", None, ready) if isinstance(ready, str) else case

    def exact_case(self, opts: Options, run: RunSpec, world_size: int, modes: Sequence[Mode],
                   knobs: Optional[Dict[str, Any]] = None) -> Case:
        """The case that runs ``run`` exactly as given: an explored draw after its recipe's ``prepare``
        (``explore_case``, ``knobs`` its drawn knobs) or the spec of a ``replay --exact`` line; a
        resumed run's save half runs both halves (``resumed_halves``)."""
        labels = self.explore.labels(run) if self.explore is not None else {}
        return Case(self.id, opts.target, run, world_size, tuple(modes), backend=opts.backend,
                    doing="explored configuration", drawn=run, explored=True, labels=labels,
                    facts={"explored": True, **(knobs or {})}, seed=opts.seed, **resumed_halves(run))

    def fuzz_config(self, opts: Options, world_size: int, modes: Sequence[Mode], models: Sequence[str],
                    dtypes: Sequence[str]) -> dict:
        """The ``config`` of a fuzz run's summary verdict (one per world size and mode group)."""
        return {"world_size": world_size, "data_layout": "fuzzed", "model": "fuzzed:" + ",".join(models),
                "mode": " vs ".join(m.label for m in modes), "grad_sample_mode": opts.grad_sample_mode,
                "reduction": "fuzzed", "dtype": "fuzzed:" + ",".join(dtypes)}

    def skip(self, opts: Options, message: str, world_size: Optional[int] = None, **config) -> Verdict:
        """A ``skip`` verdict of this property for ``opts``, saying why (only what the user's own
        selection makes inapplicable is a skip)."""
        return Verdict(self.id, "skip", self.whole_run_config(opts, world_size, **config), message=message)

    def internal_error(self, opts: Options, doing: str, error: BaseException, seconds: float) -> Verdict:
        """The ``error`` / ``internal_error`` verdict (exit 3) of this property when code of this suite
        raised ``error`` while ``doing`` it (``running``, ``fuzzing``): a bug in a check, never a
        verdict on the target. Call it in the ``except`` clause (it keeps the traceback)."""
        return Verdict(self.id, "error", self.whole_run_config(opts), diagnosis=INTERNAL_ERROR,
                       message=f"{doing} {self.id} failed: {type(error).__name__}: {error}",
                       details=traceback.format_exc(), seconds=round(seconds, 3))

    @staticmethod
    def whole_run_config(opts: Options, world_size: Optional[int] = None, **config) -> dict:
        return {"world_size": world_size, "data_layout": None, "model": None, "mode": opts.modes[0].label,
                "grad_sample_mode": opts.grad_sample_mode, **config}


def resumed_halves(spec: RunSpec) -> Dict[str, Any]:
    """The ``Case`` fields that run an explored ``spec`` which is the ``save`` half of a resumed run
    (``RunSpec.resume_at`` > 0, ``phase="save"``: how a drawn resume point is written, and replayed
    by ``replay --exact``): both halves, each in rank processes started for it, as
    ``checkpoint_resume`` runs them (docs/resume.md). ``{}`` for any other spec."""
    if spec.phase != "save":
        return {}
    return dict(specs=(spec, spec.with_(phase="load")), fresh_groups=2, fresh_jobs=(1, 1))


def by_id(registry: Iterable[Property]) -> Dict[str, Property]:
    out: Dict[str, Property] = {}
    for p in registry:
        if p.id in out:
            raise ValueError(f"two properties share the id {p.id!r}")
        out[p.id] = p
    return out


__all__ = ["DEFAULT_PRECISION_FACT", "Outputs", "Options", "Case", "Point", "Prepared", "unchanged", "explored_keys",
           "ExploreRecipe", "FuzzRecipe", "Property",
           "resumed_halves", "sampling_problem", "precision_problem", "modes_problem", "by_id"]

"""The gate's run plan: what ``dpfsdp-verify run`` was asked to do, checked once.

``RunPlan.from_args`` turns the CLI's arguments into a frozen, typed plan or raises
``UsageError`` (one line + a hint; the CLI exits 2 and nothing runs). Every rule about what may
be combined is written here, once; the runner (``run.py``) and the reports only read the plan.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from ..config import modes as modes_mod
from ..config.defaults import DEFAULT_WORLD_SIZES, MAX_GLOO_WORLD_SIZE
from ..errors import HintedError
from ..config.modes import Mode

from .expectations import load as load_expectations

if TYPE_CHECKING:  # pragma: no cover
    from .expectations import Expectations
    from ..properties import Options

REDUCTIONS = ("mean", "sum")


class UsageError(HintedError):
    """A mistake on the command line: reported as one line + hint, exit 2, nothing run."""


def csv(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


@dataclass(frozen=True)
class Reports:
    """Where the gate writes its reports (``None``: not asked for; ``json == "-"``: stdout)."""

    json: Optional[str] = None
    junit: Optional[str] = None
    markdown: Optional[str] = None


@dataclass(frozen=True)
class RunPlan:
    """One gate run: the ``properties.Options`` every property runs with, plus what only the gate
    has (which properties, fuzz examples, the loaded expectations, reports, verbosity)."""

    options: "Options"
    properties: Tuple[str, ...]
    target_info: Tuple[Tuple[str, str], ...] = ()
    fuzz: int = 0
    #: configurations each selected property with an ``explore`` recipe draws (``--explore``;
    #: docs/explore.md), fixed by the seed; 0: a fixed run
    explore: int = 0
    #: seconds the exploration phase may take before the draws not yet run are dropped (``--explore-cap``)
    explore_cap: float = 0.0
    #: why the default exploration is off in this run (hypothesis missing, a torchrun job); "" if it is not
    explore_note: str = ""
    #: the parsed ``--expect`` file
    expectations: Optional["Expectations"] = None
    reports: Reports = Reports()
    quiet: bool = False
    #: ``-v``: the per-verdict table and every failure's message in the terminal summary (else one
    #: block per cause, ``gate/causes.py``)
    verbose: bool = False
    #: ``--write-expect FILE``: write the run's failures as an expectations file (``expectations.baseline``)
    write_expect: Optional[str] = None
    #: the ranks of the torchrun job the gate runs in (``--launcher torchrun``), ``None`` when it starts its own
    job_world_size: Optional[int] = None
    #: ``--mode-env`` as given (``()``: the default modes)
    mode_env: Tuple[str, ...] = ()

    @property
    def info(self) -> Dict[str, str]:
        """``{"name", "version"}`` of the target (for reports)."""
        return dict(self.target_info)

    @classmethod
    def from_args(cls, args, job_world_size: Optional[int] = None, load_target: bool = True) -> "RunPlan":
        """The plan for the parsed ``run`` arguments, or ``UsageError`` saying what is wrong: ``parse``,
        then (``load_target``, a run) ``loaded``. ``load_target=False`` (``--dry-run``): the plan
        ``parse`` checked, nothing of the target imported but an adapter ``MODULE:ATTR``."""
        plan = cls.parse(args, job_world_size)
        return plan.loaded() if load_target else plan

    @classmethod
    def parse(cls, args, job_world_size: Optional[int] = None) -> "RunPlan":
        """The plan for the parsed ``run`` arguments, checked without loading the target (torch is
        not imported for a gloo plan), or ``UsageError`` saying what is wrong. ``job_world_size``:
        the ranks of the torchrun job the gate runs in (``--launcher torchrun``): ``--world-sizes``
        then defaults to it (see ``launched_world_sizes``). ``--target opacus`` is checked to be
        importable and described from its files, not imported (an adapter ``MODULE:ATTR`` is
        loaded); ``loaded`` does the rest before a run."""
        from ..properties import PROPERTIES, Options, modes_problem

        # gloo's availability needs torch imported (``dist.is_gloo_available``): a dry run leaves it to
        # the run (docs/gate.md, "--dry-run"); nccl's GPU count is part of the plan, so it is asked
        probe = args.backend != "gloo"
        meshes = parse_meshes(getattr(args, "meshes", None), args.backend, job_world_size)
        if meshes and args.world_sizes is None:
            world_sizes = []  # --meshes alone: only the meshes run
        elif job_world_size is None:
            given = args.world_sizes or ",".join(map(str, DEFAULT_WORLD_SIZES))
            world_sizes = parse_world_sizes(given, args.backend, probe)
        else:
            world_sizes = launched_world_sizes(args.world_sizes, job_world_size)
        props = csv(args.properties) if args.properties else [p for p, prop in PROPERTIES.items() if not prop.opt_in]
        unknown = [p for p in props if p not in PROPERTIES]
        if unknown:
            raise UsageError(f"unknown property {', '.join(unknown)}", f"choose from {', '.join(PROPERTIES)}")
        if args.timeout <= 0:
            raise UsageError(f"--timeout {args.timeout}: must be > 0 seconds", "e.g. --timeout 60")
        if args.fuzz < 0:
            raise UsageError(f"--fuzz {args.fuzz}: must be >= 0", "e.g. --fuzz 20")
        physical = getattr(args, "physical_batch_size", None)  # gradient accumulation: the properties' option
        if physical is not None and physical < 1:
            raise UsageError(f"--physical-batch-size {physical}: must be an integer >= 1 (samples per physical pass)",
                             "e.g. --physical-batch-size 2")
        wide, horizon, wide_unavailable = parse_reach(args, world_sizes, job_world_size, probe)
        nodes, nodes_unavailable = parse_nodes(args, world_sizes, job_world_size, probe)
        resume_at = getattr(args, "resume_at", None)  # checkpoint/resume: the option of the property that takes it
        if resume_at is not None:
            for prop in PROPERTIES.values():
                if prop.check_params is not None and "resume_at" in dict(prop.params):
                    try:
                        prop.check_params({"resume_at": resume_at})
                    except ValueError as e:
                        raise UsageError(f"--resume-at {resume_at}: {str(e).split(': ', 1)[-1]}",
                                         "e.g. --resume-at 2") from None
        audit = tuple((name, value) for name, value in (("audit_canaries", getattr(args, "audit_canaries", None)),
                                                        ("audit_steps", getattr(args, "audit_steps", None)),
                                                        ("audit_confidence", getattr(args, "audit_confidence", None)))
                      if value is not None)  # the privacy audit's size: the options of the property that takes them
        for name, value in audit:
            for prop in PROPERTIES.values():
                if prop.check_params is not None and name in dict(prop.params):
                    try:
                        prop.check_params({**dict(prop.params), name: value})
                    except ValueError as e:
                        flag = "--" + name.replace("_", "-")
                        raise UsageError(f"{flag} {value}: {str(e).split(': ', 1)[-1]}", f"e.g. {flag} "
                                         f"{dict(prop.params)[name]}") from None
        check_optional_pieces(args, import_opacus=False)
        explore, explore_note = parse_explore(args, job_world_size)
        explore_cap = parse_explore_cap(args)
        axes = parse_axes(args)
        info = load_target_info(args.target) if args.target != "opacus" else _opacus_files_info()
        reports = Reports(json=args.json, junit=args.junit, markdown=args.markdown)
        for path in (reports.json, reports.junit, reports.markdown, getattr(args, "write_expect", None)):
            if path and path != "-" and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                raise UsageError(f"cannot write report {path!r}: its directory does not exist", "create it first")
        sampling = parse_sampling(args, max(world_sizes + [1]))
        # last, the options other modules own, each parsed by its own module: the modes, the --expect file
        modes = modes_mod.parse_all(args.mode_env or ())
        if args.properties:  # a property the user named explicitly must be able to run
            for p in props:
                problem = modes_problem(PROPERTIES[p], modes or modes_mod.DEFAULT_MODES)
                if problem:
                    raise UsageError(problem, modes_mod.TWO_MODES_EXAMPLE)
        expectations = load_expectations(args.expect) if args.expect else None  # an unusable file: ExpectationsError
        options = Options(target=args.target, world_sizes=tuple(world_sizes), modes=modes or modes_mod.DEFAULT_MODES,
                          grad_sample_mode=args.grad_sample_mode, backend=args.backend, timeout=float(args.timeout),
                          wide_world_size=wide, wide_unavailable=wide_unavailable, horizon=horizon,
                          node_world_size=nodes, node_unavailable=nodes_unavailable,
                          meshes=tuple(meshes),
                          **axes, **sampling,
                          params=((("physical_batch_size", physical),) if physical else ())
                          + ((("resume_at", resume_at),) if resume_at is not None else ()) + audit
                          # a property with this param named: at every world size and the wide one (the audit's
                          # default is its smallest)
                          + ((("audit_every_world_size", True),) if args.properties and any(
                              "audit_every_world_size" in dict(PROPERTIES[p].params) for p in props) else ()))
        return cls(options=options, properties=tuple(props), target_info=tuple(info.items()), fuzz=args.fuzz,
                   explore=explore, explore_cap=explore_cap, explore_note=explore_note,
                   expectations=expectations, reports=reports,
                   quiet=args.quiet, verbose=getattr(args, "verbose", False),
                   write_expect=getattr(args, "write_expect", None), job_world_size=job_world_size,
                   mode_env=tuple(args.mode_env or ()))

    def loaded(self) -> "RunPlan":
        """This plan, checked against the target it runs (``UsageError`` otherwise): the gloo
        backend asked for the world sizes (``parse`` leaves it: asking imports torch), ``--target
        opacus`` imported and described, each model of one's own made once (``check_user_models``)."""
        opts = self.options
        if opts.backend == "gloo" and opts.world_sizes and self.job_world_size is None:
            parse_world_sizes(",".join(map(str, opts.world_sizes)), opts.backend)
        info = self.target_info
        if opts.target == "opacus":
            _check_opacus(import_it=True)
            info = tuple(load_target_info(opts.target).items())
        if opts.models:  # a model of one's own is used once here: exit 2 if it cannot be
            check_user_models(opts.models)
        return replace(self, target_info=info)


def _explore_draws(text: str, where: str) -> int:
    """``text`` as a number of draws (``UsageError`` naming ``where`` otherwise). An integral float
    ("6", "6.0": what ``--explore SECONDS`` took until 2026-11-28) is accepted as that many draws."""
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{where} {text!r}: not a number of draws", f"e.g. {where} 4, or 0 for a fixed run") from None
    if not (value >= 0 and value == int(value)):
        raise UsageError(f"{where} {text}: must be a whole number of draws per explored property >= 0 (a number of "
                         "configurations fixed by the seed, no longer seconds: --explore-cap is the time cap)",
                         f"e.g. {where} 4, or 0 for a fixed run")
    return int(value)


def parse_explore_cap(args) -> float:
    """``--explore-cap SECONDS`` (``defaults.DEFAULT_EXPLORE_CAP_S`` when not given); ``UsageError`` unless > 0."""
    from ..config.defaults import DEFAULT_EXPLORE_CAP_S

    given = getattr(args, "explore_cap", None)
    if given is None:
        return DEFAULT_EXPLORE_CAP_S
    if not given > 0 or given == float("inf"):
        raise UsageError(f"--explore-cap {given}: must be a number of seconds > 0", "e.g. --explore-cap 120")
    return float(given)


def parse_explore(args, job_world_size: Optional[int]) -> Tuple[int, str]:
    """``(draws, note)`` of exploration from ``--explore`` (``UsageError`` for a bad value, or
    for asking for it where it cannot run). Not given: ``defaults.DEFAULT_EXPLORE_DRAWS`` where
    hypothesis is installed and the ranks are the gate's own; else 0 with the note saying why."""
    from ..config.defaults import DEFAULT_EXPLORE_DRAWS, EXPLORE_ENV

    given = getattr(args, "explore", None)
    if given is not None:
        draws = _explore_draws(str(given), "--explore")
        if draws > 0 and job_world_size is not None:
            raise UsageError("--explore: a torchrun job runs at its own world size; exploration draws world sizes",
                             "omit --explore inside a torchrun job")
        if draws > 0:
            require_hypothesis("--explore")
        return draws, ""
    if job_world_size is not None:
        return 0, "no exploration inside a torchrun job (its world size is fixed)"
    default = DEFAULT_EXPLORE_DRAWS
    if os.environ.get(EXPLORE_ENV, "").strip():
        default = _explore_draws(os.environ[EXPLORE_ENV].strip(), EXPLORE_ENV + "=")
        if default == 0:
            return 0, ""
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        return 0, "no exploration: it needs hypothesis (pip install hypothesis: the 'fuzz' extra)"
    return default, ""


def parse_reach(args, world_sizes: List[int], job_world_size: Optional[int],
                probe: bool = True) -> Tuple[int, int, str]:
    """``(wide world size, horizon steps, why the wide world size cannot run here or "")`` from
    ``--wide-world-size`` / ``--horizon`` (defaults: ``config/defaults.py``'s); ``UsageError``
    for values that cannot run. The default wide world size on a backend that cannot give its ranks
    (nccl on fewer GPUs) is kept, with the reason: its cases become ``skip`` verdicts saying so and
    the run goes on; one given explicitly must run. Inside a torchrun job the ranks are the job's: no
    wide world size unless it is the job's own (then it is in the matrix)."""
    from ..config.defaults import HORIZON_STEPS, WIDE_WORLD_SIZE

    wide = getattr(args, "wide_world_size", None)
    horizon = getattr(args, "horizon", None)
    if horizon is not None and horizon < 0:
        raise UsageError(f"--horizon {horizon}: must be >= 0 steps", "e.g. --horizon 48, or 0 for no long runs")
    if wide is not None and (wide < 0 or 0 < wide < 3):
        raise UsageError(f"--wide-world-size {wide}: must be >= 3 (or 0: none)", "e.g. --wide-world-size 3")
    if job_world_size is not None:
        if wide:
            raise UsageError("--wide-world-size: a torchrun job runs at its own world size only",
                             f"relaunch with {wide} ranks, or omit --wide-world-size")
        wide = 0
    elif wide is None:  # --meshes without --world-sizes: only the meshes run (docs/meshes.md)
        wide = WIDE_WORLD_SIZE if world_sizes else 0
        unavailable = backend_shortfall(args.backend, wide, probe) if wide and wide not in world_sizes else ""
        if unavailable:
            return wide, HORIZON_STEPS if horizon is None else horizon, unavailable
    if wide and wide not in world_sizes:
        parse_world_sizes(str(wide), args.backend, probe)  # the backend must be able to run it
    return wide, HORIZON_STEPS if horizon is None else horizon, ""


def parse_nodes(args, world_sizes: List[int], job_world_size: Optional[int],
                probe: bool = True) -> Tuple[int, str]:
    """``(node world size, why it cannot run here or "")`` from ``--node-world-size`` (default
    ``defaults.NODE_WORLD_SIZE``: 4 ranks as 2 simulated nodes x 2), as ``parse_reach`` treats the
    wide world size: ``UsageError`` for a value that cannot run (odd, or below 4), none inside a
    torchrun job or a run of meshes only, the default kept with the reason where the backend cannot
    give its ranks (its cases become ``skip`` verdicts)."""
    from ..config.defaults import NODE_WORLD_SIZE

    nodes = getattr(args, "node_world_size", None)
    if nodes is not None and (nodes < 0 or (nodes and (nodes < 4 or nodes % 2))):
        raise UsageError(f"--node-world-size {nodes}: must be even and >= 4 (nodes of 2 ranks), or 0: none",
                         "e.g. --node-world-size 4")
    if job_world_size is not None:
        if nodes:
            raise UsageError("--node-world-size: a torchrun job runs at its own world size only",
                             f"relaunch with {nodes} ranks, or omit --node-world-size")
        return 0, ""
    if nodes is None:
        nodes = NODE_WORLD_SIZE if world_sizes else 0
        unavailable = backend_shortfall(args.backend, nodes, probe) if nodes and nodes not in world_sizes else ""
        if unavailable:
            return nodes, unavailable
    if nodes and nodes not in world_sizes:
        parse_world_sizes(str(nodes), args.backend, probe)  # the backend must be able to run it
    return nodes, ""


def backend_shortfall(backend: str, world_size: int, probe: bool = True) -> str:
    """Why ``backend`` cannot give ``world_size`` ranks here, as a skip verdict's message ("" when
    it can): for nccl, "needs 3 GPUs, 1 visible; run with --backend gloo for the 3-rank cases"."""
    from ..harness import BackendUnavailable, check_backend

    if not probe:
        return ""
    try:
        check_backend(backend, world_size)
    except (BackendUnavailable, ValueError) as e:
        if backend == "nccl":
            from ..harness.backends import visible_gpus

            return (f"needs {world_size} GPUs, {visible_gpus()} visible; run with --backend gloo for the "
                    f"{world_size}-rank cases")
        return f"{e}; run with --backend gloo for the {world_size}-rank cases"
    return ""


def parse_world_sizes(text: str, backend: str, probe: bool = True) -> List[int]:
    """``--world-sizes`` as sorted distinct ints the backend can run; ``UsageError`` otherwise.
    ``probe=False``: the backend is not asked (a dry run of a gloo plan: asking imports torch)."""
    from ..harness import BackendUnavailable, check_backend

    try:
        world_sizes = sorted({int(w) for w in csv(text)})
    except ValueError:
        raise UsageError(f"--world-sizes {text!r}: not a comma list of integers", "e.g. --world-sizes 1,2") from None
    if not world_sizes or world_sizes[0] < 1:
        raise UsageError(f"--world-sizes {text!r}: world sizes must be >= 1", "e.g. --world-sizes 1,2")
    if backend == "gloo" and world_sizes[-1] > MAX_GLOO_WORLD_SIZE:
        raise UsageError(f"--world-sizes: {world_sizes[-1]} gloo ranks is more than this gate runs on one host "
                         f"(max {MAX_GLOO_WORLD_SIZE})",
                         "run the gate inside a torchrun job for larger worlds (--launcher torchrun, docs/torchrun.md)")
    try:
        if probe:
            check_backend(backend, world_sizes[-1])
    except (BackendUnavailable, ValueError) as e:
        raise UsageError(f"--backend {backend}: {e}", "use --backend gloo on CPU runners") from None
    return world_sizes


def parse_meshes(text: Optional[str], backend: str, job_world_size: Optional[int] = None) -> List[str]:
    """``--meshes`` as canonical mesh names (``dpfsdp_verify.targets.mesh``), each runnable here: ``UsageError``
    for a malformed name, an unknown kind, more gloo ranks than one host runs, or (inside a torchrun
    job) a mesh whose world size is not the job's."""
    from ..targets.mesh import Mesh, MeshError

    if text is None:
        return []
    hint = "e.g. --meshes hsdp:2x2,tp:2x2 (hsdp: replicas x shard; tp: data x tensor parallel)"
    names = csv(text)
    if not names:
        raise UsageError(f"--meshes {text!r}: no mesh named", hint)
    meshes = []
    for name in names:
        try:
            mesh = Mesh.parse(name)
        except MeshError as e:
            raise UsageError(f"--meshes: {e}", hint) from None
        if job_world_size is not None and mesh.world_size != job_world_size:
            raise UsageError(f"--meshes {mesh.label}: world size {mesh.world_size} (R*S) is not this torchrun job's "
                             f"{job_world_size} ranks", f"relaunch with {mesh.world_size} ranks or name a mesh of "
                             f"{job_world_size}")
        if job_world_size is None and backend == "gloo" and mesh.world_size > MAX_GLOO_WORLD_SIZE:
            raise UsageError(f"--meshes {mesh.label}: {mesh.world_size} gloo ranks is more than this gate runs on one "
                             f"host (max {MAX_GLOO_WORLD_SIZE})", hint)
        if job_world_size is None and backend != "gloo" and backend_shortfall(backend, mesh.world_size):
            raise UsageError(f"--meshes {mesh.label}: backend {backend!r} "
                             f"{backend_shortfall(backend, mesh.world_size)}",
                             "name a mesh of as many ranks as GPUs, or use --backend gloo")
        meshes.append(mesh.label)
    return list(dict.fromkeys(meshes))


def launched_world_sizes(text: Optional[str], job_world_size: int) -> List[int]:
    """``--world-sizes`` inside a torchrun job: the job's own size when not given; a list must
    include it (cases at its other sizes are reported as not run at this size, never dropped).
    No per-host limit and no local device count: the ranks are the job's, across its nodes."""
    if text is None:
        return [job_world_size]
    try:
        world_sizes = sorted({int(w) for w in csv(text)})
    except ValueError:
        raise UsageError(f"--world-sizes {text!r}: not a comma list of integers",
                         f"omit it to run at the job's world size {job_world_size}") from None
    if job_world_size not in world_sizes:
        raise UsageError(f"--world-sizes {text!r}: this torchrun job has {job_world_size} ranks, so none of these "
                         "world sizes can run in it", f"omit --world-sizes, or relaunch with {world_sizes[-1]} ranks")
    return world_sizes


def parse_axes(args) -> Dict:
    """``--models``, ``--loss-reductions``, ``--dtypes`` (``None``: each property's own),
    ``--precisions`` (``None``: fp32 only)."""
    from ..models.catalog import MODEL_NAMES, expand_models
    from ..properties.analysis.compare import TOLERANCES

    from ..properties.engine.contract import precision_problem
    from ..targets.base import PRECISIONS

    out: Dict = {"models": None, "reductions": None, "dtypes": None, "precisions": None}
    for key, flag, text, allowed, example in (
            ("models", "--models", args.models, MODEL_NAMES, "--models mlp"),
            ("reductions", "--loss-reductions", args.loss_reductions, REDUCTIONS, "--loss-reductions mean"),
            ("dtypes", "--dtypes", args.dtypes, tuple(TOLERANCES), "--dtypes float64,float32"),
            ("precisions", "--precisions", getattr(args, "precisions", None), PRECISIONS,
             "--precisions fp32,bf16-fsdp,bf16-autocast")):
        if text is None:
            continue
        values = tuple(csv(text))
        if key == "models" and values:  # built-in names, groups (real) and import paths (docs/models.md)
            try:
                out[key] = expand_models(values)
            except ValueError as e:
                raise UsageError(str(e), f"e.g. {example}, or --models mypkg.mymodel:MyModel") from None
            continue
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            what = f"unknown model {', '.join(bad) or '(none)'}" if key == "models" else f"{flag} {text!r}"
            raise UsageError(f"{what}: choose from {','.join(allowed)}", f"e.g. {example}")
        out[key] = values
    problem = precision_problem(out["precisions"], out["dtypes"])
    if problem:
        raise UsageError(f"--precisions: {problem}", "e.g. --precisions bf16-fsdp --dtypes float32")
    return out


def check_user_models(names: Sequence[str]) -> None:
    """The models of ``--models`` given by their own code (``docs/models.md``), used once before a
    run: ``UsageError`` naming the first contract model of ``names`` that cannot be imported, made,
    built, batched or forwarded (the built-in models are not looked at), before any rank starts,
    never a traceback from inside torch. Imports torch and the model's module."""
    from ..models.catalog import MODEL_DIMS, contract_path

    wanted = [n for n in names if n not in MODEL_DIMS and contract_path(n) is not None]
    if not wanted:
        return
    from ..models import contract

    for name in wanted:
        try:
            contract.check(name)
        except contract.ContractError as e:
            raise UsageError(str(e), "a model needs build(seed), batch(n, seed) and loss(output, targets): "
                                     "see docs/models.md") from None


def _opacus_files_info() -> Dict[str, str]:
    """``{"name", "version"}`` of ``--target opacus`` from the installed files, nothing imported."""
    from .target_info import opacus_info

    return {"name": "opacus", "version": (opacus_info() or {}).get("version", "unknown")}


def check_optional_pieces(args, import_opacus: bool = True) -> None:
    """The optional pieces the run needs are present -- the opacus it would test (``--target
    opacus``), hypothesis for ``--fuzz``: ``UsageError`` naming the ``pip install`` otherwise."""
    if args.target == "opacus":
        _check_opacus(import_opacus)
    if args.fuzz > 0:
        require_hypothesis("--fuzz")


def _check_opacus(import_it: bool) -> None:
    """``UsageError`` unless opacus is importable (``import_it=False``: found, not imported)."""
    try:
        if import_it:
            import opacus  # noqa: F401
        else:  # --dry-run: importable, not imported
            import importlib.util

            if importlib.util.find_spec("opacus") is None:
                raise ImportError("No module named 'opacus'")
    except ImportError as e:
        raise UsageError(f"--target opacus: no opacus is importable ({type(e).__name__}: {e})",
                         "install your fork (pip install -e PATH) or upstream (pip install opacus, after a CPU "
                         "torch: docs/gate.md), or give --target MODULE:ATTR") from None


def require_hypothesis(what: str) -> None:
    """``UsageError`` (exit 2, one line naming the extra) when hypothesis is not importable."""
    try:
        import hypothesis  # noqa: F401
    except ImportError as e:
        raise UsageError(f"{what} needs hypothesis, which is not importable ({type(e).__name__}: {e})",
                         "pip install hypothesis (the 'fuzz' extra)") from None


def parse_sampling(args, max_world_size: int) -> Dict:
    """The sampling axis and the run seed from ``--sampling``, ``--seeding``, ``--sample-rate``,
    ``--dataset-size``, ``--seed`` (``UsageError`` for a bad value; the rules are
    ``properties.engine.contract.sampling_problem``'s). No ``--seed``: a fresh random seed."""
    import random

    from ..properties.engine.contract import sampling_problem

    samplings = tuple(csv(args.sampling)) if args.sampling is not None else None
    seedings = tuple(csv(args.seeding)) if args.seeding is not None else None
    problem = sampling_problem(samplings, seedings, args.sample_rate, args.dataset_size, max_world_size)
    if problem:
        raise UsageError(f"--{problem}" if problem.startswith(("sampling", "seeding")) else problem,
                         "e.g. --sampling fixed,poisson --seeding same --sample-rate 0.25 --dataset-size 16")
    if args.seed is not None and not 0 <= args.seed < 2 ** 31:
        raise UsageError(f"--seed {args.seed}: must be in 0..2**31-1", "copy it from a report's repro line")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 2 ** 31)
    return dict(samplings=samplings, seedings=seedings, sample_rate=args.sample_rate,
                dataset_size=args.dataset_size, seed=seed)


def parse_modes(items: List[str]) -> Tuple[Mode, ...]:
    """``--mode-env`` values as modes; ``modes.ModeSyntaxError`` (a ``HintedError``) if malformed."""
    return modes_mod.parse_all(items or ())


def load_target_info(ref: str) -> Dict[str, str]:
    """``{"name", "version"}`` of the target; ``UsageError`` if it cannot be loaded."""
    from ..targets import TargetLoadError, target_info

    try:
        return target_info(ref)
    except TargetLoadError as e:
        raise UsageError(f"--target {ref}: {e}", "give 'opacus' or an importable MODULE:ATTR") from None


def positive_world_size(text: str) -> int:
    """``--world-size`` of ``replay``: one integer >= 1; ``UsageError`` otherwise."""
    try:
        ws = int(text)
    except ValueError:
        ws = 0
    if ws < 1:
        raise UsageError(f"--world-size {text!r}: must be an integer >= 1", "e.g. --world-size 2")
    return ws


__all__ = ["RunPlan", "Reports", "UsageError", "parse_modes", "load_target_info", "positive_world_size", "csv",
           "require_hypothesis", "MAX_GLOO_WORLD_SIZE"]

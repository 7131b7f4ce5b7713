"""``dpfsdp-verify``: the CI gate for opacus forks.

    dpfsdp-verify run [--target opacus|MODULE:ATTR] [--grad-sample-mode ghost_fsdp]
        [--mode-env LABEL:VAR=VAL[,VAR=VAL]]... [--world-sizes 1,2] [--backend gloo|nccl]
        [--properties p1,p2] [--models mlp,transformer] [--loss-reductions mean,sum] [--dtypes float64,float32]
        [--precisions fp32,bf16-fsdp,bf16-autocast]
        [--sampling fixed,poisson] [--seeding same,per_rank,unseeded] [--sample-rate Q] [--dataset-size N]
        [--seed S]
        [--timeout SECONDS] [--fuzz N] [--expect FILE|NAME] [--json PATH|-] [--junit PATH]
        [--markdown PATH] [-q] [-v] [--write-expect FILE] [--launcher spawn|torchrun] [--dry-run]
    dpfsdp-verify replay --target T --property P --world-size N --spec JSON [--mode-env ...]
    dpfsdp-verify list
    dpfsdp-verify scale --target T --dataset-size N --sample-rate Q [--physical-batch-size P]
        [--seeding per_rank|same|unseeded] [--steps S] [--world-sizes 8,64,512,1024] [--seed S]
        [--json PATH|-] [--plot PATH]     # at-scale hang risk of the data pipeline (docs/scale.md)
    dpfsdp-verify --version      # also the opacus (version, path) and torch it would use

Exit codes 0 / 1 / 2 / 3: stated once, in docs/gate.md ("Exit codes"); computed in
``result.exit_code``.
Progress goes to stderr while it runs; the summary table to stdout at the end (to stderr when
--json - puts the JSON report on stdout).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from ..harness import DEFAULT_TIMEOUT_S
from ..harness.backends import BACKENDS, NAMES as BACKEND_NAMES
from ..config.defaults import (DEFAULT_EXPLORE_CAP_S, DEFAULT_EXPLORE_DRAWS, DEFAULT_GRAD_SAMPLE_MODE,
                               DEFAULT_WORLD_SIZES, HORIZON_STEPS, POISSON_DEFAULTS, SCALE_SEED, SCALE_STEPS,
                        SCALE_WORLD_SIZES, WIDE_WORLD_SIZE, NODE_WORLD_SIZE)
from ..errors import HintedError
from .report import EXIT_FAIL, EXIT_INTERNAL, EXIT_OK, EXIT_USAGE
from .target_info import VersionAction
from .plan import (RunPlan, UsageError, load_target_info, parse_modes, positive_world_size,
                   require_hypothesis)
from ..verdict import FAILING



class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse exits 2 too; keep our one-line format
        raise UsageError(message, f"see '{self.prog} --help'")


def _target_arg(what) -> None:
    """``--target``: what ``run`` and ``replay`` test (into an argument group or the parser)."""
    what.add_argument("--target", default="opacus",
                      help="'opacus' (the installed opacus) or MODULE:ATTR of an adapter (default: opacus)")


def _environment_args(what, execution) -> None:
    """Arguments ``run`` and ``replay`` share: under which environments (into ``what``), where and
    how long (into ``execution``); each an argument group or the parser itself."""
    what.add_argument("--mode-env", action="append", default=[], metavar="LABEL:VAR=VAL[,VAR=VAL]",
                      help="run under this labelled environment; two or more: the properties that compare modes "
                           "check the first against each other one")
    execution.add_argument("--backend", default="gloo", choices=BACKEND_NAMES,
                           help="; ".join(BACKENDS[n].description for n in BACKEND_NAMES) + " (default gloo)")
    execution.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                           help=f"deadline per distributed job, seconds (default {DEFAULT_TIMEOUT_S:g})")


def build_parser() -> argparse.ArgumentParser:
    """The command line; imports no torch, so ``--help`` answers at once."""
    p = _Parser(prog="dpfsdp-verify", description="Correctness and deadlock gate for DP training under FSDP.")
    p.add_argument("--version", action=VersionAction)  # + the opacus it would test
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    run = sub.add_parser("run", help="run the properties against a target and report verdicts",
                         description="Run the properties against a target and report verdicts (docs/gate.md). "
                                     "Start with --target, --expect and --json/--junit.")
    what = run.add_argument_group("what to check")
    reports = run.add_argument_group("reports")
    matrix = run.add_argument_group("matrix (default: each property's own; see 'dpfsdp-verify list')")
    sampling = run.add_argument_group("sampling (the properties on the sampling axis)")
    loops = run.add_argument_group("loop shapes")
    execution = run.add_argument_group("execution")
    _target_arg(what)
    what.add_argument("--expect", metavar="FILE|NAME",
                      help="known failures (TOML, or a shipped name such as opacus-1.6.0): exit 0 when exactly "
                           "these fail (docs/gate.md)")
    what.add_argument("--properties", default=None, help="comma list of property ids (default: all)")
    what.add_argument("--grad-sample-mode", default=DEFAULT_GRAD_SAMPLE_MODE,
                      help=f"grad_sample_mode passed to make_private (default {DEFAULT_GRAD_SAMPLE_MODE})")
    what.add_argument("--fuzz", type=int, default=0, metavar="N",
                      help="also run N hypothesis-fuzzed examples per fuzzable property (default 0)")
    what.add_argument("--explore", type=str, default=None, metavar="DRAWS",
                      help="also judge DRAWS configurations per explored property drawn from the configuration space "
                           "beyond the fixed cases, fixed by --seed (the same ones on any machine; a failure is shrunk "
                           f"and reported with its replay line); 0: a fixed run (default {DEFAULT_EXPLORE_DRAWS} where "
                           "hypothesis is installed; docs/explore.md)")
    what.add_argument("--explore-cap", type=float, default=None, metavar="SECONDS",
                      help="time cap of the exploration, from the end of the fixed cases (it runs beside them): draws "
                           "not started by then are not run, and the report and the exit line say so (default "
                           f"{DEFAULT_EXPLORE_CAP_S:g})")
    _environment_args(what, execution)
    reports.add_argument("--json", metavar="PATH", help="write the JSON report here ('-': stdout)")
    reports.add_argument("--junit", metavar="PATH", help="write JUnit XML here")
    reports.add_argument("--markdown", metavar="PATH",
                         help="write a markdown summary here (plot beside it if matplotlib)")
    reports.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    reports.add_argument("-v", "--verbose", action="store_true",
                         help="the summary lists every verdict and every failure's message (default: one block per "
                              "cause of failure)")
    reports.add_argument("--write-expect", metavar="FILE",
                         help="write this run's failures as an expectations file, one entry per cause, that "
                              "'--expect FILE' accepts (a baseline; docs/gate.md)")
    matrix.add_argument("--world-sizes", default=None,
                        help=f"comma list (default {','.join(map(str, DEFAULT_WORLD_SIZES))}; "
                             "with --launcher torchrun: the job's size)")
    matrix.add_argument("--meshes", default=None, metavar="hsdp:RxS,tp:DxT",
                        help="2-D meshes for the properties that support them (HSDP replicas x shard, data x "
                             "tensor parallel; docs/meshes.md); without --world-sizes only the meshes run")
    matrix.add_argument("--wide-world-size", type=int, default=None, metavar="W",
                        help="a world size >= 3 for a few cheap cases that rank-index bugs hit (rank %% 2, "
                             f"LOCAL_RANK, rank ^ 1, a shard offset); 0: none (default {WIDE_WORLD_SIZE}; "
                             "docs/horizon.md)")
    matrix.add_argument("--node-world-size", type=int, default=None, metavar="N",
                        help="an even world size >= 4, run as nodes of 2 ranks, for a few cases that bugs from the "
                             "fourth rank on or across nodes hit (rank >= 3, LOCAL_RANK + GROUP_RANK, a 4-rank "
                             f"collective); 0: none (default {NODE_WORLD_SIZE}; docs/horizon.md)")
    matrix.add_argument("--models", default=None,
                        help="comma list of mlp,conv,transformer, lora,tied (docs/finetune.md), masked "
                             "(docs/sequences.md)")
    matrix.add_argument("--loss-reductions", default=None, help="comma list of mean,sum")
    matrix.add_argument("--dtypes", default=None, help="comma list of float64,float32,bfloat16")
    matrix.add_argument("--precisions", default=None, metavar="fp32,bf16-fsdp,bf16-autocast",
                        help="mixed-precision forms for the properties that judge them (default fp32; "
                             "docs/precision.md)")
    sampling.add_argument("--sampling", default=None, metavar="fixed,poisson",
                          help="how each step's batch is formed: given batches, or DP-SGD's Poisson sampling "
                               "(default: each property's own)")
    sampling.add_argument("--seeding", default=None, metavar="same,per_rank,unseeded",
                          help="Poisson seeding: every rank alike, seed + rank, or none (default: each property's own)")
    sampling.add_argument("--sample-rate", type=float, default=None, metavar="Q",
                          help=f"Poisson sample rate q in (0, 1] (default {POISSON_DEFAULTS[0]:g})")
    sampling.add_argument("--dataset-size", type=int, default=None, metavar="N",
                          help=f"Poisson dataset size, all ranks together (default {POISSON_DEFAULTS[1]} x world size)")
    sampling.add_argument("--seed", type=int, default=None, metavar="S",
                          help="the run's statistical seed (default: a fresh one, printed; --seed S replays a run)")
    loops.add_argument("--physical-batch-size", type=int, default=None, metavar="P",
                       help="gradient accumulation in physical batches of at most P samples, for the properties "
                            "with the option physical_batch_size (default: theirs, 'dpfsdp-verify list'; "
                            "docs/loops.md)")
    loops.add_argument("--resume-at", type=int, default=None, metavar="K",
                       help="checkpoint after K steps and resume in fresh ranks, for the properties with the option "
                            "resume_at (default: theirs, 'dpfsdp-verify list'; docs/resume.md)")
    loops.add_argument("--horizon", type=int, default=None, metavar="STEPS",
                       help="steps of the long Poisson run per check family, every step judged; 0: none "
                            f"(default {HORIZON_STEPS}; docs/horizon.md)")
    execution.add_argument("--dry-run", action="store_true",
                           help="check the options and print the plan (cases per property and world size, skips "
                                "and why, GPUs needed, estimated time); start nothing, exit 0 or 2")
    what.add_argument("--audit-canaries", type=int, default=None, metavar="M",
                      help="canaries of the privacy audit (default 2000; docs/audit.md)")
    what.add_argument("--audit-steps", type=int, default=None, metavar="T",
                      help="DP steps of the privacy audit (default 100; docs/audit.md)")
    what.add_argument("--audit-confidence", type=float, default=None, metavar="C",
                      help="confidence of the privacy audit's bounds, in [0.5, 1) (default 0.998: 0.2%% false alarms "
                           "per audit; 0.95 for a tighter nightly audit; docs/audit.md)")
    execution.add_argument("--launcher", default="spawn", choices=("spawn", "torchrun"),
                           help="spawn: start the ranks on this host (default); torchrun: run inside the ranks of "
                                "'torchrun ... -m dpfsdp_verify run --launcher torchrun' (docs/torchrun.md)")
    replay = sub.add_parser("replay", help="re-run one fuzzed configuration (the repro line of a fuzz verdict)")
    _target_arg(replay)
    _environment_args(replay, replay)
    replay.add_argument("--property", required=True, help="id of a property that can be fuzzed")
    replay.add_argument("--world-size", required=True, help="number of ranks")
    replay.add_argument("--spec", required=True, help="the JSON RunSpec of a fuzz verdict's repro line")
    replay.add_argument("--exact", action="store_true",
                        help="run the spec exactly as given, without the property's preparation (an --explore "
                             "verdict's repro line)")
    sub.add_parser("list", help="list properties and targets")
    _scale_parser(sub)
    return p


def cmd_list() -> int:
    from ..properties import PROPERTIES

    print("properties (* can be fuzzed: --fuzz N, replay) and what each runs by default:")
    for pid, prop in PROPERTIES.items():
        opt_in = "(opt-in: runs only when --properties names it) " if prop.opt_in else ""
        print(f"  {pid + (' *' if prop.fuzz else ''):<20} {opt_in}{prop.meaning}")
        print(f"  {'':<20} models {','.join(prop.models)}; layouts {','.join(prop.layouts)}; reductions "
              f"{','.join(prop.reductions)}; dtypes {','.join(prop.dtypes)}"
              + (f"; precisions {','.join(prop.precisions)} (--precisions)" if len(prop.precisions) > 1 else "")
              + (f"; options {', '.join(f'{k}={v}' for k, v in prop.params)}" if prop.params else ""))
    print("targets:")
    print("  opacus             the installed opacus through its public API (FSDP2Wrapper + make_private)")
    try:
        from importlib.metadata import entry_points

        for ep in entry_points(group="dpfsdp_verify.targets"):
            print(f"  {ep.name:<18} {ep.value} (entry point)")
    except Exception:
        pass
    print("  MODULE:ATTR        any adapter implementing dpfsdp_verify.targets.base.Target")
    return EXIT_OK


def cmd_run(args) -> int:
    # like `python -m`: an adapter MODULE:ATTR may live in the current directory
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    dry = getattr(args, "dry_run", False)
    rank: Optional[int] = None
    job_world_size: Optional[int] = None
    if args.launcher == "torchrun" and not dry:
        from .torchrun_job import torchrun_rank

        rank, job_world_size = torchrun_rank()
    else:
        job_world_size = _dry_job_size(args) if dry else None
    # a usage error answers before torch or the target is imported (the dry run's plan, which
    # imports neither for a gloo one): in under a second, not after the ranks' zygotes start
    plan = RunPlan.parse(args, job_world_size=job_world_size)
    # the main job first: a spawned gate, then a torchrun job's rank, then the dry run's plan
    if not dry and rank is None:
        from .run import execute_spawned

        return execute_spawned(plan)
    if rank is not None:
        from .torchrun_job import run_torchrun

        return run_torchrun(plan, rank)
    from .dryrun import dry_run

    return dry_run(plan)


def _dry_job_size(args) -> Optional[int]:
    """The world size a dry run plans at: ``None`` (the plan's own), or inside a torchrun job
    (``--launcher torchrun``) the job's, as its rank 0 would."""
    if args.launcher != "torchrun":
        return None
    try:
        return int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise UsageError("--dry-run --launcher torchrun: plans at the torchrun job's world size, and "
                         "WORLD_SIZE is not set", "run it inside the job, or set WORLD_SIZE=N") from None


def _replayable(property_id: str, exact: bool):
    """The property a ``replay`` re-runs: one with a fuzz recipe, or with ``--exact`` (an explored
    draw's line) one with an explore recipe too; ``ValueError`` naming them."""
    from ..fuzz import fuzzable_property
    from ..properties import PROPERTIES

    prop = PROPERTIES.get(property_id)
    if exact and prop is not None and prop.explore is not None:
        return prop
    try:
        return fuzzable_property(property_id)
    except ValueError:
        if not exact:
            raise
    explorable = sorted(p.id for p in PROPERTIES.values() if p.explore is not None or p.fuzz is not None)
    raise ValueError(f"property {property_id!r} has no fuzzed or explored draws to replay; choose one of "
                     f"{', '.join(explorable)}")


def cmd_replay(args) -> int:
    """Re-run one fuzzed (or, with ``--exact``, explored) spec; prints its verdict; exit 1 if it fails."""
    require_hypothesis("replay")  # hypothesis is the optional [fuzz] extra: exit 2, not 3
    from ..fuzz import check_example, format_failure, spec_from_json
    from ..harness import Pool

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    exact = getattr(args, "exact", False)
    try:
        prop = _replayable(args.property, exact)
    except ValueError as e:
        raise UsageError(f"--property: {e}", "see 'dpfsdp-verify list'") from None
    world_size = positive_world_size(args.world_size)
    try:
        spec = spec_from_json(args.spec)
    except (ValueError, TypeError) as e:
        raise UsageError(f"--spec: not a RunSpec in JSON ({e})", "copy it from the fuzz verdict's repro line") from None
    modes = parse_modes(args.mode_env)
    load_target_info(args.target)
    from ..properties import Options

    opts = Options(target=args.target, world_sizes=(world_size,), modes=modes or Options.modes,
                   backend=args.backend, timeout=args.timeout)
    with Pool() as pool:
        if exact:
            from ..fuzz.explore import check_exact

            v = check_exact(prop, opts, spec, world_size, pool)
        else:
            v = check_example(args.property, opts, spec, world_size, pool=pool)
    print(format_failure(v) if v.status in FAILING else f"{v.property}: {v.status}: {v.message}")
    return EXIT_FAIL if v.status in FAILING else EXIT_OK


def _scale_parser(sub) -> None:
    sc = sub.add_parser("scale", help="at-scale hang risk of the target's own Poisson data pipeline, without training")
    sc.add_argument("--target", default="opacus", help="'opacus' or MODULE:ATTR (default: opacus)")
    sc.add_argument("--dataset-size", type=int, required=True, help="N: samples in the global dataset")
    sc.add_argument("--sample-rate", type=float, required=True, help="q: each sample's inclusion probability per step")
    sc.add_argument("--physical-batch-size", type=int, default=None,
                    help="BatchMemoryManager's max_physical_batch_size (gradient accumulation); default: none")
    sc.add_argument("--seeding", default="per_rank", help="same, per_rank or unseeded (default per_rank)")
    sc.add_argument("--steps", type=int, default=SCALE_STEPS,
                    help=f"nominal steps per rank, rounded up to epochs (default {SCALE_STEPS})")
    scale_ws = ",".join(map(str, SCALE_WORLD_SIZES))
    sc.add_argument("--world-sizes", default=scale_ws, help=f"comma list (default {scale_ws})")
    sc.add_argument("--seed", type=int, default=SCALE_SEED,
                    help=f"sampling seed of the first epoch (default {SCALE_SEED})")
    sc.add_argument("--json", default=None, metavar="PATH|-", help="write the figures as JSON (docs/scale.md)")
    sc.add_argument("--plot", default=None, metavar="PATH", help="risk vs world size, .png or .svg (extra 'plot')")


def cmd_scale(args) -> int:
    import json

    from . import scale
    from ..targets import TargetLoadError, load_target

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib", "pip install matplotlib (the 'plot' extra)") from None
    try:
        cfg = scale.ScaleConfig(dataset_size=args.dataset_size, sample_rate=args.sample_rate,
                                world_sizes=scale.parse_world_sizes(args.world_sizes),
                                physical_batch_size=args.physical_batch_size, seeding=args.seeding,
                                steps=args.steps, seed=args.seed)
        cfg.validate()
        target = load_target(args.target)
        report = scale.scale_report(target, cfg, args.target)
    except TargetLoadError as e:
        raise UsageError(f"--target {args.target}: {e}", "give 'opacus' or an importable MODULE:ATTR") from None
    text = scale.format_report(report)
    print(text, file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        data = json.dumps(report, indent=1, allow_nan=False)
        if args.json == "-":
            print(data)
        else:
            with open(args.json, "w") as f:
                f.write(data + "\n")
    if args.plot:
        scale.plot(report, args.plot)
    return EXIT_OK


def argv_command(argv: Optional[List[str]]) -> Optional[str]:
    """The subcommand ``argv`` (default: this process's) names, or ``None``."""
    words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    return words[0] if words else None


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "list":
            return cmd_list()
        if args.command == "run":
            return cmd_run(args)
        if args.command == "replay":
            return cmd_replay(args)
        if args.command == "scale":
            return cmd_scale(args)
        parser.print_help()
        return EXIT_USAGE
    except HintedError as e:  # UsageError and every other mistake in what the user gave
        print(f"dpfsdp-verify: error: {e}" + (f" (hint: {e.hint})" if e.hint else ""), file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `dpfsdp-verify list | head`: the reader left; not a bug of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        # a listing cut short is still a listing; a gate run whose output was cut short proves nothing
        return EXIT_OK if argv_command(argv) == "list" else EXIT_FAIL
    except Exception:  # a crash of dpfsdp-verify itself is exit 3, never mistaken for a verdict
        import traceback

        traceback.print_exc()
        print("dpfsdp-verify: internal error (a bug in dpfsdp-verify, not a verdict on the target)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["build_parser", "cmd_list", "cmd_run", "cmd_replay", "cmd_scale", "main"]

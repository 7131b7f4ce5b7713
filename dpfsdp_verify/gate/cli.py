"""``dpfsdp-verify``: the CI gate for opacus forks.

    dpfsdp-verify run [--target opacus|MODULE:ATTR] [--grad-sample-mode ghost_fsdp]
        [--mode-env LABEL:VAR=VAL[,VAR=VAL]]... [--world-sizes 1,2] [--backend gloo|nccl]
        [--properties p1,p2] [--models mlp,transformer] [--loss-reductions mean,sum] [--dtypes float64,float32]
        [--precisions fp32,bf16-fsdp,bf16-autocast]
        [--sampling fixed,poisson] [--seeding same,per_rank,unseeded] [--sample-rate Q] [--dataset-size N]
        [--seed S]
        [--timeout SECONDS] [--fuzz N] [--expect FILE|NAME] [--json PATH|-] [--junit PATH]
        [--markdown PATH] [-q] [--launcher spawn|torchrun]
    dpfsdp-verify replay --target T --property P --world-size N --spec JSON [--mode-env ...]
    dpfsdp-verify list
    dpfsdp-verify scale --target T --dataset-size N --sample-rate Q [--physical-batch-size P]
        [--seeding per_rank|same|unseeded] [--steps S] [--world-sizes 8,64,512,1024] [--seed S]
        [--json PATH|-] [--plot PATH]     # at-scale hang risk of the data pipeline (docs/scale.md)
    dpfsdp-verify --version      # also the opacus (version, path) and torch it would use

Exit codes 0 / 1 / 2 / 3: stated once, in docs/gate.md ("Exit codes"); computed in
``report.exit_code``.
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
from ..errors import HintedError
from .report import EXIT_FAIL, EXIT_INTERNAL, EXIT_OK, EXIT_USAGE
from .target_info import VersionAction
from .plan import (DEFAULT_WORLD_SIZES, RunPlan, UsageError, load_target_info, parse_modes, positive_world_size,
                   require_hypothesis)
from ..targets.base import DEFAULT_GRAD_SAMPLE_MODE
from ..verdict import FAILING



class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse exits 2 too; keep our one-line format
        raise UsageError(message, f"see '{self.prog} --help'")


def _target_args(p: argparse.ArgumentParser) -> None:
    """Arguments ``run`` and ``replay`` share: what to test, where, under which environments."""
    p.add_argument("--target", default="opacus",
                   help="'opacus' (the installed opacus, public API) or MODULE:ATTR of an adapter (default: opacus)")
    p.add_argument("--mode-env", action="append", default=[], metavar="LABEL:VAR=VAL[,VAR=VAL]",
                   help="run under this labelled environment; with two or more, properties that compare modes "
                        "check the first against each other one (e.g. immediate:OPACUS_USE_DEFERRED_NORM=0 "
                        "deferred:OPACUS_USE_DEFERRED_NORM=1)")
    p.add_argument("--backend", default="gloo", choices=BACKEND_NAMES,
                   help="; ".join(BACKENDS[n].description for n in BACKEND_NAMES) + " (default gloo)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"deadline per distributed job, seconds (default {DEFAULT_TIMEOUT_S:g})")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dpfsdp-verify", description="Correctness and deadlock gate for DP training under FSDP.")
    p.add_argument("--version", action=VersionAction)  # + the opacus it would test
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    run = sub.add_parser("run", help="run the properties against a target and report verdicts")
    _target_args(run)
    run.add_argument("--grad-sample-mode", default=DEFAULT_GRAD_SAMPLE_MODE,
                     help="grad_sample_mode passed to make_private (forks add e.g. ghost_fsdp_bk; "
                          f"default {DEFAULT_GRAD_SAMPLE_MODE})")
    run.add_argument("--world-sizes", default=None,
                     help=f"comma list (default {DEFAULT_WORLD_SIZES}; with --launcher torchrun: the job's world size)")
    run.add_argument("--meshes", default=None, metavar="hsdp:RxS,tp:DxT",
                     help="2-D meshes to run the properties that support them on (HSDP replicas x shard, data x "
                          "tensor parallel; docs/meshes.md); without --world-sizes only the meshes run")
    run.add_argument("--launcher", default="spawn", choices=("spawn", "torchrun"),
                     help="spawn: the gate starts its own ranks on this host (default); torchrun: run inside the "
                          "ranks of 'torchrun ... -m dpfsdp_verify run --launcher torchrun' (docs/torchrun.md)")
    run.add_argument("--properties", default=None, help="comma list of property ids (default: all)")
    run.add_argument("--models", default=None,
                     help="comma list of mlp,conv,transformer (base), lora,tied (fine-tuning: docs/finetune.md), "
                          "masked (padded variable-length sequences: docs/sequences.md) for every property "
                          "(default: each property's own; see 'dpfsdp-verify list')")
    run.add_argument("--loss-reductions", default=None,
                     help="comma list of mean,sum for every property (default: each property's own)")
    run.add_argument("--dtypes", default=None,
                     help="comma list of float64,float32,bfloat16 for every property (default: each property's "
                          "own: float64 everywhere, float32 too where the property runs it by default)")
    run.add_argument("--precisions", default=None, metavar="fp32,bf16-fsdp,bf16-autocast",
                     help="comma list of mixed-precision forms for the properties that judge them ('dpfsdp-verify "
                          "list' names them): bf16-fsdp = FSDP2 MixedPrecisionPolicy(param_dtype=bf16, "
                          "reduce_dtype=fp32), bf16-autocast = torch.autocast(bf16), both over float32 parameters "
                          "(default: fp32 only; docs/precision.md)")
    run.add_argument("--sampling", default=None, metavar="fixed,poisson",
                     help="comma list: how each step's batch is formed for every property on the sampling axis "
                          "(fixed given batches; poisson: DP-SGD's own sampling, make_private's default). "
                          "Default: each property's own (both for the DP-step properties)")
    run.add_argument("--seeding", default=None, metavar="same,per_rank,unseeded",
                     help="comma list of Poisson seeding policies: every rank seeds its sampler alike, "
                          "seed + rank, or not at all (default: each property's own)")
    run.add_argument("--sample-rate", type=float, default=None, metavar="Q",
                     help="Poisson sample rate q in (0, 1] (default 0.25)")
    run.add_argument("--dataset-size", type=int, default=None, metavar="N",
                     help="Poisson dataset size, all ranks together (default 8 x world size)")
    run.add_argument("--seed", type=int, default=None, metavar="S",
                     help="the run's statistical seed (noise and sampling draws); default: a fresh random seed, "
                          "printed at the start and in every repro line, so a failing run replays with --seed")
    run.add_argument("--fuzz", type=int, default=0, metavar="N",
                     help="also run N hypothesis-fuzzed examples per fuzzable property")
    run.add_argument("--expect", metavar="FILE|NAME",
                     help="known failures (TOML, see docs/gate.md): exit 0 when exactly these fail; a bundled name "
                          "such as opacus-1.6.0 also works")
    run.add_argument("--physical-batch-size", type=int, default=None, metavar="P",  # gradient accumulation
                     help="gradient accumulation: the properties with the option physical_batch_size compute their "
                          "steps in physical batches of at most P samples (the mode comparison's built-in pair: "
                          "unsplit vs P, default 2)")
    run.add_argument("--resume-at", type=int, default=None, metavar="K",  # checkpoint/resume
                     help="checkpoint/resume: the property with the option resume_at checkpoints its runs after K of their 4 steps and "
                          "resumes them in fresh rank processes (1..3; default 2)")
    run.add_argument("--json", metavar="PATH", help="write the JSON report here ('-': stdout)")
    run.add_argument("--junit", metavar="PATH", help="write JUnit XML here")
    run.add_argument("--markdown", metavar="PATH", help="write a markdown summary here (plot beside it if matplotlib)")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    replay = sub.add_parser("replay", help="re-run one fuzzed configuration (the repro line of a fuzz verdict)")
    _target_args(replay)
    replay.add_argument("--property", required=True, help="id of a property that can be fuzzed")
    replay.add_argument("--world-size", required=True, help="number of ranks")
    replay.add_argument("--spec", required=True, help="the JSON RunSpec of a fuzz verdict's repro line")
    sub.add_parser("list", help="list properties and targets")
    _scale_parser(sub)
    return p


def cmd_list() -> int:
    from ..properties import PROPERTIES

    print("properties (* can be fuzzed: --fuzz N, replay) and what each runs by default:")
    for pid, prop in PROPERTIES.items():
        print(f"  {pid + (' *' if prop.fuzz else ''):<20} {prop.meaning}")
        print(f"  {'':<20} models {','.join(prop.models)}; layouts {','.join(prop.layouts)}; reductions "
              f"{','.join(prop.reductions)}; dtypes {','.join(prop.dtypes)}"
              + (f"; precisions {','.join(prop.precisions)} (--precisions)" if len(prop.precisions) > 1 else ""))
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
    from .run import execute

    # like `python -m`: an adapter MODULE:ATTR may live in the current directory
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if args.launcher == "torchrun":
        from .torchrun import cmd_run_torchrun

        return cmd_run_torchrun(args)
    return execute(RunPlan.from_args(args))


def cmd_replay(args) -> int:
    """Re-run one fuzzed spec; prints its verdict; exit 1 if it fails."""
    require_hypothesis("replay")  # hypothesis is the optional [fuzz] extra: exit 2, not 3
    from ..fuzz import check_example, format_failure, fuzzable_property, spec_from_json
    from ..harness import Pool

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fuzzable_property(args.property)
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
    sc.add_argument("--steps", type=int, default=1000, help="nominal steps per rank, rounded up to epochs (default 1000)")
    sc.add_argument("--world-sizes", default="8,64,512,1024", help="comma list (default 8,64,512,1024)")
    sc.add_argument("--seed", type=int, default=0, help="sampling seed of the first epoch (default 0)")
    sc.add_argument("--json", default=None, metavar="PATH|-", help="write the figures as JSON (docs/scale.md)")
    sc.add_argument("--plot", default=None, metavar="PATH", help="risk vs world size, .png or .svg (extra 'plot')")


def cmd_scale(args) -> int:
    import json

    from .. import scale
    from ..targets import TargetLoadError, load_target

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib", "pip install 'dpfsdp-verify[plot]'") from None
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
    except Exception:  # a crash of dpfsdp-verify itself is exit 3, never mistaken for a verdict
        import traceback

        traceback.print_exc()
        print("dpfsdp-verify: internal error (a bug in dpfsdp-verify, not a verdict on the target)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())

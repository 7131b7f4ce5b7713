"""``dpfsdp-verify``: the CI gate for opacus forks.

    dpfsdp-verify run [--target opacus|MODULE:ATTR] [--grad-sample-mode ghost_fsdp]
        [--mode-env LABEL:VAR=VAL[,VAR=VAL]]... [--world-sizes 1,2] [--backend gloo|nccl]
        [--properties p1,p2] [--models mlp,transformer] [--loss-reductions mean,sum]
        [--timeout SECONDS] [--json PATH] [--junit PATH] [--markdown PATH]
    dpfsdp-verify list
    dpfsdp-verify --version

Exit codes: 0 every selected property passed; 1 at least one fail / hang / error; 2 usage or
configuration error (one line saying what is wrong and a hint; nothing is run).
Progress goes to stderr while it runs; the summary table to stdout at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List, Optional

from . import __version__
from .harness.backends import BACKENDS, NAMES as BACKEND_NAMES

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
#: gloo ranks are processes on this host: more than this is a mistake on a CI runner
MAX_GLOO_WORLD_SIZE = 16
DEFAULT_WORLD_SIZES = "1,2"
DEFAULT_MODELS = "mlp,transformer"
DEFAULT_REDUCTIONS = "mean,sum"


class UsageError(Exception):
    """A configuration mistake: reported as one line + hint, exit 2, nothing run."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse exits 2 too; keep our one-line format
        raise UsageError(message, f"see '{self.prog} --help'")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dpfsdp-verify", description="Correctness and deadlock gate for DP training under FSDP.")
    p.add_argument("--version", action="version", version=f"dpfsdp-verify {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    run = sub.add_parser("run", help="run the properties against a target and report verdicts")
    run.add_argument("--target", default="opacus",
                     help="'opacus' (the installed opacus, public API) or MODULE:ATTR of an adapter (default: opacus)")
    run.add_argument("--grad-sample-mode", default="ghost_fsdp",
                     help="grad_sample_mode passed to make_private (forks add e.g. ghost_fsdp_bk; default ghost_fsdp)")
    run.add_argument("--mode-env", action="append", default=[], metavar="LABEL:VAR=VAL[,VAR=VAL]",
                     help="run under this labelled environment; two or more add mode_equivalence checks "
                          "(e.g. immediate:OPACUS_USE_DEFERRED_NORM=0 deferred:OPACUS_USE_DEFERRED_NORM=1)")
    run.add_argument("--world-sizes", default=DEFAULT_WORLD_SIZES, help=f"comma list (default {DEFAULT_WORLD_SIZES})")
    run.add_argument("--backend", default="gloo", choices=BACKEND_NAMES,
                     help="; ".join(BACKENDS[n].description for n in BACKEND_NAMES) + " (default gloo)")
    run.add_argument("--properties", default=None, help="comma list of property ids (default: all)")
    run.add_argument("--models", default=DEFAULT_MODELS, help=f"comma list (default {DEFAULT_MODELS})")
    run.add_argument("--loss-reductions", default=DEFAULT_REDUCTIONS, help="comma list of mean,sum (default both)")
    run.add_argument("--timeout", type=float, default=60.0, help="deadline per distributed job, seconds (default 60)")
    run.add_argument("--fuzz", type=int, default=0, metavar="N",
                     help="also run N hypothesis-fuzzed examples per fuzzable property")
    run.add_argument("--json", metavar="PATH", help="write the JSON report here")
    run.add_argument("--junit", metavar="PATH", help="write JUnit XML here")
    run.add_argument("--markdown", metavar="PATH", help="write a markdown summary here (plot beside it if matplotlib)")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    sub.add_parser("list", help="list properties and targets")
    return p


def _csv(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_mode_envs(items: List[str]) -> Dict[str, Dict[str, str]]:
    """``["deferred:A=1,B=2"]`` -> ``{"deferred": {"A": "1", "B": "2"}}``; UsageError if malformed."""
    out: Dict[str, Dict[str, str]] = {}
    for item in items:
        label, sep, assigns = item.partition(":")
        if not sep or not label.strip():
            raise UsageError(f"--mode-env {item!r}: expected LABEL:VAR=VAL[,VAR=VAL]",
                             "e.g. --mode-env deferred:OPACUS_USE_DEFERRED_NORM=1")
        env = {}
        for a in _csv(assigns):
            var, eq, val = a.partition("=")
            if not eq or not var.strip():
                raise UsageError(f"--mode-env {item!r}: {a!r} is not VAR=VAL", "e.g. OPACUS_USE_DEFERRED_NORM=1")
            env[var.strip()] = val
        if label in out:
            raise UsageError(f"--mode-env label {label!r} given twice", "use one label per environment")
        out[label.strip()] = env
    return out


def validate(args) -> dict:
    """Turn argparse output into a checked run plan, or raise UsageError (nothing runs)."""
    from .harness import BackendUnavailable, check_backend
    from .models import MODEL_NAMES
    from .properties import PROPERTIES
    from .targets import TargetLoadError, target_info

    try:
        world_sizes = sorted({int(w) for w in _csv(args.world_sizes)})
    except ValueError:
        raise UsageError(f"--world-sizes {args.world_sizes!r}: not a comma list of integers",
                         "e.g. --world-sizes 1,2") from None
    if not world_sizes or world_sizes[0] < 1:
        raise UsageError(f"--world-sizes {args.world_sizes!r}: world sizes must be >= 1", "e.g. --world-sizes 1,2")
    if args.backend == "gloo" and world_sizes[-1] > MAX_GLOO_WORLD_SIZE:
        raise UsageError(f"--world-sizes: {world_sizes[-1]} gloo ranks is more than this gate runs on one host "
                         f"(max {MAX_GLOO_WORLD_SIZE})", "use torchrun + the pytest plugin for larger worlds")
    try:
        check_backend(args.backend, world_sizes[-1])
    except (BackendUnavailable, ValueError) as e:
        raise UsageError(f"--backend {args.backend}: {e}", "use --backend gloo on CPU runners") from None
    props = _csv(args.properties) if args.properties else list(PROPERTIES)
    unknown = [p for p in props if p not in PROPERTIES]
    if unknown:
        raise UsageError(f"unknown property {', '.join(unknown)}", f"choose from {', '.join(PROPERTIES)}")
    models = _csv(args.models)
    bad = [m for m in models if m not in MODEL_NAMES]
    if bad or not models:
        raise UsageError(f"unknown model {', '.join(bad) or '(none)'}", f"choose from {', '.join(MODEL_NAMES)}")
    reductions = _csv(args.loss_reductions)
    if not reductions or any(r not in ("mean", "sum") for r in reductions):
        raise UsageError(f"--loss-reductions {args.loss_reductions!r}: choose from mean,sum", "e.g. --loss-reductions mean")
    if args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout}: must be > 0 seconds", "e.g. --timeout 60")
    if args.fuzz < 0:
        raise UsageError(f"--fuzz {args.fuzz}: must be >= 0", "e.g. --fuzz 20")
    mode_envs = parse_mode_envs(args.mode_env)
    if "mode_equivalence" in props and args.properties and len(mode_envs) < 2:
        raise UsageError("mode_equivalence needs two or more --mode-env labels",
                         "e.g. --mode-env immediate:OPACUS_USE_DEFERRED_NORM=0 --mode-env deferred:OPACUS_USE_DEFERRED_NORM=1")
    try:
        info = target_info(args.target)
    except TargetLoadError as e:
        raise UsageError(f"--target {args.target}: {e}", "give 'opacus' or an importable MODULE:ATTR") from None
    for path in (args.json, args.junit, args.markdown):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise UsageError(f"cannot write report {path!r}: its directory does not exist", "create it first")
    return dict(target=args.target, target_info=info, grad_sample_mode=args.grad_sample_mode, mode_envs=mode_envs,
                world_sizes=world_sizes, backend=args.backend, properties=props, models=models,
                reductions=reductions, timeout=args.timeout, fuzz=args.fuzz)


def cmd_list() -> int:
    from .properties import PROPERTIES

    print("properties:")
    for pid, prop in PROPERTIES.items():
        print(f"  {pid:<18} {prop.meaning}")
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


class Progress:
    """``[3/14 12.4s] norm_fidelity ws=2 split mlp mean -> pass`` lines on stderr."""

    def __init__(self, quiet: bool):
        self.quiet, self.t0, self.done = quiet, time.monotonic(), 0

    def started(self, property_id: str) -> None:
        if not self.quiet:
            print(f"[{self.done} done {time.monotonic() - self.t0:6.1f}s] running {property_id} ...",
                  file=sys.stderr, flush=True)

    def __call__(self, verdict) -> None:
        from .report import config_label

        self.done += 1
        if self.quiet:
            return
        tail = f" ({verdict.diagnosis})" if verdict.diagnosis else ""
        print(f"[{self.done} done {time.monotonic() - self.t0:6.1f}s] {verdict.property} "
              f"{config_label(verdict.config)} -> {verdict.status}{tail}", file=sys.stderr, flush=True)


def cmd_run(args) -> int:
    from . import report
    from .gate import run_plan

    # like `python -m`: an adapter MODULE:ATTR may live in the current directory
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    plan = validate(args)
    progress = Progress(args.quiet)
    if not args.quiet:
        print(f"dpfsdp-verify {__version__}: target {plan['target_info']['name']} "
              f"{plan['target_info']['version']}, {plan['backend']}, world sizes {plan['world_sizes']}, "
              f"properties {', '.join(plan['properties'])}", file=sys.stderr, flush=True)
    verdicts = run_plan(plan, progress=progress)
    print(report.terminal_table(verdicts))
    for v in verdicts:
        if v.status in ("fail", "error", "hang"):
            print(f"\n{v.property} [{report.config_label(v.config)}] {v.status} ({v.diagnosis}): {v.message}"
                  + (f"\n  repro: {v.repro}" if v.repro else ""))
    if args.json:
        report.write_json(args.json, verdicts, plan["target_info"], plan["backend"])
    if args.junit:
        report.write_junit(args.junit, verdicts, plan["target_info"]["name"])
    if args.markdown:
        plot = os.path.splitext(args.markdown)[0] + "-norm-ratio.png"
        has_plot = report.plot_norm_ratios(verdicts, plot)
        with open(args.markdown, "w") as f:
            f.write(report.to_markdown(verdicts, plan["target_info"], os.path.basename(plot) if has_plot else None))
    s = report.summary(verdicts)
    return EXIT_FAIL if (s["fail"] or s["error"] or s["hang"]) else EXIT_OK


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "list":
            return cmd_list()
        if args.command == "run":
            return cmd_run(args)
        parser.print_help()
        return EXIT_USAGE
    except UsageError as e:
        print(f"dpfsdp-verify: error: {e}" + (f" (hint: {e.hint})" if e.hint else ""), file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

"""What a gate run checks before it starts and writes after it ends (``cli.cmd_run`` calls in here).

* ``describe_target`` / ``banner`` / ``VersionAction``: which opacus was imported (version and
  file), in the stderr banner, the JSON ``target``, the markdown page and ``--version``.
* ``finish(plan, verdicts, target)``: judges the verdicts against the plan's expectations, writes
  every report the plan asks for and returns the exit code (``exit_code``, the one place it is
  computed; the codes are ``EXIT_*`` below, stated once, in docs/gate.md, "Exit codes").
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from . import __version__

if TYPE_CHECKING:  # pragma: no cover
    from .plan import RunPlan

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


def _distribution_of(package: str) -> Optional[Dict[str, str]]:
    """``{"name", "version"}`` of the installed distribution that provides top-level ``package``."""
    from importlib import metadata

    try:
        names = metadata.packages_distributions().get(package) or []
    except Exception:  # pragma: no cover - broken metadata of an unrelated distribution
        names = []
    for name in names:
        try:
            return {"name": name, "version": metadata.version(name)}
        except metadata.PackageNotFoundError:  # pragma: no cover
            continue
    return None


def opacus_info(import_it: bool = False) -> Optional[Dict[str, Any]]:
    """The opacus this process has imported (or, with ``import_it``, would import): ``{"version",
    "path", "distribution"}``; ``None`` when it is not imported (and not importable). Without
    ``import_it`` an opacus that is importable but not imported is described from its files and
    metadata only (cheap: nothing is executed)."""
    mod = sys.modules.get("opacus")
    if mod is None and import_it:
        try:
            import opacus as mod  # noqa: F401
        except ImportError:
            return None
    if mod is not None:
        version = getattr(mod, "__version__", None)
        path = os.path.dirname(getattr(mod, "__file__", None) or "") or None
    else:
        try:
            spec = importlib.util.find_spec("opacus")
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return None
        locations = list(spec.submodule_search_locations or [])
        path = locations[0] if locations else spec.origin
        version = None
    dist = _distribution_of("opacus")
    return {"version": version or (dist or {}).get("version") or "unknown", "path": path,
            "distribution": f"{dist['name']} {dist['version']}" if dist else None}


def version_text() -> str:
    """``dpfsdp-verify --version``: this package, the opacus it would test, torch (nothing imported)."""
    from importlib import metadata

    lines = [f"dpfsdp-verify {__version__} ({os.path.dirname(os.path.abspath(__file__))})"]
    op = opacus_info()
    lines.append(f"opacus {op['version']} ({op['path']})" if op else
                 "opacus: not installed (pip install 'dpfsdp-verify[opacus]', or install your fork)")
    try:
        lines.append(f"torch {metadata.version('torch')}")
    except metadata.PackageNotFoundError:  # pragma: no cover
        lines.append("torch: not installed")
    return "\n".join(lines)


class VersionAction(argparse.Action):
    """``--version``: computed when asked for, so other commands pay nothing for it."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0,
                         help=help or "show dpfsdp-verify's version and the opacus and torch it would use")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit(0)


def describe_target(ref: str, info: Dict[str, Any]) -> Dict[str, Any]:
    """The JSON ``target``: ``name``, ``version``, ``ref`` (as given to --target) and ``opacus``
    (version, path, distribution of the opacus imported while loading it; null if none was)."""
    return {**info, "ref": ref, "opacus": opacus_info()}


def banner(target: Dict[str, Any], backend: str, world_sizes, properties) -> str:
    op = target.get("opacus")
    where = f" [opacus {op['version']} from {op['path']}]" if op else ""
    return (f"dpfsdp-verify {__version__}: target {target['name']} {target['version']}{where}, {backend}, "
            f"world sizes {list(world_sizes)}, properties {', '.join(properties)}")


def exit_code(verdicts, outcome=None) -> int:
    from .report import is_internal_error
    from .verdict import FAILING

    if any(is_internal_error(v) for v in verdicts):
        return EXIT_INTERNAL
    if outcome is not None:
        return EXIT_OK if outcome.holds else EXIT_FAIL
    return EXIT_FAIL if any(v.status in FAILING for v in verdicts) else EXIT_OK


def finish(plan: "RunPlan", verdicts: List, target: Dict[str, Any]) -> int:
    """Judge, print, write every requested report; the exit code. With ``--json -`` the JSON is
    the only thing on stdout (the table and messages go to stderr)."""
    from . import report
    from .expectations import apply
    from .verdict import FAILING

    expectations, reports = plan.expectations, plan.reports
    backend, seed = plan.options.backend, plan.options.seed
    outcome = apply(expectations, verdicts) if expectations is not None else None
    code = exit_code(verdicts, outcome)
    json_to_stdout = reports.json == "-"
    out = sys.stderr if json_to_stdout else sys.stdout
    print(report.terminal_table(verdicts, outcome), file=out)
    for v in verdicts:
        if v.status in FAILING and not (outcome is not None and outcome.is_expected(v)):
            print(f"\n{report.verdict_label(v)} {v.status} ({v.diagnosis}): {v.message}"
                  + (f"\n  repro: {v.repro}" if v.repro else ""), file=out)
            if report.is_internal_error(v):
                print("  this is a bug in dpfsdp-verify, not a verdict on the target; please report it with:\n"
                      + "\n".join("    " + line for line in (v.details or "").rstrip().splitlines()), file=out)
    skipped = [v for v in verdicts if v.status == "skip"]
    if skipped:  # a skip is never silent: it says which part of the selection made it inapplicable
        print("\nskipped:", file=out)
        for v in skipped:
            print(f"  {report.verdict_label(v)}: {v.message}", file=out)
    if outcome is not None:
        for e in outcome.entries:
            n = sum(1 for v in verdicts if outcome.entry_for(v) is e)
            if n:
                print(f"\nexpected ({n} verdict(s), xfail above): expectation {e.label()}: {e.describe_reason()}",
                      file=out)
        for u in outcome.unmet:
            print(f"\n{u.message}", file=out)
        if outcome.not_exercised:
            print(f"\n{len(outcome.not_exercised)} expectation(s) not exercised by this selection: "
                  + "; ".join(e.label() for e in outcome.not_exercised), file=out)
    if seed is not None:
        print(f"\nseed {seed}: 'dpfsdp-verify run ... --seed {seed}' replays this run's noise and sampling draws",
              file=out)
    if reports.json:
        if json_to_stdout:
            sys.stdout.write(report.dumps_json(verdicts, target, backend, outcome, code, seed))
            sys.stdout.flush()
        else:
            report.write_json(reports.json, verdicts, target, backend, outcome, code, seed)
    if reports.junit:
        report.write_junit(reports.junit, verdicts, target["name"], outcome)
    if reports.markdown:
        # a PNG for the CI artifacts, beside the page; the page does not link it (a step summary
        # cannot show a file from the runner's disk)
        report.plot_norm_ratios(verdicts, os.path.splitext(reports.markdown)[0] + "-norm-ratio.png")
        with open(reports.markdown, "w") as f:
            f.write(report.to_markdown(verdicts, target, outcome))
    return code

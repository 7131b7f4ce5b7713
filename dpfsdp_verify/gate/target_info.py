"""Which target and which opacus a gate run checks: ``describe_target`` / ``banner`` /
``VersionAction`` (version and file of the opacus imported), for the stderr banner, the JSON
``target``, the markdown page and ``--version``."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any, Dict, Optional

from .. import __version__


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
            import opacus as imported
            mod = imported
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

    lines = [f"dpfsdp-verify {__version__} ({os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})"]
    op = opacus_info()
    lines.append(f"opacus {op['version']} ({op['path']})" if op else
                 "opacus: not installed (pip install opacus after a CPU torch -- the 'opacus' extra -- or "
                 "install your fork)")
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


def banner(target: Dict[str, Any], backend: str, world_sizes, properties, meshes=()) -> str:
    op = target.get("opacus")
    meshes = f", meshes {', '.join(meshes)}" if meshes else ""
    where = f" [opacus {op['version']} from {op['path']}]" if op else ""
    return (f"dpfsdp-verify {__version__}: target {target['name']} {target['version']}{where}, {backend}, "
            f"world sizes {list(world_sizes)}{meshes}, properties {', '.join(properties)}")


__all__ = ["opacus_info", "version_text", "VersionAction", "describe_target", "banner"]

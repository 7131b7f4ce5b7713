"""Where a target crashed: the innermost frame of the code under test in a rank's traceback.

A rank whose job raised sends its traceback back as frames (``harness.frames``). Each frame is
told by origin -- ``target`` (the code under test: the installed opacus, which is where a fork
lives, or the adapter's own package), ``suite`` (dpfsdp_verify, the harness included),
``library`` (torch, the standard library, any other package) -- so that a verdict names the line of
the target that raised (``file:line in function``), not the harness's or torch's: a fork's bug is
one line in the fork, and its crash verdict should say which.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from ..harness.frames import Frame, is_harness_frame

SUITE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: innermost frames a verdict's evidence keeps
EVIDENCE_FRAMES = 40


def _package_dir(name: str) -> Optional[str]:
    """The directory of top-level package ``name`` (its file for a module), found without importing
    it; ``None`` when it cannot be found."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return os.path.abspath(list(spec.submodule_search_locations)[0]) + os.sep
    return os.path.abspath(spec.origin) if spec.origin and spec.origin != "built-in" else None


def target_roots(target_ref: str) -> List[str]:
    """Where the code under test lives for ``target_ref``: the installed opacus (a fork is installed
    as opacus) and, for an adapter ``package.module:Attr``, its top-level package -- never the suite."""
    names = ["opacus"]
    if ":" in target_ref:
        names.append(target_ref.split(":", 1)[0].split(".", 1)[0])
    roots = [_package_dir(n) for n in names]
    return [r for r in roots if r and not r.startswith(SUITE_DIR)]


def origin(file: str, roots: Sequence[str]) -> str:
    """``harness``, ``suite``, ``target`` or ``library`` (module doc) for a frame in ``file``."""
    path = os.path.abspath(file) if file and not file.startswith("<") else file
    if is_harness_frame(path):
        return "harness"
    if path.startswith(SUITE_DIR):
        return "suite"
    if any(path == r or path.startswith(r) for r in roots):
        return "target"
    return "library"


def short_path(file: str) -> str:
    """``file`` as a user finds it: relative to the working directory when under it, from the
    package's own directory when installed (``opacus/optimizers/optimizer.py``), else as given."""
    path = os.path.abspath(file) if file and not file.startswith("<") else file
    cwd = os.getcwd() + os.sep
    if path.startswith(cwd):
        return path[len(cwd):]
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


@dataclass
class CrashSite:
    """A rank's exception and where it was raised. ``at``: the innermost frame of the target
    (``file:line in function``), else the innermost frame outside the harness; ``in_target``:
    whether ``at`` is the target's own; ``frames``: every frame with its origin, innermost last."""

    rank: int
    exception: str
    at: str = ""
    in_target: bool = False
    frames: List[Dict[str, Any]] = field(default_factory=list)

    def evidence(self) -> Dict[str, Any]:
        """The verdict's ``evidence["crash"]``: the traceback keeps the harness's frames too."""
        return {"rank": self.rank, "exception": self.exception, "at": self.at, "in_target": self.in_target,
                "traceback": self.frames[-EVIDENCE_FRAMES:]}

    def phrase(self) -> str:
        """Where, in words: ``at fork/x.py:12 in wrap`` (or, when no frame is the target's, where
        it was raised and that no frame of the target's is in the traceback)."""
        if not self.at:
            return ""
        return f"at {self.at}" if self.in_target else f"at {self.at} (no frame of the target's own in the traceback)"


def locate(rank: int, exc_type: str, message: str, frames: Sequence[Frame], target_ref: str) -> CrashSite:
    """The ``CrashSite`` of rank ``rank``'s exception ``exc_type: message`` raised through ``frames``
    (innermost last) in a job of target ``target_ref``."""
    roots = target_roots(target_ref)
    marked = [{"file": short_path(f), "line": n, "function": fn, "source": src, "origin": origin(f, roots)}
              for f, n, fn, src in frames]
    first_line = (message.strip().splitlines() or [""])[0]
    site = CrashSite(rank, f"{exc_type}: {first_line}" if first_line else exc_type, frames=marked)
    own = [m for m in marked if m["origin"] == "target"]
    outside = [m for m in marked if m["origin"] != "harness"]
    pick = own[-1] if own else (outside[-1] if outside else None)
    if pick is not None:
        site.at, site.in_target = f"{pick['file']}:{pick['line']} in {pick['function']}", bool(own)
    return site


__all__ = ["SUITE_DIR", "EVIDENCE_FRAMES", "target_roots", "origin", "short_path", "CrashSite", "locate"]

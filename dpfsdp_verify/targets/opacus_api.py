"""The opacus API the built-in adapter (``opacus_target``) drives, checked before a run.

A fork based on opacus 1.5.x may lack the FSDP path upstream 1.6.0 added. Without this check every
training case would crash on the same missing import -- a wall of identical ``rank_crash``
verdicts; with it, ``--target opacus`` answers in one line which API the adapter needs and which
of it the installed opacus lacks (``missing``), and the run does not start.
"""

from __future__ import annotations

import importlib
from typing import List, Tuple

#: ``(module, name)`` the adapter uses, with what it uses it for
REQUIRED: Tuple[Tuple[str, str, str], ...] = (
    ("opacus", "PrivacyEngine", "make_private"),
    ("opacus.utils.fsdp_utils", "FSDP2Wrapper", "FSDP2 wrapping"),
    ("opacus.grad_sample", "GradSampleModuleFastGradientClippingFSDP", "grad_sample_mode='ghost_fsdp'"),
    ("opacus.optimizers", "FSDPOptimizerFastGradientClipping", "the ghost_fsdp optimizer"),
    ("opacus.data_loader", "DPDataLoader", "Poisson sampling"),
)


def missing() -> List[str]:
    """``module.Name (what for)`` of every ``REQUIRED`` name the importable opacus lacks."""
    out = []
    for module, name, what in REQUIRED:
        try:
            ok = hasattr(importlib.import_module(module), name)
        except ImportError:
            ok = False
        if not ok:
            out.append(f"{module}.{name} ({what})")
    return out


def problem(version: str) -> str:
    """One line saying which API the adapter needs and which is missing ("" when none is)."""
    lacking = missing()
    if not lacking:
        return ""
    return (f"the installed opacus {version} lacks the API the opacus adapter drives: {', '.join(lacking)} "
            "(it needs opacus >= 1.6.0's FSDP path: FSDP2Wrapper + make_private(grad_sample_mode='ghost_fsdp'); "
            "merge it into the fork, or write an adapter for the fork's own API: docs/adapters.md)")


__all__ = ["REQUIRED", "missing", "problem"]

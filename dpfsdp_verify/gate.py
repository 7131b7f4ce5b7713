"""Run a checked plan (from ``cli.validate``) property by property on one warm pool.

Kept apart from ``cli.py`` so that the CLI only parses, validates and reports; and so that tests
and the benchmark can run a plan without a subprocess.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Callable, List, Optional

from .harness import Pool
from .properties import PROPERTIES
from .verdict import Verdict

#: upper bound on warm worker groups kept by one gate run
MAX_WARM_GROUPS = 6
#: properties that hypothesis can fuzz (``--fuzz N``)
FUZZABLE = ("norm_fidelity", "clipped_step", "mode_equivalence")


def _config(plan: dict, **extra) -> dict:
    cfg = {"world_size": None, "data_layout": None, "model": None, "mode": "default",
           "grad_sample_mode": plan["grad_sample_mode"]}
    cfg.update(extra)
    return cfg


def run_plan(plan: dict, progress: Optional[Callable[[Verdict], None]] = None,
             pool: Optional[Pool] = None) -> List[Verdict]:
    """Every selected property's verdicts, in plan order. Never raises for a target's failure:
    a property that cannot run becomes an ``error`` verdict saying why."""
    own_pool = pool is None
    # one warm group per (world size, mode) so no property restarts ranks another one just used
    # (a restart costs seconds); idle ranks only cost memory
    pool = pool or Pool(max_groups=min(MAX_WARM_GROUPS, len(plan["world_sizes"]) * max(1, len(plan["mode_envs"]))))
    verdicts: List[Verdict] = []

    def emit(vs: List[Verdict]) -> None:
        for v in vs:
            verdicts.append(v)
            if progress:
                progress(v)

    modes = plan["mode_envs"] or None
    try:
        for pid in plan["properties"]:
            if pid == "mode_equivalence" and len(plan["mode_envs"]) < 2:
                emit([Verdict(pid, "skip", _config(plan), message="mode_equivalence needs two or more --mode-env "
                              "labels (e.g. immediate:OPACUS_USE_DEFERRED_NORM=0 deferred:OPACUS_USE_DEFERRED_NORM=1)")])
                continue
            t0 = time.monotonic()
            if progress and hasattr(progress, "started"):
                progress.started(pid)
            try:
                emit(PROPERTIES[pid](plan["target"], pool=pool, world_sizes=tuple(plan["world_sizes"]), modes=modes,
                                     grad_sample_mode=plan["grad_sample_mode"], models=list(plan["models"]),
                                     reductions=list(plan["reductions"]), backend=plan["backend"],
                                     timeout=plan["timeout"]))
            except Exception as e:  # a bug in a check or an unloadable target: report, go on
                emit([Verdict(pid, "error", _config(plan), diagnosis=None,
                              message=f"{pid} could not run: {type(e).__name__}: {e}",
                              details=traceback.format_exc(), seconds=time.monotonic() - t0)])
            if plan.get("fuzz") and pid in FUZZABLE:
                emit(_fuzz(pid, plan, pool, modes))
    finally:
        if own_pool:
            pool.close()
    return verdicts


def _fuzz(pid: str, plan: dict, pool: Pool, modes) -> List[Verdict]:
    try:
        from .fuzz import fuzz_property
    except ImportError as e:  # pragma: no cover - fuzz module missing
        return [Verdict(pid, "error", _config(plan), message=f"--fuzz unavailable: {e}")]
    if pid == "mode_equivalence" and (not modes or len(modes) < 2):
        return []
    try:
        return fuzz_property(pid, plan["target"], plan["fuzz"], pool=pool, world_sizes=tuple(plan["world_sizes"]),
                             grad_sample_mode=plan["grad_sample_mode"], modes=modes, timeout=plan["timeout"], seed=0)
    except Exception as e:
        print(traceback.format_exc(), file=sys.stderr)
        return [Verdict(pid, "error", _config(plan), message=f"fuzzing {pid} failed: {type(e).__name__}: {e}")]

"""Run a checked ``RunPlan`` (``plan.py``) property by property on one warm pool.

Kept apart from ``cli.py`` so that the CLI only parses, validates and reports; and so that tests
and the benchmark can run a plan without a subprocess.
"""

from __future__ import annotations

import time
import traceback
from typing import Callable, List, Optional

from ..harness import Pool
from .plan import RunPlan
from ..properties import PROPERTIES, modes_problem
from ..properties.runner import run_property
from ..verdict import Verdict

#: upper bound on warm worker groups kept by one gate run
MAX_WARM_GROUPS = 6


def _config(plan: RunPlan) -> dict:
    return {"world_size": None, "data_layout": None, "model": None, "mode": "default",
            "grad_sample_mode": plan.options.grad_sample_mode}


def run_plan(plan: RunPlan, progress: Optional[Callable[[Verdict], None]] = None,
             pool: Optional[Pool] = None) -> List[Verdict]:
    """Every selected property's verdicts, in plan order. Never raises for a target's failure:
    a property that cannot run becomes an ``error`` verdict saying why."""
    own_pool = pool is None
    # one warm group per (world size, mode) so no property restarts ranks another one just used
    # (a restart costs seconds); idle ranks only cost memory
    opts = plan.options
    pool = pool or Pool(max_groups=min(MAX_WARM_GROUPS, len(opts.world_sizes) * len(opts.modes)))
    verdicts: List[Verdict] = []

    def emit(vs: List[Verdict]) -> None:
        for v in vs:
            verdicts.append(v)
            if progress:
                progress(v)

    def guarded(what: str, pid: str, fn: Callable[[], List[Verdict]]) -> List[Verdict]:
        t0 = time.monotonic()
        try:
            return fn()
        except Exception as e:  # a bug in a check or an unloadable target: report, go on
            return [Verdict(pid, "error", _config(plan), diagnosis="internal_error",  # exit 3
                            message=f"{what} {pid} failed: {type(e).__name__}: {e}",
                            details=traceback.format_exc(), seconds=round(time.monotonic() - t0, 3))]

    try:
        for pid in plan.properties:
            prop = PROPERTIES[pid]
            if progress and hasattr(progress, "started"):
                progress.started(pid)
            emit(guarded("running", pid, lambda: run_property(prop, opts, pool)))
            if plan.fuzz and prop.fuzz is not None and not modes_problem(prop, opts.modes):
                emit(guarded("fuzzing", pid, lambda: _fuzz(pid, plan, pool)))
    finally:
        if own_pool:
            pool.close()
    return verdicts


def _fuzz(pid: str, plan: RunPlan, pool: Pool) -> List[Verdict]:
    from ..fuzz import fuzz_options

    return fuzz_options(pid, PROPERTIES[pid].with_defaults(plan.options), plan.fuzz, pool=pool)

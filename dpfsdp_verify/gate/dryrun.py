"""``dpfsdp-verify run --dry-run``: check the options and print the plan, start nothing.

The same ``RunPlan.from_args`` as a real run (so a usage error is the same exit 2, one line), then
each property's own ``plan`` -- the cases it would run and the ``skip`` verdicts it would give,
with their reasons -- summed up per property and world size (or mesh), the backend and the GPUs
it needs, and an estimate of the wall time from the benchmarks. No rank is started and
``--target opacus`` is not imported (checked importable, described from its files). Nor is torch,
for a gloo plan: the property registry imports it lazily (``dpfsdp_verify.lazy``), and what a plan
derives from the float64 reference -- clip bounds picked between reference norms, the parameters'
shapes behind a noise check's draw count -- is left to the run (``Options.planning``, set on the
plan's options here: the cases read it and hand it to ``compare.norm_picked``): the cases printed
are those a run plans, only their C is not known yet (tests/gate/test_gate_platform.py compares
the two plans). What still imports torch: ``--backend nccl`` (the
GPU count is part of the plan) and a ``--target MODULE:ATTR`` adapter (loaded to read its features).

The estimate: each property's seconds in the default gate on 2 idle cores (docs/benchmarks.md,
"Time against cores", ``python benchmarks/cores.py``), shared out equally among the cases that
property runs in the default gate, times ``max(1, ranks / 2)`` for a case at more ranks than 2 cores
hold; a rough figure (within ~50% on this repository's 2-core machine; more cores, fewer seconds;
a loaded machine, more).
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from .plan import RunPlan

#: seconds one explored draw takes in the dry run's estimate (2 idle cores: docs/explore.md)
EXPLORE_DRAW_S = 1.5


@dataclass
class PropertyPlan:
    property: str
    #: cases to run per world size label (``"ws=2"``, ``"hsdp:2x2"``)
    cases: Counter = field(default_factory=Counter)
    #: ``(config label, reason)`` of each ``skip`` verdict the plan gives without running
    skips: List[Tuple[str, str]] = field(default_factory=list)
    #: the most ranks one of its cases needs
    max_ranks: int = 0
    seconds: float = 0.0


@dataclass
class Described:
    properties: List[PropertyPlan]
    backend: str
    gpus_needed: int
    gpus_visible: Optional[int]
    seconds: float
    fuzz: int = 0
    #: the plan's first line (target, backend, world sizes, meshes, long runs, expectations)
    header: str = ""
    #: the explored draws' line and their seconds in the estimate (``None``: no exploration)
    explore_line: Optional[str] = None
    explore_s: float = 0.0

    @property
    def n_cases(self) -> int:
        return sum(sum(p.cases.values()) for p in self.properties)

    @property
    def n_skips(self) -> int:
        return sum(len(p.skips) for p in self.properties)


def _items(pid: str, options) -> list:
    from ..properties import PROPERTIES

    prop = PROPERTIES[pid]
    return prop.plan(prop.with_defaults(options))


def describe(plan: RunPlan, planning: bool = True) -> Described:
    """What ``plan`` would run, per property (module docstring); ``planning``: without the values a
    run derives from the reference (``Options.planning``; ``False`` plans every case as a run does)."""
    from ..properties.engine.contract import Case
    from ..properties.engine.costs import seconds_per_case
    from ..verdict import config_label

    header, (explore_line, explore_s) = _header(plan), _explore(plan)
    opts = plan.options.with_(planning=planning)  # the clip bounds picked from reference norms: left to the run
    out = []
    for pid in plan.properties:
        pp = PropertyPlan(pid)
        items = _items(pid, opts)
        per_case = seconds_per_case(pid)
        for item in items:
            if isinstance(item, Case):
                where = item.spec.mesh or f"ws={item.world_size}"
                pp.cases[where] += 1
                pp.max_ranks = max(pp.max_ranks, item.world_size)
                pp.seconds += per_case * max(1.0, item.world_size / 2)
            else:
                pp.skips.append((config_label(item.config), item.message))
        out.append(pp)
    ranks = max((p.max_ranks for p in out), default=0)
    gpus_visible = None
    if opts.backend != "gloo":
        from ..harness.backends import visible_gpus

        gpus_visible = visible_gpus()
    return Described(out, opts.backend, ranks if opts.backend == "nccl" else 0, gpus_visible,
                     sum(p.seconds for p in out), plan.fuzz, header, explore_line, explore_s)


def format_plan(d: Described) -> str:
    """The dry run's text of ``d`` (``describe``'s)."""
    lines = [d.header]
    if d.backend == "nccl":
        lines.append(f"GPUs needed: {d.gpus_needed} (one per rank; {d.gpus_visible} visible)")
    else:
        lines.append(f"GPUs needed: 0 ({d.backend} ranks compute on the CPU; at most "
                     f"{max((p.max_ranks for p in d.properties), default=0)} ranks at once)")
    width = max([len(p.property) for p in d.properties] + [8])
    lines.append(f"{'property':<{width}}  cases  skipped  est.   where")
    for p in d.properties:
        where = ", ".join(f"{k}: {n}" for k, n in sorted(p.cases.items()))
        lines.append(f"{p.property:<{width}}  {sum(p.cases.values()):>5}  {len(p.skips):>7}  {p.seconds:>4.0f}s  "
                     f"{where or '-'}")
    if d.n_skips:
        lines.append(f"skipped without running ({d.n_skips}):")
        for p in d.properties:
            for label, reason in p.skips:
                lines.append(f"  {p.property} {label}: {reason}")
    if d.fuzz:
        lines.append(f"plus {d.fuzz} fuzzed examples per fuzzable property (not in the estimate)")
    if d.explore_line is not None:
        lines.append(d.explore_line)
    lines.append(f"total: {d.n_cases + d.n_skips} verdicts, {d.n_cases} cases to run, {d.n_skips} skipped; "
                 f"estimated {_duration(d.seconds + d.explore_s)} on 2 idle cores (docs/benchmarks.md; rough)")
    return "\n".join(lines)


def _header(plan: RunPlan) -> str:
    o = plan.options
    info = plan.info
    sizes = ",".join(map(str, o.world_sizes)) or "none (meshes only)"
    return (f"dry run: nothing started. target {o.target} ({info.get('name')} {info.get('version')}), "
            f"backend {o.backend}, world sizes {sizes}"
            + (f", wide world size {o.wide_world_size}" if o.wide_world_size else "")
            + (f", meshes {','.join(o.meshes)}" if o.meshes else "")
            + (f", long runs of {o.horizon} steps" if o.horizon and max(o.world_sizes, default=0) >= 2 else "")
            + (f", --expect {plan.expectations.file}" if plan.expectations is not None else ""))


def _explore(plan: RunPlan) -> Tuple[Optional[str], float]:
    """The explored draws' line and estimated seconds (``(None, 0.0)`` without exploration)."""
    from ..properties import PROPERTIES

    draws = int(getattr(plan, "explore", 0))
    explored = sum(1 for p in getattr(plan, "properties", ()) if p in PROPERTIES and PROPERTIES[p].explore is not None)
    explore = min(draws * explored * EXPLORE_DRAW_S, float(getattr(plan, "explore_cap", 0.0) or math.inf))
    if draws > 0 and explored:
        return (f"plus {draws} configuration(s) per explored property ({explored}) drawn beyond the fixed cases "
                f"(--explore; docs/explore.md; ~{EXPLORE_DRAW_S:g} s each in the estimate)"), explore
    return None, explore


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def dry_run(plan: RunPlan) -> int:
    """``run --dry-run``: ``plan`` (checked without loading the target: ``RunPlan.from_args(...,
    load_target=False)``; a usage error was its ``UsageError``, exit 2) on stdout, exit 0."""
    from .report import EXIT_OK

    print(format_plan(describe(plan)), file=sys.stdout, flush=True)
    return EXIT_OK


__all__ = ["Described", "PropertyPlan", "describe", "dry_run", "format_plan"]

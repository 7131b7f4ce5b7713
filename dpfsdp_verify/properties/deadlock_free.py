"""deadlock_free: every run finishes under the watchdog, including uneven, single-sample and empty
local batches.

DP meaning: none directly -- but a DP job that hangs on some batch compositions is one that users
work around by changing sampling (dropping Poisson sampling, padding batches), which silently
changes the privacy accounting. Poisson sampling makes uneven and empty local batches normal.

Scenarios (each its own job, so a hang is attributed to it), two steps each, noise on:
``even`` (the plain split), ``uneven`` (rank 0 gets more samples than the last rank), ``single``
(one sample per rank), ``empty`` (the last rank gets none). Any hang is ``hang``/``deadlock``
with the harness's account of where the collective sequences diverge; a crash is
``error``/``rank_crash``; a rank that returns early (fewer steps than asked) fails ``mismatch``.
Nothing a target cannot do is skipped: a target that crashes on an empty local batch gets that
as its verdict (a user who accepts it says so explicitly).
"""

from __future__ import annotations

from typing import Dict

from ..verdict import Verdict
from .contract import Case, Outputs, Point, Property

STEPS = 2


def scenarios(ws: int) -> Dict[str, tuple]:
    """``{name: split}`` where ``split[r]`` lists rank r's global indices (same split every step)."""
    b = 2 * ws
    out = {"even": tuple(tuple(range(r, b, ws)) for r in range(ws)), "single": tuple((r,) for r in range(ws))}
    if ws > 1:
        uneven = [[] for _ in range(ws)]
        for i in range(b):  # rank 0 gets one extra, the last rank one fewer
            uneven[0 if i == b - 1 else i % ws].append(i)
        out["uneven"] = tuple(tuple(u) for u in uneven)
        empty = [list(range(r, b, ws - 1)) for r in range(ws - 1)] + [[]]
        out["empty"] = tuple(tuple(e) for e in empty)
    return out


def cases(point: Point):
    """One case per scenario, each its own job so that a hang is pinned on the scenario."""
    only = point.param("local_batches")
    for name, split in scenarios(point.world_size).items():
        if only is not None and name not in only:
            continue
        sizes = [len(s) for s in split]
        spec = point.spec(steps=STEPS, global_batch_size=2 * point.world_size, noise_multiplier=1.0,
                          rank_batches=(split,) * STEPS)
        yield point.case(spec, labels={"local_batches": name}, facts={"local_batch_sizes": sizes},
                         doing=f"{name} local batches {sizes}", isolate=True)


def judge(case: Case, runs: Outputs) -> Verdict:
    return case.verdict("pass", None, f"{STEPS} steps with {case.labels['local_batches']} local batches "
                        f"{case.facts['local_batch_sizes']} finished on all {case.world_size} rank(s)")


PROPERTY = Property(
    id="deadlock_free",
    meaning=("every run finishes, whatever the local batch sizes (uneven, one sample, empty): a job that "
             "hangs on some batches pushes users to sampling that breaks the privacy accounting"),
    cases=cases, judge=judge, models=("mlp",), layouts=("split",), reductions=("mean",),
    params=(("local_batches", None),))

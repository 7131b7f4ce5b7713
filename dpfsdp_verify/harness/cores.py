"""How a run shares the machine's cores among its ranks: ``plan_cores``, one pure function.

More cores must never mean slower. Every rank is a process with torch's intra-op thread pool; N
ranks each spawning one thread per core oversubscribe the machine (measured ~5x slower per rank on
2 cores, as torchrun warns), and a 16-core box ran the gloo gate in 116 s against ~50 s on 2 cores.
So the cores the process may actually use (``usable_cores``: its CPU affinity, a container's or
``taskset``'s limit, not the machine's count) are shared out among the ranks that run at once:

* how many rank groups run at once: the caller's group and, with two cores or more, one *side
  lane* beside it (``Pool.side_lane``: the gate's 1-rank jobs beside its larger groups); on one core
  a group at a time (a second lane would only share that core);
* each rank's intra-op threads: the cores left once the gate's own process has one (it plans and
  judges while the ranks run), divided by the most ranks at once (the largest group plus a 1-rank
  side job), at least 1 and at most ``MAX_RANK_THREADS`` (the suite's models are tiny: torch runs an
  op below its grain size on one thread whatever the pool, so more threads only add their wake-ups).

So ranks x threads <= cores wherever the largest group fits on the cores at all. A user's own
``OMP_NUM_THREADS`` wins (``launch.rank_threads``), as a mode's environment does. On 2 cores the plan is
one thread per rank and one side lane: what the harness did before the plan existed.
"""

from __future__ import annotations

import os
from typing import Iterable, NamedTuple

#: the most intra-op threads a rank gets however many cores there are (module docstring)
MAX_RANK_THREADS = 4


class CorePlan(NamedTuple):
    """How ``cores`` are shared (module docstring)."""

    #: the cores the process may use
    cores: int
    #: rank groups at once: 1 (one at a time) or 2 (the caller's and a side lane's)
    groups_at_once: int
    #: torch intra-op threads per rank (set in the rank unless the user gave ``OMP_NUM_THREADS``)
    rank_threads: int
    #: the most ranks running at once under the plan (the largest group, plus 1 with a side lane)
    ranks_at_once: int

    @property
    def side_lane(self) -> bool:
        """Whether jobs may run on a side lane beside the caller's (``Pool.side_lane``)."""
        return self.groups_at_once > 1


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (``os.sched_getaffinity``), else
    ``os.cpu_count()``, else 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def plan_cores(cores: int, world_sizes: Iterable[int]) -> CorePlan:
    """The plan for a run whose groups have ``world_sizes`` ranks on ``cores`` cores (module
    docstring)."""
    cores = max(1, int(cores))
    largest = max([int(w) for w in world_sizes] + [1])
    groups = 2 if cores >= 2 else 1
    ranks = largest + (1 if groups > 1 else 0)
    threads = min(MAX_RANK_THREADS, max(1, (cores - 1) // ranks))
    return CorePlan(cores, groups, threads, ranks)


__all__ = ["CorePlan", "MAX_RANK_THREADS", "plan_cores", "usable_cores"]

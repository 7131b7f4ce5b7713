"""CPU seconds the benchmark scripts measure beside wall time (``run.py``, ``cores.py``)."""

from __future__ import annotations

import resource


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's waited-for children (a gate subprocess and every
    rank it started): steadier than wall time on a shared machine."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime

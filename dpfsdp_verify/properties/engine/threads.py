"""Torch on one thread in this process while it computes references and statistics, as the ranks run
(the harness starts them with ``OMP_NUM_THREADS=1``): threads per core on 2 shared cores slowed an
example ~3-5x, measured; a switch and back costs ~0.35 ms.

Torch's thread count is the process's, not a thread's: the gate judges in one thread while another
runs jobs, and explores two properties at once (``gate/pipeline.py``, ``gate/run.py``), so the
switch is counted -- the first ``one_thread`` in sets one thread, the last one out restores what
was there before.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

_LOCK = threading.Lock()
_DEPTH = 0
_BEFORE: Optional[int] = None


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread within it (module docstring)."""
    global _DEPTH, _BEFORE
    import torch

    with _LOCK:
        if _DEPTH == 0:
            _BEFORE = torch.get_num_threads()
            torch.set_num_threads(1)
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0 and _BEFORE is not None:
                torch.set_num_threads(_BEFORE)


__all__ = ["one_thread"]

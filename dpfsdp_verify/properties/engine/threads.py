"""Torch on one thread in this process while it computes references and statistics, as the ranks run
(the harness starts them with ``OMP_NUM_THREADS=1``): threads per core on 2 shared cores slowed an
example ~3-5x, measured; a switch and back costs ~0.35 ms.

Torch's intra-op thread count is the calling thread's (OpenMP's setting is per thread: measured,
torch 2.13): the gate's judge thread (``gate/scheduler.py``) switches its own, and the thread that
runs the jobs keeps its own.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread in the calling thread within it (module docstring)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


__all__ = ["one_thread"]

"""A job's traceback as data: the frames a rank sends back with an error (``protocol.JobError``),
and which of them are the harness's own.

A frame is ``(file, line, function, source)``, innermost last. The harness frames -- the rank's
job loop (``rank.py``), the zygote that forked it, ``runpy`` and ``multiprocessing``'s plumbing --
say nothing about the code under test: what a user reads leaves them out (``user_frames``); the
JSON report keeps every frame. Knows nothing of targets: which frames are the target's is the
caller's business (``targets.crash_site``).
"""

from __future__ import annotations

import os
import traceback
from typing import List, Sequence, Tuple

#: ``(file, line, function, source line)``
Frame = Tuple[str, int, str, str]

HARNESS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: standard-library modules whose frames only carry a rank to its job
PLUMBING = tuple(os.sep + name for name in ("runpy.py", "threading.py", os.path.join("multiprocessing", ""))) + (
    "<frozen runpy>",)


def frames_of(tb) -> List[Frame]:
    """The frames of traceback ``tb``, innermost last."""
    return [(fs.filename, fs.lineno or 0, fs.name, (fs.line or "").strip()) for fs in traceback.extract_tb(tb)]


def is_harness_frame(file: str) -> bool:
    """Whether a frame in ``file`` is the harness's own plumbing (rank loop, zygote, runpy...)."""
    path = os.path.abspath(file) if file and not file.startswith("<") else file
    return path.startswith(HARNESS_DIR) or any(p in path for p in PLUMBING)


def user_frames(frames: Sequence[Frame]) -> List[Frame]:
    """``frames`` without the harness's (``is_harness_frame``)."""
    return [f for f in frames if not is_harness_frame(f[0])]


def format_frames(frames: Sequence[Frame]) -> str:
    """Frames as Python prints a traceback's body (``File "...", line N, in f`` + the source)."""
    return "".join(f'  File "{f}", line {n}, in {fn}\n' + (f"    {src}\n" if src else "") for f, n, fn, src in frames)


__all__ = ["Frame", "HARNESS_DIR", "PLUMBING", "frames_of", "is_harness_frame", "user_frames", "format_frames"]

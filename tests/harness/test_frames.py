"""What a user reads of a rank's stack: the harness's own frames (rank loop, zygote, runpy) and its
diagnosis thread are left out of a hang's report; ``full=True`` keeps them."""

from __future__ import annotations

import os

from dpfsdp_verify.harness.diagnose import DIAGNOSIS_THREAD, format_stacks
from dpfsdp_verify.harness.frames import HARNESS_DIR, is_harness_frame
from dpfsdp_verify.harness.protocol import RankDump


def _entry(file, line, fn, src=""):
    return f'  File "{file}", line {line}, in {fn}\n' + (f"    {src}\n" if src else "")


def test_a_hang_report_leaves_the_harness_frames_out():
    main = [_entry("<frozen runpy>", 198, "_run_module_as_main"),
            _entry(os.path.join(HARNESS_DIR, "zygote.py"), 40, "serve"),
            _entry(os.path.join(HARNESS_DIR, "rank.py"), 305, "_run_job", "value = fn(*args, **kwargs)"),
            _entry("/src/fork/optimizer.py", 12, "step", "dist.barrier()")]
    dump = RankDump(rank=0, pid=1, stacks={"MainThread": main, DIAGNOSIS_THREAD: [_entry(
        os.path.join(HARNESS_DIR, "rank.py"), 190, "_serve_dumps")]})
    text = format_stacks({0: dump})
    assert "fork/optimizer.py" in text and "(3 harness frame(s) left out)" in text
    assert "rank.py" not in text and "runpy" not in text and DIAGNOSIS_THREAD not in text
    full = format_stacks({0: dump}, full=True)
    assert "rank.py" in full and "runpy" in full and DIAGNOSIS_THREAD in full
    assert is_harness_frame("/usr/lib/python3.11/multiprocessing/connection.py")
    assert not is_harness_frame("/src/fork/optimizer.py")

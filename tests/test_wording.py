"""The harness's verdict sentences (``harness/wording.py``) read on plain data, without a rank:
what ``WorkerGroup`` words for a crash, an error, an error with ranks left waiting and a proven
deadlock. The end-to-end checks that a real group says them are in test_harness.py."""

from dpfsdp_verify.harness import wording
from dpfsdp_verify.harness.protocol import JobError, RankDump


def test_exit_text_names_code_signal_or_running():
    assert wording.exit_text(None) == "still running"
    assert wording.exit_text(3) == "exit code 3"
    assert wording.exit_text(-9) == "killed by SIGKILL"
    assert wording.exit_text(-200) == "killed by signal 200"


def test_crash_names_each_dead_rank_and_the_ended_survivors():
    assert wording.crashed({1: -9, 0: 7}, [2]) == ("rank 0 died (exit code 7); rank 1 died (killed by SIGKILL); "
                                                   "rank(s) [2] were still running and were ended")
    assert wording.crashed({0: 1}, []) == "rank 0 died (exit code 1)"


def test_raised_names_the_first_rank_and_keeps_every_traceback():
    errors = {2: JobError("KeyError", "'b'", "tb2"), 1: JobError("ValueError", "bad", "tb1")}
    message, details = wording.raised(errors)
    assert message == "rank 1 raised ValueError: bad (ranks [1, 2] all raised)"
    assert details == "--- rank 1 traceback ---\ntb1\n--- rank 2 traceback ---\ntb2"
    assert wording.raised({0: JobError("E", "m", "t")})[0] == "rank 0 raised E: m"
    assert wording.left_waiting([1], 1.0) == "; rank(s) [1] were left waiting (ended after 1.0 s grace)"


def _dump(rank, frames, seq_ops):
    entries = [{"collective_seq_id": s, "profiling_name": op, "input_sizes": [[4]], "process_group": ["0", "default"],
                "record_id": s} for s, op in seq_ops]
    return RankDump(rank=rank, pid=100 + rank, stacks={"MainThread": ["  frame\n"]}, main_frames=frames,
                    flight_recorder={"entries": entries})


def test_deadlock_says_the_proof_the_divergence_and_the_call_sites():
    dumps = {0: _dump(0, [("/src/train.py", 12, "step")], [(0, "gloo:all_reduce"), (1, "gloo:all_reduce")]),
             1: _dump(1, [("/src/train.py", 30, "skip")], [(0, "gloo:all_reduce")])}
    message, head = wording.deadlock(dumps, [0], "rank 1 finished the job", after=2.25, timeout=60.0)
    assert message.startswith("deadlock proven after 2.2 s, before the 60 s deadline: rank(s) [0] can never finish "
                               "(rank 1 finished the job); collective #1 (gloo:all_reduce [[4]]) was issued by "
                               "rank(s) 0 but never by rank 1 (last issued #0)")
    assert message.endswith("(rank 0 at /src/train.py:12 in step)")
    assert head == "deadlock proven after 2.2 s: rank 1 finished the job.\n"
    details = wording.hang_details(head, "analyser says", dumps)
    assert "--- torch flight_recorder analyser (fr_trace) ---\nanalyser says" in details
    assert "--- rank 1 (pid 101), thread MainThread ---" in details
    assert wording.hang_details("r", None, {}) == "r\n"

"""The harness's verdict sentences (``harness/wording.py``) read on plain data, without a rank:
what ``WorkerGroup`` words for a crash, an error, an error with ranks left waiting and a proven
deadlock. The end-to-end checks that a real group says them are in test_faults.py."""

import pytest

from dpfsdp_verify.harness import diagnose, rank_groups, wording
from dpfsdp_verify.harness.protocol import JobError, RankDump
from dpfsdp_verify.targets import progress


def test_exit_text_names_code_signal_or_running():
    assert wording.exit_text(None) == "still running"
    assert wording.exit_text(3) == "exit code 3"
    assert wording.exit_text(-9) == "killed by SIGKILL"
    assert wording.exit_text(-200) == "killed by signal 200"


def test_crash_names_each_dead_rank_and_the_ended_survivors():
    assert wording.crashed({1: -9, 0: 7}, [2]) == ("rank 0 died (exit code 7); rank 1 died (killed by SIGKILL); "
                                                   "rank 2 was still running and was ended")
    assert wording.crashed({1: -9, 0: -9}, [2, 3, 4]) == ("ranks 0, 1 died (killed by SIGKILL); "
                                                          "ranks 2-4 were still running and were ended")
    assert wording.crashed({0: 1}, []) == "rank 0 died (exit code 1)"


def test_raised_names_the_first_rank_and_keeps_every_traceback():
    errors = {2: JobError("KeyError", "'b'", "tb2"), 1: JobError("ValueError", "bad", "tb1")}
    message, details = wording.raised(errors)
    assert message == "rank 1 raised ValueError: bad (ranks 1, 2 all raised)"
    assert details == "--- rank 1 traceback ---\ntb1\n--- rank 2 traceback ---\ntb2"
    assert wording.raised({0: JobError("E", "m", "t")})[0] == "rank 0 raised E: m"
    assert wording.left_waiting([1], 1.0) == "; rank 1 was left waiting (ended after 1.0 s grace)"
    assert wording.left_waiting([0, 2], 1.0) == "; ranks 0, 2 were left waiting (ended after 1.0 s grace)"


def _dump(rank, frames, seq_ops):
    entries = [{"collective_seq_id": s, "profiling_name": op, "input_sizes": [[4]], "process_group": ["0", "default"],
                "record_id": s} for s, op in seq_ops]
    return RankDump(rank=rank, pid=100 + rank, stacks={"MainThread": ["  frame\n"]}, main_frames=frames,
                    flight_recorder={"entries": entries})


def test_deadlock_says_the_proof_the_divergence_and_the_call_sites():
    dumps = {0: _dump(0, [("/src/train.py", 12, "step")], [(0, "gloo:all_reduce"), (1, "gloo:all_reduce")]),
             1: _dump(1, [("/src/train.py", 30, "skip")], [(0, "gloo:all_reduce")])}
    message, head = wording.deadlock(dumps, [0], "rank 1 finished the job", after=2.25, timeout=60.0)
    assert message.startswith("deadlock proven after 2.2 s, before the 60 s deadline: rank 0 can never finish "
                               "(rank 1 finished the job); collective #1 (gloo:all_reduce [[4]]) was issued by "
                               "rank 0 but never by rank 1 (last issued #0)")
    assert message.endswith("(rank 0 at /src/train.py:12 in step)")
    assert head == "deadlock proven after 2.2 s: rank 1 finished the job.\n"
    details = wording.hang_details(head, "analyser says", dumps)
    assert "--- torch flight_recorder analyser (fr_trace) ---\nanalyser says" in details
    assert "--- rank 1 (pid 101), thread MainThread ---" in details
    assert wording.hang_details("r", None, {}) == "r\n"


# -- many ranks: one clause per state, a bounded headline, every rank in the details -------------

#: what "bounded" means below: a message about 1024 ranks is about as long as one about 2
HEADLINE = 400


def test_rank_lists_are_ranges_and_stay_short():
    assert rank_groups.rank_list([3, 0, 1, 2, 5, 7, 8]) == "0-3, 5, 7, 8"
    assert rank_groups.ranks_phrase([4]) == "rank 4" and rank_groups.ranks_phrase(range(1024)) == "ranks 0-1023"
    assert rank_groups.rank_list(range(0, 1024, 2)) == "0, 2, 4, ..., 1022 (512 ranks)"
    assert rank_groups.span([2.04, 1.96, 2.4]) == "2.0-2.4" and rank_groups.span([2.0, 2.01]) == "2.0"


def test_grouped_names_each_state_once_and_counts_the_rest():
    states = {r: f"state {r % 5}" for r in range(1024)}
    text = rank_groups.grouped(states)
    assert text.startswith("ranks 0, 5, 10, ..., 1020 (205 ranks) state 0; ranks 1, 6, 11, ..., 1021 (205 ranks) "
                           "state 1; ranks 2, 7, 12, ..., 1022 (205 ranks) state 2")
    assert text.endswith("and 409 more rank(s) in 2 other state(s) (every rank: the details)")
    assert len(text) < HEADLINE


def test_headline_cuts_a_long_message_at_a_clause_not_mid_word():
    text = "; ".join(f"clause number {k} of a long message" for k in range(40))
    from dpfsdp_verify.gate.report import headline

    cut = headline(text, 200)
    assert len(cut) <= 200 and cut.endswith("of a long message [...]") and text.startswith(cut[:-6])
    assert headline("short", 200) == "short"


def _trails_1024():
    """1023 ranks in pass 2 of step 1, one rank done with it: the shape of issue 25's 8-rank hang."""
    stuck = [progress.Trail(begun=1, given=[-1], passes=[[1, 1]]) for _ in range(1023)]
    return stuck + [progress.Trail(begun=1, finished=1, given=[2], passes=[[2]])]


def test_progress_of_1024_ranks_reads_as_two_states():
    trails = _trails_1024()
    text = progress.describe(trails)
    assert text == ("ranks 0-1022 began step 1 after 0 finished step(s) and never finished it, during physical pass 2; "
                    "rank 1023 finished 1 step(s) and did not end its run (local batches [2]; physical passes per "
                    "step [1])")
    # every rank's own trail: the details (one line each) and the evidence (plain data)
    each = progress.describe_each(trails).splitlines()
    assert len(each) == 1024 and each[1022].startswith("rank 1022 began step 1 (local batch >= 2)")
    ev = progress.evidence(trails)
    assert len(ev) == 1024 and ev[1023] == {"steps_begun": 1, "steps_finished": 1, "ended": False,
                                            "local_batch_sizes": [2], "physical_passes_per_step": [1]}
    # per-rank states that all differ (e.g. every rank ended after its own step count): still bounded
    apart = [progress.Trail(begun=k, finished=k, ended=True, given=[1] * k, passes=[[]] * k) for k in range(1024)]
    assert len(progress.describe(apart)) < 2 * HEADLINE and "and 1021 more rank(s) in 1021 other state(s)" in \
        progress.describe(apart)


def test_last_progress_of_many_ranks_gives_their_seconds_as_a_range():
    trails = _trails_1024()
    for r, t in enumerate(trails):
        t.last_line, t.updated = "pass 0 1 1", 100.0 - r / 1000
    text = progress.last_progress(trails, list(range(1024)), 102.0)
    assert text == ("last progress of ranks 0-1023: began physical pass 2 (size 1) of step 1, 2.0-3.0 s before the "
                    "deadline")


def test_crash_of_1024_ranks_is_one_clause():
    message = wording.crashed({r: -9 for r in range(1024)}, [])
    assert message == "ranks 0-1023 died (killed by SIGKILL)"
    message = wording.crashed({r: 1 for r in range(1, 1024)}, [0])
    assert message == "ranks 1-1023 died (exit code 1); rank 0 was still running and was ended"


def test_deadlock_and_timeout_of_1024_ranks_are_bounded_and_the_report_keeps_every_rank():
    n = 1024
    ops = {r: [(s, "gloo:all_gather") for s in range(5)] + [(5, "gloo:barrier" if r == n - 1 else "gloo:all_gather")]
           for r in range(n)}
    dumps = {r: _dump(r, [("/src/train.py", 30 if r == n - 1 else 12, "hook" if r == n - 1 else "step")], ops[r])
             for r in range(n)}
    message, _ = wording.deadlock(dumps, list(range(n)), "ranks 0 and 1023 issued different collectives as #5",
                                  after=2.0, timeout=60.0)
    assert "ranks 0-1023 can never finish" in message and len(message) < HEADLINE
    assert ("mismatched collectives at #5: ranks 0-1022: gloo:all_gather [[4]]; rank 1023: gloo:barrier [[4]]"
            in message)
    assert message.endswith("(ranks 0-1022 at /src/train.py:12 in step; rank 1023 at /src/train.py:30 in hook)")
    report = diagnose.hang_report(dumps, list(range(n)), [])
    assert sum(line.startswith("rank ") for line in report.splitlines()) == n  # the details: every rank
    # a deadline that passed unproven: ranks 0-1022 wait in #5, rank 1023 is busy outside collectives
    behind = {r: _dump(r, [("/src/train.py", 12, "step")], ops[0][: 5 if r == n - 1 else 6]) for r in range(n)}
    idle = {r: (1.0 + r / 1000, True) for r in range(n)}
    text = diagnose.timeout_message(behind, list(range(n)), [], 60.0, idle)
    assert "still in the job: rank 1023 (at /src/train.py:12 in step; last progress 2.0 s before the deadline; " \
           "last collective #4 gloo:all_gather [[4]])" in text
    assert "ranks 0-1022 waited in collective #5 (gloo:all_gather [[4]]), which rank 1023 had not issued yet" in text
    assert len(text) < HEADLINE + 150  # its fixed closing sentence is ~130 characters


@pytest.mark.parametrize("world_size", [2, 8, 1024])
def test_a_message_does_not_grow_with_the_world_size(world_size):
    """The bar of issue 25: at 8 ranks at most 1.3x the length at 2 (here: at 1024 too)."""
    def message(n):
        trails = [progress.Trail(begun=1, given=[-1], passes=[[1, 1]]) for _ in range(n - 1)]
        trails.append(progress.Trail(begun=1, finished=1, given=[2], passes=[[2]]))
        return progress.describe(trails) + wording.crashed({r: -9 for r in range(n)}, [])
    assert len(message(world_size)) <= 1.3 * len(message(2))

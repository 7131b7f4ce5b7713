"""A hang report names the step a rank was stuck in by the target's own step index (a resumed run, or
a run that skipped a step, numbers its steps beyond the count it began), never the count."""

from dpfsdp_verify.targets import progress


def _trail(tmp_path, lines):
    (tmp_path / "rank0.progress").write_text("".join(line + "\n" for line in lines))
    [t] = progress.read(str(tmp_path), 1)
    return t


def test_stuck_step_is_named_by_its_index(tmp_path):
    # a run resumed after step 1: its first step is index 2 (step 3); it finished steps 3..11 and hung in 12
    lines = ["run 0"] + [x for k in range(2, 11) for x in (f"begin {k} 4", f"end {k}")] + ["begin 11 4"]
    t = _trail(tmp_path, lines)
    assert (t.begun, t.finished, t.current) == (10, 9, 12)
    assert "rank 1 began step 12 (local batch 4) after 9 finished step(s)" in t.describe(1)
    assert t.state().startswith("began step 12 after 9 finished step(s)")


def test_unresumed_run_reads_as_before(tmp_path):
    t = _trail(tmp_path, ["run 0", "begin 0 4", "end 0", "begin 1 4"])
    assert t.current == 2 and "began step 2 (local batch 4) after 1 finished step(s)" in t.describe(0)

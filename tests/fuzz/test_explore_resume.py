"""Exploration draws resume points (docs/explore.md): ``deadlock_free``'s explored noisy runs are
checkpointed at a drawn step k and resumed in fresh rank processes (``contract.resumed_halves``),
and the release judge reads the two halves as one run, so a resumed generator seeded as at the
start -- step k's noise = step 0's -- is a repeat at any resume point, not only at
``checkpoint_resume``'s fixed one. Upstream opacus 1.6.0 shows it (its known ``noise_replayed``),
pinned by configuration in ``opacus-1.6.0.toml``."""

import pytest

pytest.importorskip("hypothesis")

from hypothesis import find, given, settings  # noqa: E402
from hypothesis.errors import NoSuchExample  # noqa: E402

from dpfsdp_verify.fuzz import strategies  # noqa: E402
from dpfsdp_verify.fuzz.explore import check_exact  # noqa: E402
from dpfsdp_verify.gate import expectations  # noqa: E402
from dpfsdp_verify.properties import PROPERTIES, Options  # noqa: E402
from dpfsdp_verify.properties.hangs.check import explore_prepare  # noqa: E402
from dpfsdp_verify.properties.releases import judge as releases  # noqa: E402
from dpfsdp_verify.properties.engine.contract import resumed_halves  # noqa: E402
from dpfsdp_verify.properties.engine.session import Session  # noqa: E402
from dpfsdp_verify.targets import RunSpec  # noqa: E402

DEADLOCK = PROPERTIES["deadlock_free"]


@pytest.mark.slow  # moved out of the README command to keep it near 5 min (CI runs it)
@settings(max_examples=60, database=None, deadline=None)
@given(strategies.explore_specs(4, resume=True))
def test_a_drawn_resume_point_is_a_valid_save_half_inside_the_run(drawn):
    ws, spec, knobs = drawn
    ready = explore_prepare(spec, knobs)
    assert isinstance(ready, RunSpec)
    if "resume_fraction" not in knobs:
        assert ready.resume_at == 0 and resumed_halves(ready) == {}
        return
    assert spec.physical_batch_size == 0  # resume without accumulation (space.combination_problem)
    assert ready.phase == "save" and 1 <= ready.resume_at < ready.steps, ready
    halves = resumed_halves(ready)
    assert [s.phase for s in halves["specs"]] == ["save", "load"] and halves["fresh_groups"] == 2


def test_resume_points_are_drawn_only_where_asked():
    assert find(strategies.explore_specs(4, resume=True), lambda d: "resume_fraction" in d[2],
                settings=settings(database=None, max_examples=200))
    with pytest.raises(NoSuchExample):  # clipped_step's draws (no resume=True) never resume
        find(strategies.explore_specs(4), lambda d: "resume_fraction" in d[2],
             settings=settings(database=None, max_examples=200))


#: a drawn long Poisson run at lr 0, resumed half way (what explore_prepare makes of resume_fraction 0.5)
LONG = RunSpec(sampling="poisson", sample_rate=0.25, dataset_size=64, seeding="per_rank", epochs=12, steps=24, lr=0.0,
               sampling_seed=1)


def _explored(pool, target):
    spec = explore_prepare(LONG, {"clip_quantile": 0.5, "resume_fraction": 0.5})
    assert (spec.resume_at, spec.phase) == (12, "save")
    ledger = releases.Ledger()
    v = check_exact(DEADLOCK, Options(target=target), spec, 2, pool, session=Session(ledger))
    return v, ledger.verdicts(DEADLOCK.with_defaults(Options(target=target)))


def test_a_resumed_draw_whose_noise_restarts_is_a_repeat_across_the_resume(pool):
    v, found = _explored(pool, "fixtures.specimens:Correct")
    assert v.status == "pass" and "resumed in fresh rank processes, took 12 more" in v.message, v.message
    assert v.evidence["step_counts_after_resume"] == [12, 12]
    assert [r.status for r in found] == ["pass"], [r.message for r in found]
    # without the halves read as one run (earlier=None) this passed: each half alone repeats nothing
    v, found = _explored(pool, "fixtures.resume_specimens:ResumeReseedsNoise")
    assert v.status == "pass"  # it finishes on every rank: the noise is the release judge's
    bad = [r for r in found if r.status == "fail"]
    assert [(r.diagnosis, r.evidence["steps"]) for r in bad] == [("dependent_noise", [0, 12])], \
        [r.message for r in found]
    assert "checkpointed after step 12 and resumed in fresh rank processes" in bad[0].message
    assert bad[0].config["resume_at"] == 12 and bad[0].config["releases"] == "deadlock_free"


def test_upstream_repeats_its_noise_across_a_drawn_resume_and_the_finding_is_pinned(pool):
    v, found = _explored(pool, "opacus")
    assert v.status == "pass", v.message
    bad = [r for r in found if r.status == "fail"]
    assert [r.diagnosis for r in bad] == ["dependent_noise"], [r.message for r in found]
    out = expectations.apply(expectations.load("opacus-1.6.0"), bad)
    assert not out.unexpected and id(bad[0]) in out.expected, out
    assert "replay at a resume point exploration draws" in out.expected[id(bad[0])].reason


def test_an_undeclared_feature_in_an_explored_draw_is_a_skip_not_a_finding(pool):
    """What a target does not declare is the fixed cases' verdict (checkpoint_resume fails
    ``UndeclaredResume`` saying so), told once: an explored draw of it is a skip."""
    spec = explore_prepare(LONG.with_(steps=4, epochs=2), {"clip_quantile": 0.5, "resume_fraction": 0.5})
    v = check_exact(DEADLOCK, Options(target="fixtures.resume_specimens:UndeclaredResume"), spec, 1, pool)
    assert v.status == "skip" and "explored configuration not run" in v.message and "resume" in v.message, v.message


@pytest.mark.slow  # moved out of the README command to keep it near 5 min (CI runs it)
def test_a_resumed_draw_replays_from_its_line(pool, capsys):
    """An explored verdict's repro line is ``replay --exact`` of the spec as run -- for a resumed draw
    its save half, which the replay runs as both halves again. ``deadlock_free``'s lines exited 2
    ("cannot be fuzzed") before: replay took only properties with a fuzz recipe."""
    import shlex

    from dpfsdp_verify.gate import cli

    spec = explore_prepare(RunSpec(steps=4, global_batch_size=4, lr=0.5), {"clip_quantile": 0.5,
                                                                            "resume_fraction": 0.6})
    line = check_exact(DEADLOCK, Options(target="fixtures.specimens:Correct"), spec, 2, pool).repro
    argv = shlex.split(line)
    assert argv[:2] == ["dpfsdp-verify", "replay"] and "--exact" in argv and "deadlock_free" in argv, line
    assert RunSpec.from_json(argv[argv.index("--spec") + 1]) == spec
    assert cli.main(argv[1:]) == cli.EXIT_OK
    assert "resumed in fresh rank processes, took 2 more" in capsys.readouterr().out
    # a property with neither recipe is still refused, naming the ones that replay
    assert cli.main(["replay", "--target", "fixtures.specimens:Correct", "--property", "trajectory", "--world-size",
                     "1", "--spec", spec.to_json(), "--exact"]) == cli.EXIT_USAGE
    assert "deadlock_free" in capsys.readouterr().err

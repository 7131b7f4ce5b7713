"""Exploration (``--explore DRAWS``, docs/explore.md): draws from the configuration space beyond
the fixed cases, judged by the property's own judge, a failure shrunk and replayed exactly."""

import json
import shlex

import pytest

pytest.importorskip("hypothesis")

from hypothesis import given, seed, settings  # noqa: E402

from dpfsdp_verify.config import space  # noqa: E402
from dpfsdp_verify.config.defaults import DEFAULT_EXPLORE_CAP_S, DEFAULT_EXPLORE_DRAWS, EXPLORE_ENV  # noqa: E402
from dpfsdp_verify.fuzz import explore, strategies  # noqa: E402
from dpfsdp_verify.gate import cli  # noqa: E402
from dpfsdp_verify.properties import PROPERTIES, Options  # noqa: E402
from dpfsdp_verify.properties.analysis.clipfit import clip_at_quantile  # noqa: E402
from dpfsdp_verify.properties.analysis.compare import reference_norms  # noqa: E402
from dpfsdp_verify.properties.engine.session import Session  # noqa: E402
from dpfsdp_verify.targets import RunSpec  # noqa: E402
from dpfsdp_verify.verdict import Verdict  # noqa: E402
from fixtures.explore_specimens import FIRST_UNCLIPPED_ROW  # noqa: E402

CLIPPED = PROPERTIES["clipped_step"]
SPECIMEN = "fixtures.explore_specimens:UnclippedRowsFrom40"


def test_draws_stay_in_the_space_and_reach_past_the_fixed_cases():
    drawn = []

    @seed(11)
    @settings(max_examples=150, database=None, deadline=None)
    @given(strategies.explore_specs(4))
    def collect(d):
        drawn.append(d)

    collect()
    locals_ = []
    for ws, spec, knobs in drawn:
        assert 1 <= ws <= 4 and 0.0 <= knobs["clip_quantile"] <= 1.0
        assert space.combination_problem(world_size=ws, dtype=spec.dtype, precision=spec.precision,
                                         sampling=spec.sampling, steps=spec.steps) is None
        assert 1 <= spec.steps <= 200 and (spec.lr == 0.0 if spec.steps > 1 else 0.01 <= spec.lr <= 1.0)
        if spec.poisson:
            assert spec.steps * spec.expected_batch_size <= strategies.LONG_RUN_SAMPLE_STEPS or spec.steps == 1
        else:
            locals_.append(spec.global_batch_size // ws)
            assert 1 <= spec.global_batch_size // ws <= 64
    # what the fixed cases never reach: local batches past 40, several ranks, bf16, long runs, accumulation
    assert max(locals_) > FIRST_UNCLIPPED_ROW
    assert {ws for ws, _, _ in drawn} == {1, 2, 3, 4}
    assert any(s.precision != "fp32" for _, s, _ in drawn) and any(s.steps > 1 for _, s, _ in drawn)
    assert any(s.physical_batch_size for _, s, _ in drawn) and any(s.model == "conv" for _, s, _ in drawn)


def test_clip_at_quantile_spans_all_clipped_to_none_clipped():
    spec = RunSpec(global_batch_size=8)
    norms = reference_norms(spec)
    assert bool((norms > clip_at_quantile(spec, 0.0)).all())
    assert bool((norms < clip_at_quantile(spec, 1.0)).all())
    mid = clip_at_quantile(spec, 0.5)
    assert int((norms > mid).sum()) == 4


# slow: two whole explorations with shrinking, planned in this process (~25 s idle); a gate run's exploration
# end to end runs in the README command (test_a_gate_run_explores_after_its_fixed_cases_and_reports_it)
@pytest.mark.slow
def test_a_failing_draw_is_shrunk_to_its_smallest_configuration(monkeypatch):
    """The search and shrinking, without ranks: a stand-in judge fails exactly the configurations the
    specimen's bug shows in (a local batch past row 40 with some sample clipped)."""
    ran = []

    def judge(self, ws, spec, knobs):
        ran.append((ws, spec))
        local = spec.global_batch_size // ws if not spec.poisson else 0
        bad = local > FIRST_UNCLIPPED_ROW and knobs["clip_quantile"] < 0.98 and not spec.physical_batch_size
        case = CLIPPED.explore_case(self.opts, spec, knobs, ws, self.modes)
        return case.verdict("fail" if bad else "pass", "mismatch" if bad else None, "stand-in judge")

    monkeypatch.setattr(explore._Explorer, "run", judge)
    monkeypatch.setattr(explore, "SHRINK_RUNS", 10_000)  # shrinking to the end; the gate's count: the next test
    opts = Options(target=SPECIMEN, seed=3)
    [v] = explore.explore_property(CLIPPED, opts, draws=40, pool=object(), max_world_size=2)
    assert (v.status, v.diagnosis) == ("fail", "mismatch")
    spec = RunSpec.from_json(json.dumps(v.evidence["spec"]))
    # the smallest of the failing draw's regions (fuzz/strata.py: shrinking stays in them): one rank, and the
    # first failing row of its local-batch quarter (41 in 33-48, 49 in 49-64)
    quarter_lo = 16 * ((spec.global_batch_size - 1) // 16) + 1
    assert v.config["world_size"] == 1 and spec.global_batch_size == max(FIRST_UNCLIPPED_ROW + 1, quarter_lo)
    assert v.evidence["explored"] is True and v.config["explore"]["seed"] == 3
    assert "exploration found a failing configuration" in v.message and "shrunk to the smallest" in v.message
    assert 1 <= v.evidence["found_at_draw"] <= v.evidence["draws_run"]
    argv = shlex.split(v.repro)
    assert argv[:2] == ["dpfsdp-verify", "replay"] and argv[-1] == "--exact"
    assert RunSpec.from_json(argv[argv.index("--spec") + 1]) == spec
    # the same run seed draws the same configurations in the same order
    first = list(ran)
    ran.clear()
    explore.explore_property(CLIPPED, opts, draws=40, pool=object(), max_world_size=2)
    assert ran == first


def test_shrinking_stops_after_a_count_of_runs_the_same_on_any_machine(monkeypatch):
    """A found failure shrinks for ``SHRINK_RUNS`` runs, not seconds: the same seed reports the same
    (partly shrunk) configuration twice, however slow the runs."""
    def judge(self, ws, spec, knobs):
        bad = spec.global_batch_size // ws > FIRST_UNCLIPPED_ROW and not spec.poisson
        case = CLIPPED.explore_case(self.opts, spec, knobs, ws, self.modes)
        return case.verdict("fail" if bad else "pass", "mismatch" if bad else None, "stand-in judge")

    monkeypatch.setattr(explore._Explorer, "run", judge)
    monkeypatch.setattr(explore, "SHRINK_RUNS", 3)
    opts = Options(target=SPECIMEN, seed=3)
    found = [explore.explore_property(CLIPPED, opts, draws=40, pool=object(), max_world_size=2)[0] for _ in range(2)]
    assert all(v.status == "fail" for v in found)
    assert all(v.evidence["draws_run"] - v.evidence["found_at_draw"] <= 3 for v in found), [v.evidence for v in found]
    assert found[0].evidence["spec"] == found[1].evidence["spec"]


def test_no_draws_no_runs(monkeypatch):
    monkeypatch.setattr(explore._Explorer, "run", lambda *a: pytest.fail("ran a draw with --explore 0"))
    assert explore.explore_property(CLIPPED, Options(seed=1), draws=0, pool=object()) == []


def _stand_in(monkeypatch, ran, slow_s=0.0):
    """``_Explorer.run`` replaced by a judge that passes every draw, recording it; each draw advances
    a fake clock by ``slow_s`` seconds (a loaded machine: the same work, more seconds)."""
    clock = [1000.0]
    monkeypatch.setattr(explore.time, "monotonic", lambda: clock[0])

    def judge(self, ws, spec, knobs):
        clock[0] += slow_s
        ran.append((ws, spec.to_json(), json.dumps(knobs, sort_keys=True)))
        return self.prop.explore_case(self.opts, spec, knobs, ws, self.modes).verdict("pass", None, "stand-in")

    monkeypatch.setattr(explore._Explorer, "run", judge)
    return clock


@pytest.mark.parametrize("pid", ["clipped_step", "deadlock_free"])
def test_a_seed_explores_the_same_configurations_on_an_idle_and_a_loaded_machine(monkeypatch, pid):
    """``--seed S`` fixes the draws, not the seconds: a run whose draws take 20 s each (a loaded box)
    judges exactly the configurations, in the same order and as many, as one whose draws take none;
    until 2026-11-28 the loaded run judged one (the simplest) where the idle one judged several."""
    prop, opts = PROPERTIES[pid], Options(target="fixtures.specimens:Correct", seed=20261128)
    idle, loaded = [], []
    _stand_in(monkeypatch, idle)
    [v_idle] = explore.explore_property(prop, opts, draws=DEFAULT_EXPLORE_DRAWS, pool=object(), max_world_size=4)
    clock = _stand_in(monkeypatch, loaded, slow_s=20.0)
    [v_loaded] = explore.explore_property(prop, opts, draws=DEFAULT_EXPLORE_DRAWS, pool=object(), max_world_size=4,
                                          deadline=clock[0] + 10 * DEFAULT_EXPLORE_DRAWS * 20.0)
    assert len(idle) == DEFAULT_EXPLORE_DRAWS and loaded == idle
    assert len(set(idle)) == len(idle)  # no configuration judged twice
    assert v_idle.evidence["draws"] == v_loaded.evidence["draws"] and v_loaded.status == "pass"
    assert "capped" not in v_loaded.config["explore"] and "TIME CAP" not in v_loaded.message


def test_the_time_cap_stops_draws_and_says_so(monkeypatch):
    """Time is only a cap: past it the seed's remaining draws are not run, the verdict says how many
    ran (``config["explore"]["capped"]``) and the exit line says the cap was hit; those that ran are
    the first of the seed's draws."""
    from dpfsdp_verify.gate.report import capped_note

    opts = Options(target="fixtures.specimens:Correct", seed=7)
    idle, capped = [], []
    _stand_in(monkeypatch, idle)
    explore.explore_property(CLIPPED, opts, draws=6, pool=object(), max_world_size=4)
    clock = _stand_in(monkeypatch, capped, slow_s=20.0)
    [v] = explore.explore_property(CLIPPED, opts, draws=6, pool=object(), max_world_size=4, deadline=clock[0] + 30.0)
    assert capped == idle[:2]  # started at 0 s and 20 s; the third would start past the 30 s cap
    ex = v.config["explore"]
    assert v.status == "pass" and ex["capped"] is True and ex["unrun_draws"] == 4 and ex["draws_asked"] == 6
    assert "TIME CAP HIT: 2 of the seed's 6 draws ran" in v.message
    assert capped_note([v]) == ("exploration hit its time cap, --explore-cap: clipped_step 2 of 6 draws ran; the "
                                "seed's other configurations were not judged")
    assert capped_note([Verdict("clipped_step", "pass", {"explore": {"draws": 6}})]) == ""


def test_the_explored_bug_fails_its_configuration_and_correct_passes_it(pool):
    """The specimen's bug at a drawn configuration (one rank, a local batch of 48, C mid-norm): the
    property's own judge fails it with its diagnosis; Correct passes the same spec."""
    spec = RunSpec(global_batch_size=48, lr=0.37, dtype="float32")
    spec = spec.with_(max_grad_norm=clip_at_quantile(spec, 0.5))
    bad = explore.check_exact(CLIPPED, Options(target=SPECIMEN), spec, 1, pool)
    assert (bad.status, bad.diagnosis) == ("fail", "mismatch") and bad.evidence["explored"] is True
    good = explore.check_exact(CLIPPED, Options(target="fixtures.specimens:Correct"), spec, 1, pool)
    assert good.status == "pass", good.message


def test_the_fixed_floor_reaches_every_row_a_draw_can(pool):
    """``clipped_step``'s wide case (C = min norm/100) runs at the largest local batch exploration
    draws: the default gate's own ws=1 case fails the rows-from-40 specimen without a draw, and
    passes Correct."""
    from dpfsdp_verify.gate.plan import RunPlan
    from dpfsdp_verify.properties.clipping.clipped_step import WIDE_LOCAL_BATCH
    from dpfsdp_verify.properties.engine.runner import judge_cases
    from dpfsdp_verify.config.space import AXES

    assert WIDE_LOCAL_BATCH == AXES["local_batch"].explore[1] > FIRST_UNCLIPPED_ROW
    for target, status in ((SPECIMEN, "fail"), ("fixtures.specimens:Correct", "pass")):
        opts = RunPlan.from_args(cli.build_parser().parse_args(["run", "--target", target, "--seed", "3"])).options
        opts = CLIPPED.with_defaults(opts)
        case, = [c for c in CLIPPED.plan(opts) if getattr(c, "world_size", 0) == 1 and len(getattr(c, "specs", ())) == 2
                 and not c.spec.poisson and c.spec.precision == "fp32"]
        assert case.specs[1].global_batch_size == WIDE_LOCAL_BATCH
        v, = judge_cases(CLIPPED, [case], pool, 120.0)
        assert v.status == status, v.message
        if status == "fail":
            assert v.diagnosis == "mismatch" and "C = min norm/100" in v.message


@pytest.mark.slow
def test_an_odd_local_batch_under_sum_is_a_configuration_only_a_draw_reaches(pool):
    """``DivisorFromLocalBatchUnderSum`` divides by the world size only when a rank's local batch is
    odd under ``sum``: the fixed cases' local batches under ``sum`` are all even and pass it; a
    draw of 3 samples per rank at 2 ranks (local batches 1-64 are drawn) fails it, Correct passes."""
    spec = RunSpec(model="mlp", global_batch_size=6, reduction="sum", data_layout="split", dtype="float64")
    bad = explore.check_exact(CLIPPED, Options(target="fixtures.audit_noise_specimens:DivisorFromLocalBatchUnderSum"),
                              spec, 2, pool)
    assert (bad.status, bad.diagnosis) == ("fail", "mismatch") and "0.5 x the reference" in bad.message
    good = explore.check_exact(CLIPPED, Options(target="fixtures.specimens:Correct"), spec, 2, pool)
    assert good.status == "pass", good.message


def test_cli_explore_option_and_default(monkeypatch, capsys):
    from dpfsdp_verify.gate.plan import RunPlan

    parser = cli.build_parser()
    for bad in ("-1", "nan", "2.5", "many"):
        assert cli.main(["run", "--explore", bad, "--properties", "clipped_step"]) == cli.EXIT_USAGE
        err = capsys.readouterr().err.strip()
        assert "--explore" in err and len(err.splitlines()) == 1
    fixed = RunPlan.from_args(parser.parse_args(["run", "--target", "fixtures.specimens:Correct", "--explore", "0"]))
    assert fixed.explore == 0
    monkeypatch.delenv(EXPLORE_ENV, raising=False)
    default = RunPlan.from_args(parser.parse_args(["run", "--target", "fixtures.specimens:Correct"]))
    assert default.explore == DEFAULT_EXPLORE_DRAWS and default.explore_cap == DEFAULT_EXPLORE_CAP_S
    # the old --explore 6 (seconds) still parses: now 6 draws per explored property
    assert RunPlan.from_args(parser.parse_args(["run", "--target", "fixtures.specimens:Correct", "--explore",
                                                "6", "--explore-cap", "90"])).explore == 6
    assert cli.main(["run", "--explore-cap", "0", "--properties", "clipped_step"]) == cli.EXIT_USAGE
    assert "--explore-cap" in capsys.readouterr().err
    monkeypatch.setenv(EXPLORE_ENV, "0")
    assert RunPlan.from_args(parser.parse_args(["run", "--target", "fixtures.specimens:Correct"])).explore == 0


def test_unproven_timeout_of_a_draw_is_not_a_finding():
    hang = Verdict("clipped_step", "hang", {"world_size": 4}, diagnosis="timeout", message="no deadlock proven")
    assert explore.unproven_timeout_skipped(hang).status == "skip"
    dead = Verdict("clipped_step", "hang", {"world_size": 4}, diagnosis="deadlock", message="proven")
    assert explore.unproven_timeout_skipped(dead) is dead


def test_drawn_variants_never_shard_a_dim_shorter_than_the_world_size():
    from dpfsdp_verify import models

    @seed(5)
    @settings(max_examples=120, database=None, deadline=None)
    @given(strategies.explore_specs(4))
    def check(d):
        ws, spec, _ = d
        model = models.build_model(spec.model, 0, **dict(spec.model_kwargs))
        assert all(p.shape[0] >= ws for p in model.parameters() if p.dim() >= 1), (ws, spec.model_kwargs)

    check()


@pytest.mark.slow  # moved out of the README command to keep it near 5 min (CI runs it)
def test_a_gate_run_explores_after_its_fixed_cases_and_reports_it(pool, capsys):
    """Through the gate (``run_plan``): the explored property's summary verdict follows its fixed
    cases, carries ``config["explore"]`` and ``evidence["explored"]``, and fits the report schema;
    then the explored failure's replay line, through the CLI, fails on the specimen (exit 1)."""
    import jsonschema
    from importlib import resources

    from dpfsdp_verify.gate import report
    from dpfsdp_verify.gate.result import judge
    from dpfsdp_verify.gate.plan import RunPlan
    from dpfsdp_verify.gate.run import run_plan

    args = cli.build_parser().parse_args(["run", "--target", "fixtures.specimens:Correct", "--properties",
                                          "clipped_step", "--world-sizes", "1", "--models", "mlp", "--dtypes",
                                          "float64", "--loss-reductions", "mean", "--sampling", "fixed",
                                          "--horizon", "0", "--wide-world-size", "0",
                                          "--node-world-size", "0", "--explore", "1", "--seed", "4"])
    verdicts = run_plan(RunPlan.from_args(args), pool=pool)
    explored = [v for v in verdicts if "explore" in v.config]
    assert len(explored) == 1 and verdicts[-1] is explored[0] and len(verdicts) > 1
    assert explored[0].status == "pass" and explored[0].evidence["explored"] is True
    assert explored[0].config["explore"]["seed"] == 4 and explored[0].config["explore"]["draws"] >= 1
    schema = json.loads(resources.files("dpfsdp_verify").joinpath("schema/report.schema.json").read_text())
    rep = report.to_json(judge(verdicts, {"name": "Correct", "version": "0", "ref": "fixtures.specimens:Correct",
                                          "opacus": None}, "gloo", seed=4))
    jsonschema.validate(rep, schema, cls=jsonschema.Draft202012Validator)
    spec = RunSpec(global_batch_size=44, dtype="float32")
    spec = spec.with_(max_grad_norm=clip_at_quantile(spec, 0.3))
    line = explore.check_exact(CLIPPED, Options(target=SPECIMEN), spec, 1, pool).repro
    argv = shlex.split(line)
    assert argv[:2] == ["dpfsdp-verify", "replay"] and "--exact" in argv
    assert cli.main(argv[1:]) == cli.EXIT_FAIL
    assert "clipped_step: FAIL (mismatch)" in capsys.readouterr().out


def test_nccl_exploration_draws_no_more_ranks_than_gpus(monkeypatch):
    """Under nccl every rank needs a GPU of its own: on a one-GPU box exploration draws world size 1
    only (gloo draws up to the cores' limit); with no GPU it draws nothing."""
    from dpfsdp_verify.gate import session as gate_session
    from dpfsdp_verify.harness.backends import SIMULATED_GPUS_ENV

    asked = []
    monkeypatch.setattr(explore, "explore_property",
                        lambda prop, opts, s, pool, max_world_size=None, deadline=0.0, session=None:
                        asked.append(max_world_size) or [])
    fuzzer = gate_session.make_fuzzer(0, 5)
    for backend, gpus in (("nccl", "1"), ("gloo", "1"), ("nccl", "2")):
        monkeypatch.setenv(SIMULATED_GPUS_ENV, gpus)
        fuzzer(PROPERTIES["clipped_step"], Options(target="opacus", backend=backend), None)
    assert asked == [1, None, 2]
    monkeypatch.undo()
    assert explore.explore_property(PROPERTIES["clipped_step"], Options(target="opacus"), 5, None,
                                    max_world_size=0) == []


def test_deadlock_free_explores_noisy_runs_whose_releases_feed_the_release_judge(pool, monkeypatch):
    """``deadlock_free``'s draws run with noise on (``explore_prepare``: >= 2 steps, the drawn sigma, C at
    the drawn quantile, the drawn lr); inside the gate's ledger their releases are judged like every
    run's. The noise scaled by min(lr, 1) -- right in every lr-0 noise case -- fails on a draw in the
    lowest lr region (lr < 0.26: at most a quarter of the noise; the draw's regions are set here:
    fixed batches, fp32 float64, 2 ranks), naming the run made for deadlock_free; Correct's draws pass."""
    from dpfsdp_verify.properties.releases import judge as releases

    prop = PROPERTIES["deadlock_free"]
    assert prop.explore is not None
    low_lr = {"batches": (0, 4), "precision": (0, 4), "world_size": (1, 2), "lr": (0, 4), "model": (0, 3)}
    monkeypatch.setattr(explore._Explorer, "plan", lambda self: [low_lr])
    for target, status in (("fixtures.release_specimens:NoiseScaledByLr", "fail"),
                           ("fixtures.specimens:Correct", "pass")):
        opts = Options(target=target, seed=3)
        ledger = releases.Ledger()
        own, = explore.explore_property(prop, opts, 1, pool, max_world_size=2, session=Session(ledger))
        assert own.status == "pass" and own.evidence["explored"] is True, own.message  # every draw finished
        judged = ledger.verdicts(prop.with_defaults(opts))
        assert judged and {v.status for v in judged} == {status}, [v.message[:300] for v in judged]
        if status == "fail":
            assert all(v.diagnosis == "mismatch" and "made for deadlock_free" in v.message for v in judged)
            assert "PRIVACY VIOLATION" in judged[0].message

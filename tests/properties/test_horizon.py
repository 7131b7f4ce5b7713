"""The gate beyond its matrix (docs/horizon.md): a third rank on a node layout, and one long run per
check family. Each specimen of ``fixtures/horizon_specimens.py`` fails the cases the default gate
plans with its property and diagnosis; ``Correct`` passes them (upstream opacus:
``test_upstream.py``). The cases are taken from the default gate's own plan
(``RunPlan.from_args`` with no option) and run on the tests' warm pool.
"""

import pytest

from dpfsdp_verify.gate import cli
from dpfsdp_verify.gate.plan import RunPlan
from dpfsdp_verify.harness import local_world_size, node_env
from dpfsdp_verify.properties import PROPERTIES
from dpfsdp_verify.properties.engine.contract import Case
from dpfsdp_verify.properties.engine.horizon import HORIZON_STEPS, WIDE_WORLD_SIZE
from dpfsdp_verify.properties.engine.runner import judge_cases
from tests.verdict_helpers import assert_all_pass

H = "fixtures.horizon_specimens:"
#: a loaded runner runs tens of steps slowly; a deadlock is proven in seconds whatever this is
TIMEOUT = 240.0


def default_options(target, **changes):
    """The options of ``dpfsdp-verify run --target TARGET`` (the default gate), with ``changes``."""
    args = cli.build_parser().parse_args(["run", "--target", target, "--seed", "11"])
    return RunPlan.from_args(args).options.with_(**changes)


def beyond_matrix(pid, target, **changes):
    """The cases of property ``pid`` the default gate runs beyond its matrix: at the wide world
    size, and its long run."""
    prop = PROPERTIES[pid]
    opts = prop.with_defaults(default_options(target, **changes))
    return [c for c in prop.plan(opts) if isinstance(c, Case)
            and (c.world_size == opts.wide_world_size or "horizon" in c.labels)]


def judged(pool, pid, target, select=None, **changes):
    cases = [c for c in beyond_matrix(pid, target, **changes) if select is None or select(c)]
    assert cases
    return judge_cases(PROPERTIES[pid], cases, pool, TIMEOUT)


def wide_only(case):
    return case.world_size == WIDE_WORLD_SIZE


def long_only(case):
    return "horizon" in case.labels


def one_failure(verdicts, status, diagnosis, *words, count=1):
    """The failing verdicts (``count`` of them) all fail as given, each message saying ``words``."""
    bad = [v for v in verdicts if v.status != "pass"]
    assert [(v.status, v.diagnosis) for v in bad] == [(status, diagnosis)] * count, [(v.config, v.message)
                                                                                    for v in bad]
    for v in bad:
        for w in words:
            assert w in v.message, v.message
    return bad[0]


# -- the plan ------------------------------------------------------------------------------------


def test_default_gate_plans_a_third_rank_and_the_long_runs():
    opts = default_options("fixtures.specimens:Correct")
    assert (opts.world_sizes, opts.wide_world_size, opts.horizon) == ((1, 2), WIDE_WORLD_SIZE, HORIZON_STEPS)
    # the default gate's properties (the privacy audit among them: at the smallest world size, no wide case)
    planned = {pid: beyond_matrix(pid, "fixtures.specimens:Correct") for pid, p in PROPERTIES.items() if not p.opt_in}
    wide = {pid: [c for c in cs if c.world_size == 3] for pid, cs in planned.items()}
    assert {pid: len(cs) for pid, cs in wide.items() if cs} == {"norm_fidelity": 1, "noise_calibration": 2,
                                                                 "deadlock_free": 1}
    assert wide["deadlock_free"][0].labels["local_batches"] == "uneven_accum"
    assert wide["norm_fidelity"][0].spec.data_layout == "split"
    longs = {pid: [c for c in cs if "horizon" in c.labels] for pid, cs in planned.items()}
    assert {pid: len(cs) for pid, cs in longs.items() if cs} == {"clipped_step": 1, "noise_calibration": 1,
                                                                 "deadlock_free": 1}
    for cs in longs.values():
        for c in cs:
            assert (c.world_size, c.spec.sampling, c.spec.steps, c.spec.epochs) == (2, "poisson", HORIZON_STEPS,
                                                                                       HORIZON_STEPS // 4)
            assert c.config()["horizon"] == HORIZON_STEPS and c.isolate
    # the noisy long run is one job: deadlock_free's hang scenario and noise_calibration's every release
    assert longs["noise_calibration"][0].spec == longs["deadlock_free"][0].spec
    assert longs["noise_calibration"][0].spec.noise_multiplier not in (0, 1) and longs["deadlock_free"][0].spec.lr > 0
    # the exact-only noise cases run at 3 ranks too, the wide mlp's rows sharded unevenly there (a
    # rank * local_rows offset is wrong only then)
    noise = {c.spec.model: c for c in wide["noise_calibration"]}
    assert set(noise) == {"transformer", "mlp"} and all(c.facts["exact_only"] for c in noise.values())
    assert dict(noise["mlp"].spec.model_kwargs)["hidden"] % 3 and dict(noise["mlp"].spec.model_kwargs)["classes"] % 3


def test_reach_options_are_checked_and_can_be_turned_off(capsys):
    for bad in (["--wide-world-size", "2"], ["--horizon", "-1"]):
        assert cli.main(["run", "--target", "fixtures.specimens:Correct", *bad]) == 2
        err = capsys.readouterr().err
        assert bad[0] in err and err.count("\n") <= 2
    assert beyond_matrix("noise_calibration", "fixtures.specimens:Correct", wide_world_size=0, horizon=0) == []
    # a wide world size already in the matrix adds nothing: the whole matrix runs there
    prop = PROPERTIES["norm_fidelity"]
    assert prop.wide_plan(prop.with_defaults(default_options("fixtures.specimens:Correct", world_sizes=(1, 3)))) == []
    assert len(prop.wide_plan(prop.with_defaults(default_options("fixtures.specimens:Correct")))) == 1


def test_ranks_get_a_torchrun_node_layout(pool):
    assert [local_world_size(n) for n in (1, 2, 3, 4, 5, 6)] == [1, 2, 1, 2, 1, 2]
    assert node_env(3, 4) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                              "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4"}
    res = pool.run(_layout, world_size=3)
    assert res.ok and res.values() == [("0", "0", "0"), ("1", "0", "1"), ("2", "0", "2")]


def _layout():
    import os

    return os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["GROUP_RANK"]


# -- a third rank --------------------------------------------------------------------------------


def test_correct_passes_every_case_at_the_third_rank(pool):
    for pid in ("norm_fidelity", "noise_calibration", "deadlock_free"):
        assert_all_pass(judged(pool, pid, "fixtures.specimens:Correct", wide_only))


def test_noise_seeded_with_local_rank_repeats_across_nodes(pool):
    v = one_failure(judged(pool, "noise_calibration", H + "NoiseSeededWithLocalRank", wide_only), "fail",
                    "dependent_noise", "PRIVACY VIOLATION", "get the same noise", "ranks seeded alike", "LOCAL_RANK",
                    count=2)
    assert v.config["world_size"] == 3


def test_replicated_noise_sliced_at_rank_rows_is_named_a_shard_offset(pool):
    v = one_failure(judged(pool, "noise_calibration", H + "ReplicatedNoiseSlicedAtRankRows", wide_only), "fail",
                    "dependent_noise", "rank 2's shard of", "a shard offset", "rank * local_rows", count=2)
    assert "seeded alike" not in v.message


def test_norms_read_at_local_rank_name_the_rank_borrowed_from(pool):
    one_failure(judged(pool, "norm_fidelity", H + "NormsReadAtLocalRank", wide_only), "fail", "sample_mixing",
                "it reports another rank's per-sample norms", "rank 1 uses rank 0's", "rank 2 uses rank 0's",
                "wrong index")


def test_passes_agreed_with_a_neighbour_diverge_at_three_ranks(pool):
    v = one_failure(judged(pool, "deadlock_free", H + "PassesAgreedWithNeighbour", wide_only), "error",
                    "step_divergence", "physical passes")
    assert v.config["local_batches"] == "uneven_accum" and v.evidence["physical_passes_per_step"][2] == [1]


# -- the long runs (a shorter horizon where the bug starts early: the same code, fewer steps) -----


@pytest.mark.slow
def test_correct_passes_every_long_run(pool):
    for pid in ("clipped_step", "noise_calibration", "deadlock_free"):
        assert_all_pass(judged(pool, pid, "fixtures.specimens:Correct", long_only))


def test_clip_cap_dropped_from_step_9_is_named_from_step_9(pool):
    v = one_failure(judged(pool, "clipped_step", H + "ClipCapDroppedFromStep9", long_only, horizon=16), "fail",
                    "mismatch", "from step 9 (counted from 0; epoch 3) on", "the 9 before it equal the reference",
                    "not capped at 1")
    assert v.evidence["wrong_steps"] == list(range(9, 16))


def test_clip_dropped_from_the_third_epoch_is_named_from_its_first_step(pool):
    one_failure(judged(pool, "clipped_step", H + "ClipCapDroppedFromThirdEpoch", long_only, horizon=16), "fail",
                "mismatch", "from step 8 (counted from 0; epoch 3) on", "floored at 1")


def test_noise_halved_from_step_14_is_too_little_noise_from_step_14(pool):
    one_failure(judged(pool, "noise_calibration", H + "NoiseHalvedFromStep14", long_only, horizon=20), "fail",
                "mismatch", "PRIVACY VIOLATION: too little noise", "from step 14 on", "0.5")


@pytest.mark.slow
def test_noise_reduced_from_step_41_needs_the_default_horizon(pool):
    one_failure(judged(pool, "noise_calibration", H + "NoiseReducedFromStep41", long_only), "fail", "mismatch",
                "too little noise", "from step 41 on", "0.7")


def test_rank_zero_log_collective_every_16_steps_deadlocks_at_step_16(pool):
    v = one_failure(judged(pool, "deadlock_free", H + "LogMetricOnRankZeroEvery16", long_only, horizon=20), "hang",
                    "deadlock", "deadlock proven", "gloo:all_reduce", "finished 16 step(s)")
    assert v.config["local_batches"] == "poisson_horizon"


def test_rank_zero_dropping_small_batches_from_the_third_epoch_diverges(pool):
    one_failure(judged(pool, "deadlock_free", H + "RankZeroDropsSmallBatchesFromThirdEpoch", long_only, horizon=20),
                "hang",
                "step_divergence", "the ranks took different numbers of steps")


@pytest.mark.slow
def test_replicated_noise_sliced_at_rank_rows_is_a_shard_offset_at_four_ranks(pool):
    """Issue 27: at 4 ranks the same bug was named "ranks seeded alike"."""
    bad = [v for v in judged(pool, "noise_calibration", H + "ReplicatedNoiseSlicedAtRankRows",
                             lambda c: c.world_size == 4, wide_world_size=4) if v.status != "pass"]
    assert bad and all((v.status, v.diagnosis) == ("fail", "dependent_noise") for v in bad)
    assert all("a shard offset" in v.message and "seeded alike" not in v.message for v in bad), bad[0].message

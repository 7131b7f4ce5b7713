"""The gate's node reach on real ranks (``properties/engine/horizon.py``: 4 ranks as 2 simulated nodes
x 2 local ranks): the specimens of fixtures/rank_specimens.py, right at 1-3 ranks, fail the node
cases the default gate plans, on the property and diagnosis issue 32's table names, naming the
rank(s); ``Correct`` (and, slow, the ``Correct*`` variants of fixtures/release_specimens.py) pass
them. The cases come from the default gate's own plan (``RunPlan.from_args``, no option) and run on
the tests' warm pool (whose fixture proves no rank process is left behind)."""

import pytest

from dpfsdp_verify.gate import cli
from dpfsdp_verify.gate.plan import RunPlan, UsageError
from dpfsdp_verify.properties import PROPERTIES
from dpfsdp_verify.properties.releases import judge as releases
from dpfsdp_verify.properties.engine.contract import Case
from dpfsdp_verify.properties.engine.runner import judge_cases
from dpfsdp_verify.properties.engine.session import Session

R = "fixtures.rank_specimens:"
TIMEOUT = 240.0
#: the properties with node cases, and how many each plans by default
NODE_CASES = {"noise_calibration": 1, "norm_fidelity": 1, "sampling_accounting": 1}


def _options(target, *flags):
    args = cli.build_parser().parse_args(["run", "--target", target, "--seed", "11", *flags])
    return RunPlan.from_args(args).options


def node_cases(pid, target):
    prop = PROPERTIES[pid]
    opts = prop.with_defaults(_options(target))
    # the node cases of the plan (``Property.plan`` appends ``nodes_plan``'s; planning the matrix costs seconds)
    cases = [c for c in prop.nodes_plan(opts) if isinstance(c, Case)]
    assert all(c.world_size == opts.node_world_size == 4 for c in cases)
    assert cases
    return prop, cases


def judged(pool, pid, target):
    """The verdicts of ``pid``'s node cases on ``target``, and the release judge's of their runs."""
    prop, cases = node_cases(pid, target)
    ledger = releases.Ledger()
    own = judge_cases(prop, cases, pool, TIMEOUT, Session(ledger))
    return own, ledger


def test_the_default_gate_plans_the_node_cases_at_4_ranks():
    opts = _options("fixtures.specimens:Correct")
    assert opts.node_world_size == 4 and 4 not in opts.world_sizes and opts.wide_world_size == 3
    # only these properties have node cases (planning every property's matrix costs seconds)
    assert sorted(pid for pid, prop in PROPERTIES.items() if prop.nodes is not None) == sorted(NODE_CASES)
    for pid in NODE_CASES:
        assert len(node_cases(pid, "fixtures.specimens:Correct")[1]) == NODE_CASES[pid]
    (noisy,) = node_cases("noise_calibration", "fixtures.specimens:Correct")[1]
    spec = noisy.spec
    assert spec.poisson and spec.lr > 0 and spec.noise_multiplier > 0 and spec.steps >= 2
    # C between the dataset's norms: some samples clipped, some not
    from dpfsdp_verify.properties.analysis.compare import reference_norms
    norms = reference_norms(spec)
    assert float(norms.min()) < spec.max_grad_norm < float(norms.max())
    off = _options("fixtures.specimens:Correct", "--node-world-size", "0")
    assert off.node_world_size == 0
    assert PROPERTIES["norm_fidelity"].nodes_plan(PROPERTIES["norm_fidelity"].with_defaults(off)) == []
    # the plan carries them after the matrix and the 3-rank cases
    prop = PROPERTIES["sampling_accounting"]
    assert [c.world_size for c in prop.plan(prop.with_defaults(opts)) if isinstance(c, Case)][-1] == 4


@pytest.mark.parametrize("value", ["3", "5", "2", "-1"])
def test_a_node_world_size_that_is_not_two_nodes_of_two_is_a_usage_error(value):
    with pytest.raises(UsageError, match="--node-world-size"):
        _options("fixtures.specimens:Correct", "--node-world-size", value)


@pytest.mark.parametrize("specimen,pid,diagnosis,words", [
    ("NoiseHalvedFromRank3", "noise_calibration", "mismatch",
     ("PRIVACY VIOLATION: too little noise", "on rank 3's shard", "world_size=4")),
    ("NoiseSeedFromNodeRanks", "noise_calibration", "dependent_noise",
     ("on rank 2's shard repeats the noise of step 0 on rank 1's", "world_size=4")),
    ("NormsAllReducedFrom4Ranks", "norm_fidelity", "sample_mixing", ("at world_size=4", "root-sum-square")),
    ("Rank2SamplesAtOneAndHalfQ", "sampling_accounting", "wrong_sample_rate",
     ("at world_size=4", "rank 2 includes its own samples at rate")),
])
def test_rank_specimens_fail_the_node_cases(pool, specimen, pid, diagnosis, words):
    own, ledger = judged(pool, pid, R + specimen)
    bad = [v for v in own if v.status != "pass"]
    assert len(bad) == 1 and bad[0].status == "fail" and bad[0].diagnosis == diagnosis, [
        (v.status, v.diagnosis, v.message) for v in own]
    assert bad[0].property == pid and bad[0].config["world_size"] == 4
    for w in words:
        assert w in bad[0].message, bad[0].message
    # the node run's releases are judged once, by its own verdict: the ledger adds none of them
    assert not ledger.runs


@pytest.mark.parametrize("variant", ["fixtures.specimens:Correct"] + [
    pytest.param("fixtures.release_specimens:" + v, marks=pytest.mark.slow) for v in (
        "CorrectNoiseFromRankZero", "CorrectSqrtWsAveraged", "CorrectBoxMuller", "CorrectOneBufferSliced",
        "CorrectHashSeededSteps", "CorrectOsEntropySeeds", "CorrectNumpyPoisson", "CorrectGeometricGapPoisson",
        "CorrectDeterministicAlgorithms")])
def test_correct_passes_the_node_cases(pool, variant):
    for pid in NODE_CASES:
        own, _ = judged(pool, pid, variant)
        assert [v.status for v in own] == ["pass"] * len(own), [(v.config, v.message) for v in own]

"""clipped_step's Poisson cases judge 8 lr-0 steps beside their one step (``short_poisson_spec``):
one step's realised batch is a few samples, often all on one side of C, where a missing
``min(1, .)`` cannot show. At run seed 1 the default gate's ws=1 Poisson case draws a single,
clipped sample ("1 of 1 samples clipped"): ``NoClipMin`` passed its one step there; the 8 steps
fail it, naming the step; ``Correct`` passes both."""

from dpfsdp_verify.gate import cli
from dpfsdp_verify.gate.plan import RunPlan
from dpfsdp_verify.properties import PROPERTIES
from dpfsdp_verify.properties.clipping.clipped_step import SHORT_POISSON_STEPS
from dpfsdp_verify.properties.engine.contract import Case
from dpfsdp_verify.properties.engine.runner import judge_cases

PROP = PROPERTIES["clipped_step"]


def ws1_poisson_case(target):
    opts = RunPlan.from_args(cli.build_parser().parse_args(["run", "--target", target, "--seed", "1"])).options
    opts = PROP.with_defaults(opts)
    cases = [c for c in PROP.plan(opts) if isinstance(c, Case) and c.world_size == 1 and c.spec.poisson
             and "horizon" not in c.labels]
    assert cases and all(len(c.specs) == 2 and c.specs[1].steps == SHORT_POISSON_STEPS and c.specs[1].lr == 0.0
                         for c in cases)
    return cases[0]


def test_a_missing_clip_cap_fails_the_short_run_where_the_one_step_drew_only_clipped_samples(pool):
    bad, = judge_cases(PROP, [ws1_poisson_case("fixtures.specimens:NoClipMin")], pool, 120.0)
    assert (bad.status, bad.diagnosis) == ("fail", "mismatch"), bad.message
    assert bad.message.startswith(f"the one step passes; in the {SHORT_POISSON_STEPS} lr-0 steps run beside it")
    assert "from step" in bad.message
    good, = judge_cases(PROP, [ws1_poisson_case("fixtures.specimens:Correct")], pool, 120.0)
    assert good.status == "pass", good.message
    assert "1 of 1 samples clipped" in good.message  # the one step alone could not have told
    assert f"{SHORT_POISSON_STEPS} more steps at lr 0 each equal the reference" in good.message

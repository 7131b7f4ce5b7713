"""The whole-run release judge's own skip flag (``releases/judge.py`` ``SKIP_FACT``): a case that reads its
release its own way -- the privacy audit's canary run -- leaves its runs out of the judge with a reason,
instead of claiming ``releases_judged`` ("my property judges these releases with the judge's tests"), which
the audit does not. No ranks: synthetic runs (``tests/properties/test_releases.py``)."""

from dpfsdp_verify.gate import cli
from dpfsdp_verify.gate.plan import RunPlan
from dpfsdp_verify.properties import PROPERTIES
from dpfsdp_verify.properties.engine.contract import Case, Options
from dpfsdp_verify.properties.releases.judge import SKIP_FACT, Ledger, run_key
from tests.properties.test_releases import SPEC, fake_run


def test_a_skipped_run_is_not_decomposed_and_the_same_run_made_for_another_property_neither():
    bad = fake_run(SPEC, factor=lambda t, r: 0.5)
    judged = Ledger()
    judged.add(Case("trajectory", "x:Y", SPEC, 2), [[bad]])
    assert [v.status for v in judged.verdicts(Options())] == ["fail"]  # the run alone: too little noise
    ledger = Ledger()
    ledger.add(Case("privacy_audit", "x:Y", SPEC, 2, facts={SKIP_FACT: "read by the audit"}), [[bad]])
    ledger.add(Case("trajectory", "x:Y", SPEC, 2), [[bad]])  # the same run, made for another property
    assert ledger.verdicts(Options()) == [] and ledger.left_out == {run_key(2, SPEC): "read by the audit"}
    assert not ledger.owned  # not "judged by its own property with these tests"


def test_the_audit_leaves_its_run_out_with_a_reason_and_does_not_claim_to_judge_it():
    plan = RunPlan.from_args(cli.build_parser().parse_args(["run", "--target", "fixtures.specimens:Correct"]))
    prop = PROPERTIES["privacy_audit"]
    cases = [c for c in prop.plan(prop.with_defaults(plan.options)) if isinstance(c, Case)]
    assert cases and all("audit" in c.facts[SKIP_FACT] and "releases_judged" not in c.facts for c in cases)

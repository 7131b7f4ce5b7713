"""Post-processing is never a privacy violation (``analysis/postprocessing.py``): a release changed
after its noise -- the noisy gradient clipped to norm C (``ClipsNoisyGradient``) or rounded to
bfloat16 (``RoundsNoisyGradientToBf16``) -- fails ``noise_calibration`` as ``post_processed``, its
message saying the noise is there and the update was changed after it, never "PRIVACY VIOLATION";
the wrong implementations that leak (noise divided twice: too little noise) stay privacy violations;
``Correct`` passes (upstream opacus: ``test_upstream.py`` runs noise_calibration's default gate)."""

import dataclasses

import pytest
import torch

import dpfsdp_verify.properties as props
from dpfsdp_verify.properties import PROPERTIES
from dpfsdp_verify.properties.analysis import postprocessing as pp
from dpfsdp_verify.properties.wording.postprocessing import post_processing_message
from tests.verdict_helpers import assert_all_pass, message_problems

P = "fixtures.postprocessing_specimens:"
PROP = PROPERTIES["noise_calibration"]
#: noise_calibration's statistical verdicts on the warm ranks only (the exact, fresh, bf16, one-row
#: and long cases have other tests)
STATISTICAL = dataclasses.replace(PROP, cases=lambda point: [
    c for c in PROP.cases(point) if not c.fresh_groups and not c.facts.get("exact_only")
    and not c.facts.get("releases_judged") and c.spec.precision == "fp32"])


def releases(k, d=500, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randn(d, generator=g, dtype=torch.float64) * 0.1
    return [{"w": clean + scale * torch.randn(d, generator=g, dtype=torch.float64)} for _ in range(k)]


# -- the signatures (no ranks) ----------------------------------------------------------------------------
def test_honest_noise_shows_no_post_processing():
    for seed in range(20):
        rs = releases(24, d=50, seed=seed)
        noise = torch.cat([r["w"] for r in rs])
        assert pp.post_processing(rs, ["w"], "float64", noise) is None
        assert pp.post_processing(rs, ["w"], "float32", noise) is None


def test_a_norm_clip_of_the_noisy_release_is_pinned():
    rs = [{"w": r["w"] / (r["w"].norm() + 1e-6)} for r in releases(5)]  # clipped to C = 1 with an epsilon
    f = pp.pinned_norm(rs, ["w"], "float64")
    assert f is not None and f.kind == "norm_pinned" and f.releases == 5 and abs(f.value - 1) < 1e-5
    assert pp.pinned_norm(rs[:2], ["w"], "float64") is None  # two draws are not enough


def test_a_rounded_release_is_rounded_unless_the_noise_is_on_the_grid():
    rs = releases(3)
    clean = rs[0]["w"] - rs[0]["w"]  # a noise-0 run of zeros: the noise is the release itself
    rounded = [{"w": r["w"].to(torch.bfloat16).to(torch.float64)} for r in rs]
    off_grid = torch.cat([r["w"] - 0.1 * torch.ones_like(r["w"]) / 3 for r in rounded])
    f = pp.rounded(rounded, ["w"], "float64", off_grid)
    assert f is not None and f.grid == "bfloat16" and f.value == 1.0 and f.spread < 0.1
    # coarse noise on a zero gradient: the release alone cannot tell; the noise checks name it
    assert pp.rounded(rounded, ["w"], "float64", torch.cat([r["w"] + clean for r in rounded])) is None
    assert pp.rounded(rounded, ["w"], "float64", None) is None
    assert pp.rounded(rounded, ["w"], "bfloat16", off_grid) is None


def test_the_message_says_after_the_noise_and_privacy_intact():
    for f in (pp.PostProcessing("norm_pinned", 1.0, 3e-10, 24),
              pp.PostProcessing("rounded", 1.0, 0.02, 3, "bfloat16")):
        said = post_processing_message(f, "at world_size=1")
        assert "PRIVACY VIOLATION" not in said and "privacy intact" in said and "AFTER the noise" in said, said
        assert "post-processing" in said


# -- verdicts ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target, ws, diagnosis, words", [
    (P + "ClipsNoisyGradient", 1, "post_processed", "has global norm 1"),
    (P + "RoundsNoisyGradientToBf16", 1, "post_processed", "exactly representable in bfloat16"),
    # noise / N^2 instead of / N: right at one rank, too little noise at two
    ("fixtures.specimens:NoiseDividedTwice", 2, "mismatch", "PRIVACY VIOLATION: too little noise"),
    # pinned norms without noise: a leak, not post-processing
    (P + "ClipsUnnoisedGradient", 1, "mismatch", "PRIVACY VIOLATION: no noise"),
    ("fixtures.specimens:Correct", 1, None, None),
])
def test_post_processing_is_named_and_a_leak_stays_a_violation(pool, target, ws, diagnosis, words):
    vs = props.run(STATISTICAL, target, pool=pool, seed=17, timeout=120, world_sizes=(ws,), reductions=("mean",),
                   samplings=("fixed",))
    if diagnosis is None:
        assert_all_pass(vs)
        return
    assert [(v.status, v.diagnosis) for v in vs] == [("fail", diagnosis)], [(v.config, v.message) for v in vs]
    said = vs[0].message
    assert words in said and not message_problems(vs[0]), said
    if diagnosis == "post_processed":
        assert "PRIVACY VIOLATION" not in said and said.startswith("UTILITY LOSS (privacy intact)"), said


def test_the_suite_wide_word_check_flags_a_violation_said_of_post_processing():
    """``tests/conftest.py`` checks every verdict ``properties.run`` gives in the suite with this."""
    from dpfsdp_verify.verdict import Verdict

    from tests.verdict_helpers import is_post_processing, verdict_word_problems

    said = Verdict("noise_calibration", "fail", {}, message="PRIVACY VIOLATION: too little noise at world_size=1")
    assert is_post_processing(P + "ClipsNoisyGradient") and not is_post_processing("fixtures.specimens:Correct")
    assert verdict_word_problems(said, P + "ClipsNoisyGradient") == [
        "PRIVACY VIOLATION said of a post-processing specimen (privacy intact)"]
    assert verdict_word_problems(said, "fixtures.specimens:NoiseDividedTwice") == []
    assert not is_post_processing("no_such_module:X") and not is_post_processing("fixtures.nope:X")
    # one --mode-env per mode is how the CLI takes modes, not a doubled option
    modes = Verdict("mode_equivalence", "pass", {}, repro="dpfsdp-verify run --mode-env a:X=0 --mode-env b:X=1")
    assert verdict_word_problems(modes, "fixtures.specimens:Correct") == []
    # a call is not an empty list; a rank's empty list of local batches is
    call = Verdict("norm_fidelity", "fail", {}, message="add 'resume' to Target.features once run() saves")
    assert verdict_word_problems(call, "fixtures.specimens:Correct") == []
    shapes = Verdict("deadlock_free", "hang", {}, message="(rank 0: gloo:all_gather [[60]]; rank 1: gloo:barrier [])")
    assert verdict_word_problems(shapes, "fixtures.specimens:Correct") == []
    empty = Verdict("deadlock_free", "hang", {}, message="rank 1 ended its run after 0 step(s) (local batches [])")
    assert verdict_word_problems(empty, "fixtures.specimens:Correct") == ["empty list '[]'"]


def test_a_run_of_one_or_two_releases_is_pinned_at_its_c_or_a_norm_pinned_elsewhere():
    assert pp.pinned([1.0 - 1e-8], "float64", [0.5, 1.0]).value == 1.0
    assert pp.pinned([2.0, 2.0 * (1 + 1e-9)], "float64", [2.0]).releases == 2
    assert pp.pinned([1.0 - 1e-8], "float64") is None  # one value alone: nothing to compare it with
    assert pp.pinned([1.01], "float64", [1.0]) is None and pp.pinned([], "float64", [1.0]) is None

"""The held-out review of round 6 (issue 48, docs/review-r6.md): what it found, pinned.

``fixtures/review_r6_specimens.py`` was written against the public contract only and run through the
default gate at seed 4242. The cheap tests here (no ranks) pin the fixes of its misnamings on synthetic
runs built as ``tests/properties/test_releases.py`` builds them, each shaped like the specimen's runs;
the ones with ranks run one property at one or two world sizes; the full gate runs are slow-marked."""

import pytest
import torch

import dpfsdp_verify.properties as props
from dpfsdp_verify.properties import PROPERTIES
from dpfsdp_verify.properties.analysis import postprocessing as pp
from dpfsdp_verify.properties.releases.analysis import contrasts, decompose, run_tests
from dpfsdp_verify.properties.releases.signal import EITHER_LEAD
from dpfsdp_verify.properties.releases.wording import cause
from tests.properties.test_releases import ALPHA_TEST, SPEC, fake_run
from tests.verdict_helpers import assert_all_pass, message_problems

R6 = "fixtures.review_r6_specimens:"


# -- the release judge's causes (NoiseDivisorRoundedToPowerOfTwo: 3/4 of the noise at 3 ranks only) ------
def _three_rank_bug(ws):
    return 0.75 if ws == 3 else 1.0


def test_a_three_rank_only_ratio_is_not_blamed_on_the_dtype():
    """The float64 run at 3 ranks releases 3/4 of the noise; the float32 runs ran at 2 ranks (right). The
    gate said "only the float64 runs are off: the runs in other dtypes than float64 release 0.999 x"
    (the dtype contrast mixed world sizes); the world size is the axis that singles it out."""
    bad = SPEC.with_(steps=1, lr=0.0, global_batch_size=6)
    run = decompose(bad, 3, fake_run(bad, ws=3, factor=lambda t, r: _three_rank_bug(3)))
    f = run_tests(run, ALPHA_TEST)
    assert f.kind == "scale" and f.scope == "run" and 0.65 < f.ratio < 0.85, f
    others = []
    for seed, dtype in ((1, "float32"), (2, "float32"), (3, "float64")):
        spec = bad.with_(dtype=dtype)
        others.append(decompose(spec, 2, fake_run(spec, ws=2, seed=seed)))
    said = cause(run, f.ratio, contrasts(run, [run, *others], f))
    assert "dtype" not in said and "float64 runs are off" not in said, said
    assert "world size 3 only" in said, said


def test_the_dtype_is_still_named_where_the_same_world_size_contrasts_it():
    """Float32NoiseScaled's case: float32 at 0.7 x and float64 right, both at 2 ranks: the dtype is named."""
    f32 = SPEC.with_(steps=1, lr=0.0, dtype="float32")
    run = decompose(f32, 2, fake_run(f32, factor=lambda t, r: 0.7))
    f = run_tests(run, ALPHA_TEST)
    f64 = SPEC.with_(steps=1, lr=0.0)
    others = [decompose(f64, 2, fake_run(f64, seed=s)) for s in (1, 2)]
    assert "only the float32 runs are off" in cause(run, f.ratio, contrasts(run, [run, *others], f))


def test_one_factor_everywhere_is_not_a_noise_tied_to_the_batch_max_norm():
    """3/4 of the noise on every release, 2 of 6 local batches below C (at 0.6 C): scaled back by their
    largest norm the releases still fit at a Bonferroni alpha (the old rule's only test, which named this
    "the noise std follows min(C, the local batch's largest norm) / C"), but one constant ratio explains
    them far better; the real max-norm noise is still named."""
    from dpfsdp_verify.properties.analysis.stats import chi2_two_sided_p
    from dpfsdp_verify.properties.releases.analysis import Cell, max_norm_finding

    own = [1.0, 1.0, 1.0, 1.0, 0.6, 0.6]
    flat = [Cell(step=0, rank=r, ss=0.75 ** 2 * 50, df=50, total=0.0, var=1.0, own_max=m) for r, m in enumerate(own)]
    assert chi2_two_sided_p(sum(c.ss / c.own_max ** 2 for c in flat), 300) >= 1e-7  # the old rule's test passes
    assert max_norm_finding(flat, 0.75, 1e-10, 1e-7) is None
    tied = [Cell(step=0, rank=c.rank, ss=c.own_max ** 2 * 50, df=50, total=0.0, var=1.0, own_max=c.own_max)
            for c in flat]
    found = max_norm_finding(tied, 0.9, 1e-10, 1e-7)
    assert found is not None and found.scope == "max_norm" and found.ranks == (4, 5), found


# -- sensitivity_bound on a release rounded after the sum ----------------------------------------------------
def test_a_release_on_a_coarse_grid_is_found_and_its_rounding_bounded():
    g = torch.Generator().manual_seed(0)
    full = torch.randn(600, generator=g, dtype=torch.float64)
    withouts = [full - 0.01 * torch.randn(600, generator=g, dtype=torch.float64) for _ in range(3)]
    assert pp.grid_rounding(full, withouts, 4.0, "float64") is None
    rounded = pp.grid_rounding(full.to(torch.bfloat16).double(), [w.to(torch.bfloat16).double() for w in withouts],
                               4.0, "float64")
    assert rounded is not None and rounded.grid == "bfloat16" and rounded.share == 1.0
    assert all(abs(b - 4.0 * 2 ** -8 * 2 * float(full.norm())) < 0.05 * b for b in rounded.bounds)
    assert pp.coarse_grid(full.to(torch.float16).double(), "float64") == ("float16", 1.0)
    assert pp.coarse_grid(full.to(torch.bfloat16).double(), "bfloat16") is None  # a bf16 run is on its own grid


@pytest.mark.parametrize("target, rounded", [("fixtures.postprocessing_specimens:RoundsNoisyGradientToBf16", True),
                                             (R6 + "RoundsNoisyGradientToFp16", True),
                                             ("fixtures.specimens:Correct", False)])
def test_sensitivity_of_a_rounded_release_is_said_both_ways(pool, target, rounded):
    """At noise 0 the leave-one-out (and the extreme samples' read-back) contributions exceed C by the
    rounding only: the gate said "PRIVACY VIOLATION" 6 times (and "contributes inf x C" where the
    read-back's residual was the rounding); now both readings, never a bare violation."""
    vs = props.run(PROPERTIES["sensitivity_bound"], target, pool=pool, seed=4242, timeout=120, world_sizes=(1,))
    if not rounded:
        assert_all_pass(vs)
        return
    assert vs and all(v.status == "fail" and v.diagnosis == "mismatch" for v in vs), [(v.status, v.message) for v in vs]
    for v in vs:
        assert "PRIVACY VIOLATION" not in v.message and "Two readings" in v.message, v.message
        assert "post-processing" in v.message and not message_problems(v), v.message


# -- the accountant asked by one process with histories that differ in one component each ------------------
def test_an_epsilon_cached_without_sigma_in_its_key_fails_history_twice(pool):
    """``EpsilonCacheKeyedBySteps`` (a cache by (steps, delta)) passed the gate: ``history_twice``'s runs
    differed in their steps only. Its third run (5 steps at another sigma) gets the second's epsilon: over-
    reported (the cached run had less noise), privacy intact; a more-orders RDP accountant passes."""
    [v] = props.run("deadlock_free", R6 + "EpsilonCacheKeyedBySteps", pool=pool, world_sizes=(1,),
                    local_batches=("history_twice",), timeout=240)
    assert (v.status, v.diagnosis) == ("fail", "epsilon_over_reported"), v.message
    assert "[(2.3, 0.25, 5)]" in v.message and "PRIVACY VIOLATION" not in v.message, v.message
    [v] = props.run("deadlock_free", R6 + "MoreRdpOrders", pool=pool, world_sizes=(1,),
                    local_batches=("history_twice",), timeout=240)
    assert v.status == "pass" and "[2, 5, 5, 5] step(s)" in v.message, v.message


# -- a bug only exploration reaches, where it reaches it ----------------------------------------------------
@pytest.mark.slow
def test_noise_capped_at_sigma_3_fails_an_explored_draw_at_sigma_4(pool):
    """``NoiseMultiplierCappedAt3`` passed the gate at seed 4242: its 4 draws of deadlock_free drew sigma
    0.5, 2.55, 2.28, 0.53 (docs/review-r6.md). An explored noisy draw at sigma 3.8 feeds the release judge
    (as in a gate run) and fails it as too little noise (3/3.8 of sigma*C); Correct passes the same draw."""
    from dpfsdp_verify.fuzz.explore import check_exact
    from dpfsdp_verify.properties.engine.contract import Options
    from dpfsdp_verify.properties.engine.session import Session
    from dpfsdp_verify.properties.releases import judge as releases
    from dpfsdp_verify.targets import RunSpec

    prop = PROPERTIES["deadlock_free"]
    spec = prop.explore.prepare(RunSpec(global_batch_size=8, lr=0.0, steps=4),
                                {"noise_multiplier": 3.8, "clip_quantile": 0.5})
    found = {}
    for target in ("fixtures.specimens:Correct", R6 + "NoiseMultiplierCappedAt3"):
        ledger = releases.Ledger()
        opts = Options(target=target, timeout=240)
        assert check_exact(prop, opts, spec, 2, pool, session=Session(ledger)).status == "pass"
        found[target] = [v for v in ledger.verdicts(prop.with_defaults(opts)) if v.status != "pass"]
    assert found["fixtures.specimens:Correct"] == [], [v.message for v in found["fixtures.specimens:Correct"]]
    bad = found[R6 + "NoiseMultiplierCappedAt3"]
    # too little noise; where the release's factor on the signal cannot rule out a rescale after the noise
    # (releases/signal.py: at sigma 3.8 and a batch of 8 it is read to +- ~0.4), both readings -- never
    # post-processing alone
    assert bad and all(v.diagnosis == "mismatch" and ("PRIVACY VIOLATION: too little noise" in v.message or
                                                      v.message.startswith(EITHER_LEAD)) for v in bad), [
        v.message for v in bad]


# -- each wrong implementation the gate caught, on the cases that caught it ---------------------------------
def _ws(n):
    return lambda c: c.world_size == n


def _bf16_at(n):
    return lambda c: c.world_size == n and c.spec.precision != "fp32"


def _twice(c):
    return c.labels.get("local_batches") == "history_twice"


#: (specimen, property planned, the cases run, diagnosis, words its message has, words it must not have)
CAUGHT = [
    # the release judge's run at 3 ranks: "too little noise, OR ... rescaled after the noise" where its signal
    # cannot tell (releases/signal.py); the cause, world size 3, named either way
    pytest.param("NoiseDivisorRoundedToPowerOfTwo", "noise_calibration", _ws(3), "mismatch",
                 "too little noise", "only the float64 runs are off", marks=pytest.mark.slow),
    ("ResumedFirstStepUnnoised", "checkpoint_resume", _ws(1), "mismatch", "load half of a resumed run", "UTILITY"),
    ("Bf16NoiseOnRankZeroOnly", "noise_calibration", _bf16_at(2), "mismatch", "PRIVACY VIOLATION: no noise", "UTILITY"),
    pytest.param("HalvedDeltaTermConversion", "deadlock_free", _twice, "epsilon_under_reported", "below",
                 "over-reported", marks=pytest.mark.slow),
    ("ResumeRestoresHistoryAtDoubleSigma", "checkpoint_resume", _ws(1), "epsilon_under_reported",
     "told noise multiplier(s) 2", "over-reported"),
    pytest.param("UniformNoiseRightVariance", "noise_calibration", _ws(1), "non_gaussian_noise", "bounded", "UTILITY",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name, pid, select, diagnosis, words, never", CAUGHT)
def test_the_caught_ones_fail_with_their_cause(pool, name, pid, select, diagnosis, words, never):
    from tests.properties.test_release_specimens import judged

    own, found = judged(pool, pid, R6 + name, select)
    bad = [v for v in own + found if v.status != "pass"]
    assert bad and all(v.status == "fail" for v in bad), [(v.status, v.message) for v in bad]
    named = [v for v in bad if v.diagnosis == diagnosis and words in v.message]
    assert named, [(v.diagnosis, v.message[:300]) for v in bad]
    assert all(never not in v.message and not message_problems(v) for v in bad), [v.message for v in bad]


@pytest.mark.slow
def test_noise_reused_on_one_tensor_is_not_called_a_generator_re_seeded_every_step(pool):
    """``NoiseReusedOnFirstParameter``: fc1.weight's noise is reused every other step, the other tensors are
    fresh. The gate said "the generator is re-seeded every step, so each release repeats the last one's
    noise" (the cause of ``fixtures.specimens:NoiseReusedAcrossSteps``, which still says it); now the extent
    of the repeats is stated and the cause fits it."""
    from tests.verdict_helpers import without_extra_noise_cases

    for target, words in ((R6 + "NoiseReusedOnFirstParameter", "noise reused for some releases only: 1 of 6 tensor(s)"),
                          ("fixtures.specimens:NoiseReusedAcrossSteps", "re-seeded every step")):
        [v] = props.run(without_extra_noise_cases(), target, pool=pool, world_sizes=(2,), models=("mlp",),
                        reductions=("mean",), dtypes=("float64",), samplings=("fixed",), timeout=120)
        assert (v.status, v.diagnosis) == ("fail", "dependent_noise"), v.message
        assert "identical at steps 0 and 1" in v.message and words in v.message, v.message
        if target.startswith(R6):
            assert "re-seeded every step, so" not in v.message, v.message


# -- noise on a parameter with fewer rows than ranks, tested on its own -------------------------------------
def test_few_row_noise_scale_is_tested_on_its_own(pool):
    """``FewRowsNoiseDividedByRanks`` (std / N on a parameter with fewer rows than ranks) passed the gate:
    the one-row case made exact checks only, and the release judge pools fc2's 65 coordinates with 2240
    others. Its scale is now tested per few-row tensor: too little noise on 'fc2.weight'; Correct and the
    unnoised variant (still named "no noise") as before. ``RescalesNoisyGradient`` (the whole noisy release
    x 0.5) was called a privacy violation there: every tensor's noise is short alike and the case has no
    signal to read the factor from, so the message says both readings."""
    import dataclasses

    prop = PROPERTIES["noise_calibration"]
    one_row = dataclasses.replace(prop, cases=lambda point: [
        c for c in prop.cases(point) if c.facts.get("exact_only") and dict(c.spec.model_kwargs).get("classes") == 1])
    expect = {"fixtures.specimens:Correct": (None, "no noise value repeated"),
              R6 + "FewRowsNoiseDividedByRanks": ("mismatch", "PRIVACY VIOLATION: too little noise on 'fc2.weight', "
                                                  "a parameter with fewer rows than the 2 ranks"),
              "fixtures.tail_specimens:FewRowsUnnoised": ("mismatch", "PRIVACY VIOLATION: no noise on 1 of 1"),
              # every tensor short alike and no signal in this case (one class: a zero gradient): a rescale
              # after the noise (post-processing) or noise too small everywhere, said both ways
              R6 + "RescalesNoisyGradient": ("mismatch", EITHER_LEAD + " on 'fc2.weight'")}
    for target, (diagnosis, words) in expect.items():
        [v] = props.run(one_row, target, pool=pool, world_sizes=(2,), timeout=120)
        assert v.diagnosis == diagnosis and words in v.message, (target, v.message)
        assert v.status == ("pass" if diagnosis is None else "fail"), v.message


def test_few_row_scales_of_correct_noise_pass_at_the_stated_bound():
    """No ranks: 2000 draws of correct noise on a 65-coordinate one-row layer never reach the case's alpha
    (the bound is 1e-7: none of 2000 is expected below it); std / 2 on its 64 weights does in 94 % of them
    (measured: 1880 of 2000; the power of one draw on 64 coordinates)."""
    from dpfsdp_verify.properties.noise import few_rows

    g = torch.Generator().manual_seed(3)
    ok = bad = 0
    for _ in range(2000):
        z = {"fc2.weight": torch.randn(1, 64, generator=g, dtype=torch.float64),
             "fc2.bias": torch.randn(1, generator=g, dtype=torch.float64)}
        found = few_rows.few_row_scales([[z]], ["fc2.bias", "fc2.weight"], 1.0, 2)
        ok += all(p >= few_rows.ALPHA / len(found) for _, _, _, p in found)
        half = few_rows.few_row_scales([[{n: t / 2 for n, t in z.items()}]], ["fc2.weight"], 1.0, 2)
        bad += half[0][3] < few_rows.ALPHA
    assert ok == 2000 and bad >= 1800, (ok, bad)


# -- post-processing: the noisy gradient rescaled after the noise ----------------------------------------------
@pytest.mark.slow
def test_a_rescaled_noisy_gradient_is_post_processing(pool):
    """``RescalesNoisyGradient`` (the noisy gradient x 0.5 before the step) was called "PRIVACY VIOLATION: too
    little noise" by noise_calibration (noise 0.5 x sigma*C/D): its noise-0 release is exactly 0.5 x the
    reference too, so signal and noise are scaled alike -- post-processing. Noise alone too small (std / N^2
    at 2 ranks) stays a violation; Correct passes."""
    from tests.properties.test_postprocessing import STATISTICAL

    for target, ws, diagnosis, words in (
            (R6 + "RescalesNoisyGradient", 1, "post_processed", "multiplied by 0.5 after the noise"),
            ("fixtures.specimens:NoiseDividedTwice", 2, "mismatch", "PRIVACY VIOLATION: too little noise"),
            ("fixtures.specimens:Correct", 1, None, "")):
        vs = props.run(STATISTICAL, target, pool=pool, seed=17, timeout=120, world_sizes=(ws,), reductions=("mean",),
                       samplings=("fixed",))
        assert [(v.status, v.diagnosis) for v in vs] == [("pass" if diagnosis is None else "fail", diagnosis)], [
            v.message for v in vs]
        assert words in vs[0].message and not message_problems(vs[0]), vs[0].message


def test_a_rescaled_noisy_gradient_is_post_processing_under_bf16_too(pool):
    """``RescalesNoisyGradient`` at 2 ranks under bf16-fsdp was "PRIVACY VIOLATION: too little noise on
    'fc1.bias'": its noise-0 release is 0.4992 x the reference with a bf16 residual of 6e-3, over the
    float32 bound of 1e-3 (``postprocessing.RESCALE_RESIDUAL_MIXED``). Correct passes the same case."""
    import dataclasses

    prop = PROPERTIES["noise_calibration"]
    bf16 = dataclasses.replace(prop, cases=lambda point: [
        c for c in prop.cases(point) if getattr(c.spec, "precision", "fp32") == "bf16-fsdp" and c.world_size == 2])
    for target, diagnosis, words in ((R6 + "RescalesNoisyGradient", "post_processed", "after the noise"),
                                     ("fixtures.specimens:Correct", None, "")):
        vs = [v for v in props.run(bf16, target, pool=pool, world_sizes=(2,), timeout=180, seed=6001)
              if v.property == "noise_calibration" and "releases" not in v.config]
        assert vs and all((v.status, v.diagnosis) == ("pass" if diagnosis is None else "fail", diagnosis)
                          for v in vs), [v.message for v in vs]
        assert all(words in v.message and "PRIVACY VIOLATION" not in v.message for v in vs), [v.message for v in vs]


def _one_row(c):
    return c.world_size == 2 and c.facts.get("exact_only") and dict(c.spec.model_kwargs).get("classes") == 1


@pytest.mark.parametrize("target, rounded", [("fixtures.postprocessing_specimens:RoundsNoisyGradientToBf16", True),
                                             (R6 + "RoundsNoisyGradientToFp16", True),
                                             ("fixtures.release_specimens:NoiseDrawnInFloat16", False)])
@pytest.mark.slow
def test_a_release_on_a_grid_is_said_both_ways_where_the_run_cannot_tell(pool, target, rounded):
    """The release judge on the one-row case's run: the released values themselves lie on the grid, and the
    judge has no noise-0 twin to tell a rounding after the noise from noise on the grid added to a clean part
    on it too (at lr 0 and sigma 2.5 both put every released value of the one-row mlp on the grid: measured,
    NoiseDrawnInFloat16 too). The gate said "PRIVACY VIOLATION: the released noise lies on the float16 grid"
    (3 verdicts of RoundsNoisyGradientToBf16); now both readings. noise_calibration's statistical case, with
    the twin, tells a rounding after the noise apart: post_processed."""
    from tests.properties.test_postprocessing import STATISTICAL
    from tests.properties.test_release_specimens import judged

    _, found = judged(pool, "noise_calibration", target, _one_row)
    bad = [v for v in found if v.status != "pass"]
    assert bad and all("Two readings" in v.message and "PRIVACY VIOLATION" not in v.message for v in bad), [
        v.message for v in found]
    if rounded:  # (NoiseDrawnInFloat16's violation: test_release_specimens.test_noise_drawn_in_float16_is_on_a_grid)
        [v] = props.run(STATISTICAL, target, pool=pool, seed=17, timeout=120, world_sizes=(1,), reductions=("mean",),
                        samplings=("fixed",))
        assert (v.status, v.diagnosis) == ("fail", "post_processed") and "PRIVACY VIOLATION" not in v.message, v.message


# -- the layer options of the zoo, named ----------------------------------------------------------------------
@pytest.mark.parametrize("target, words", [
    (R6 + "ConvNormCountsMissingBias", "count a bias term for the Conv3d layer 'conv3d'"),
    # both escaped or went unnamed at seed 4242: the zoo's batch held no padding token; no hypothesis named
    # a LayerNorm without affine parameters
    (R6 + "EmbeddingPaddingRowCounted", "padding row (padding_idx 0) of the Embedding 'tok'"),
    (R6 + "LayerNormWithoutAffineCounted", "a weight and a bias for the LayerNorm 'ln_plain'"),
    ("fixtures.specimens:Correct", None)])
def test_layer_option_norms_are_named(pool, target, words):
    vs = props.run("norm_fidelity", target, pool=pool, world_sizes=(1,), models=("zoo",), reductions=("mean",),
                   dtypes=("float64",), samplings=("fixed",), timeout=120)
    if words is None:
        assert_all_pass(vs)
        return
    assert vs and all((v.status, v.diagnosis) == ("fail", "mismatch") and words in v.message
                      and "utility loss" in v.message and "PRIVACY VIOLATION" not in v.message for v in vs), [
        v.message for v in vs]


# -- a clamp at 5 sigma: beyond the gate's sample size --------------------------------------------------------
def test_noise_clamped_at_5_sigma_is_found_only_with_enough_values():
    """``ClampedNoise5Sigma`` passed the gate: the clamp touches 5.7e-7 of the values, and a noise_calibration
    verdict pools ~1.6e5 (about one clamped value in eleven verdicts). With 2e7 values the repeated boundary
    value is found (p far below any alpha); at the gate's 1.6e5 it is not: a detection limit, stated in
    docs/review-r6.md, not a check that fails to look."""
    from dpfsdp_verify.properties.analysis import noise_tails
    from fixtures.review_r6_specimens import ClampedNoise5Sigma

    target = ClampedNoise5Sigma()
    target.generator = torch.Generator().manual_seed(0)
    z = target.noise(torch.zeros(20_000_000, dtype=torch.float64), 1.0, torch.Size([20_000_000]))
    many = noise_tails.tails({"w": z.unsqueeze(0)}, ["w"], 1.0, 1e-12)
    assert many.failed(1e-7) == "boundary" and many.top == 5.0, many
    few = noise_tails.tails({"w": z[:160_000].unsqueeze(0)}, ["w"], 1.0, 1e-12)
    assert few.failed(1e-7) is None, few


# -- the correct variants, right in fact (no ranks) -----------------------------------------------------------
@pytest.mark.parametrize("variant", ["BroadcastPoissonMask", "BinomialThenSubset"])
def test_correct_samplers_draw_independent_bernoulli_q_inclusions(variant):
    """Each sample's inclusion frequency is q and a local batch's size is Binomial(n, q) (each bound 6
    standard errors; seeded), and a restored generator state continues the stream."""
    import math

    from dpfsdp_verify.targets.base import RunSpec
    from fixtures import review_r6_specimens

    target = getattr(review_r6_specimens, variant)()
    spec = RunSpec(sampling="poisson", sample_rate=0.25, dataset_size=32, seeding="per_rank")
    n, q, draws = 16, 0.25, 4000
    target._mask_at = (1, 2, 32)  # rank 1 of 2 over 32 samples (what ``draws`` records)
    g = target.sampling_generator(spec, 1)
    masks = target.masks(g, n, q)
    m = torch.stack([next(masks) for _ in range(draws)]).to(torch.float64)
    assert (m.mean(0) - q).abs().max() < 6 * math.sqrt(q * (1 - q) / draws), m.mean(0)
    assert abs(m.sum(1).var().item() - n * q * (1 - q)) < 0.15 * n * q * (1 - q)
    state = g.get_state()
    ahead = [next(masks) for _ in range(3)]
    g.set_state(state)
    again = target.masks(g, n, q)
    assert all(torch.equal(a, next(again)) for a in ahead)


def test_inverse_cdf_noise_is_standard_gaussian():
    """4e6 draws: mean, std, excess kurtosis and the mass beyond 3 and 4 sigma within 6 standard errors."""
    import math

    from fixtures.review_r6_specimens import InverseCdfFloat64Noise

    target = InverseCdfFloat64Noise()
    target.generator = torch.Generator().manual_seed(1)
    n = 4_000_000
    z = target.noise(torch.zeros(n, dtype=torch.float64), 1.0, torch.Size([n]))
    assert abs(float(z.mean())) < 6 / math.sqrt(n) and abs(float(z.std()) - 1) < 6 / math.sqrt(2 * n)
    assert abs(float(z.pow(4).mean()) - 3) < 6 * math.sqrt(96 / n)
    for k in (3.0, 4.0):
        p = math.erfc(k / math.sqrt(2))
        assert abs(int((z.abs() > k).sum()) - n * p) < 6 * math.sqrt(n * p), k

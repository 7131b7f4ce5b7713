"""The whole-run release judge (properties/releases/analysis.py, releases/judge.py) on synthetic
runs built in this process with the reference DP-SGD step (no ranks: fast), and the accountant
checked on every run (engine/prechecks.accountant_history_problem).

Each bug's effect is injected into the released noise exactly as the specimens in
fixtures/release_specimens.py inject it; the end-to-end gate runs of those specimens are in
tests/test_release_specimens.py (slow)."""

import copy
import math

import torch

from dpfsdp_verify import reference
from dpfsdp_verify.properties.analysis.compare import reference_batch, reference_model
from dpfsdp_verify.properties.releases.analysis import SILENT_P0, decompose, run_tests, shard_index, silent
from dpfsdp_verify.properties.engine.contract import Case, Options
from dpfsdp_verify.properties.engine.prechecks import accountant_history_problem
from dpfsdp_verify.properties.releases.judge import ALPHA, Ledger
from dpfsdp_verify.targets import RankOutput, RunSpec, StepOutput, accounting

ALPHA_TEST = 1e-6


def fake_run(spec, ws=2, factor=lambda step, rank: 1.0, transform=None, seed=0, clip_eps=reference.CLIP_EPSILON,
             silent=lambda step, name: False):
    """Rank outputs of ``spec``: the reference DP-SGD step at every step (plain SGD at spec.lr),
    each rank's shard of the noise scaled by ``factor(step, rank)`` and passed through ``transform``;
    no noise at all on tensor ``name`` at ``step`` where ``silent(step, name)``."""
    model = copy.deepcopy(reference_model(spec))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(seed)
    outs = [RankOutput(rank=r, world_size=ws) for r in range(ws)]
    for t in range(spec.steps):
        batch = reference_batch(spec, t)
        idx = list(range(spec.global_batch_size))
        step = reference.dp_sgd_gradient(model, batch, max_grad_norm=spec.max_grad_norm, reduction=spec.reduction,
                                         expected_batch_size=spec.expected_batch_size, clip_epsilon=clip_eps)
        grad = {}
        for n in names:
            noise = torch.randn(step.clipped_sum[n].shape, generator=g, dtype=torch.float64)
            noise = noise * spec.noise_multiplier * spec.max_grad_norm
            chunks = list(torch.chunk(noise, ws, dim=0))
            noise = torch.cat([c * factor(t, r) for r, c in enumerate(chunks)]) if noise.dim() else noise
            if transform is not None:
                noise = transform(noise)
            if silent(t, n):
                noise = torch.zeros_like(noise)
            grad[n] = ((step.clipped_sum[n] + noise) / spec.divisor).to(spec.torch_dtype).to(torch.float64)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in grad:
                    p -= spec.lr * grad[n]
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        for r, o in enumerate(outs):
            o.steps.append(StepOutput(indices=idx[r::ws], norms=None, loss=0.0, gradient=grad, parameters=params))
    return outs


SPEC = RunSpec(steps=6, global_batch_size=8, noise_multiplier=1.0, lr=0.5, max_grad_norm=1.0)


def test_shard_index_is_fsdp_chunks():
    idx = shard_index([torch.Size([3, 2]), torch.Size([5])], 2)
    assert idx[0].tolist() == [0, 1, 2, 3, 6, 7, 8] and idx[1].tolist() == [4, 5, 9, 10]


def test_correct_noise_passes_at_lr_and_mid_clip():
    for spec in (SPEC, SPEC.with_(max_grad_norm=4.7, dtype="float32"), SPEC.with_(lr=0.0, reduction="sum")):
        run = decompose(spec, 2, fake_run(spec))
        assert run is not None and len(run.cells) == 2 * spec.steps
        assert run_tests(run, ALPHA_TEST) is None, spec
        ratio = math.sqrt(sum(c.ss for c in run.cells) / sum(c.df for c in run.cells))
        assert 0.8 < ratio < 1.2


def test_clip_form_does_not_read_as_noise():
    """A target clipping with another epsilon (or no min(1, .) at all) differs from the reference in the
    span of the batch's per-sample gradients only: never a noise finding."""
    spec = SPEC.with_(max_grad_norm=4.7)
    assert run_tests(decompose(spec, 2, fake_run(spec, clip_eps=0.0)), ALPHA_TEST) is None
    spec = SPEC.with_(max_grad_norm=100.0)  # nothing clipped
    assert run_tests(decompose(spec, 2, fake_run(spec)), ALPHA_TEST) is None


def test_scale_lr_and_rank_and_late():
    f = run_tests(decompose(SPEC, 2, fake_run(SPEC, factor=lambda t, r: 0.5)), ALPHA_TEST)
    assert f.kind == "scale" and f.scope == "run" and 0.4 < f.ratio < 0.6
    f = run_tests(decompose(SPEC, 2, fake_run(SPEC, factor=lambda t, r: 0.3 if r == 1 else 1.0)), ALPHA_TEST)
    assert f.kind == "scale" and f.scope == "rank" and f.ranks == (1,)
    spec = SPEC.with_(steps=12)
    f = run_tests(decompose(spec, 2, fake_run(spec, factor=lambda t, r: 0.3 if t >= 8 else 1.0)), ALPHA_TEST)
    assert f.kind == "scale" and f.scope == "from" and f.steps[0] == 8


def test_float16_grid_and_repeat():
    f = run_tests(decompose(SPEC, 2, fake_run(SPEC, transform=lambda n: n.to(torch.float16).to(torch.float64))),
                  ALPHA_TEST)
    assert f.kind == "grid" and f.detail == "float16"
    spec = SPEC.with_(dtype="float32")
    f = run_tests(decompose(spec, 2, fake_run(spec, transform=lambda n: n.to(torch.bfloat16).to(torch.float64))),
                  ALPHA_TEST)
    assert f.kind == "grid" and f.detail == "bfloat16"
    fixed = torch.Generator().manual_seed(5)
    cache = {}

    def same(n):  # the same noise at every step (a generator re-seeded per step)
        key = tuple(n.shape)
        if key not in cache:
            cache[key] = torch.randn(n.shape, generator=fixed, dtype=torch.float64)
        return cache[key]
    f = run_tests(decompose(SPEC.with_(lr=0.0), 2, fake_run(SPEC.with_(lr=0.0), transform=same)), ALPHA_TEST)
    assert f.kind == "repeat"


def test_coordinates_released_without_noise_are_named_with_their_tensor_and_steps():
    """A bias left out of the noise from step 8 on (a few of the model's coordinates: no scale test
    moves) is the exact ``silent`` finding naming the tensor and the steps, at lr 0.5 and 0, in float64
    and float32; one tensor silent in a single release is named too, and one silent at every step."""
    spec = SPEC.with_(steps=12)
    for s in (spec, spec.with_(lr=0.0), spec.with_(dtype="float32")):
        run = decompose(s, 2, fake_run(s, silent=lambda t, n: t >= 8 and n == "fc2.bias"))
        f = run_tests(run, ALPHA_TEST)
        assert f.kind == "silent" and f.steps == tuple(range(8, 12)) and "'fc2.bias'" in f.detail, (s, f)
        assert "5 of 5 coordinates" in f.detail and set(f.ranks) == {0, 1}
        run.silent = None  # without it: nothing else sees 10 of 324 coordinates unnoised in 4 of 12 steps
        assert run_tests(run, ALPHA_TEST) is None
    two = SPEC.with_(steps=2)
    f = run_tests(decompose(two, 2, fake_run(two, silent=lambda t, n: t == 1 and n == "norm.weight")), ALPHA_TEST)
    assert f.kind == "silent" and f.steps == (1,) and "'norm.weight'" in f.detail
    lr0 = SPEC.with_(lr=0.0)
    run = decompose(lr0, 2, fake_run(lr0, silent=lambda t, n: n == "fc1.bias"))  # every step
    f = run_tests(run, ALPHA_TEST)
    assert f.kind == "silent" and f.steps == tuple(range(6)) and "'fc1.bias'" in f.detail


def test_silent_values_of_correct_noise_are_not_named():
    """Correct noise over long runs: values within 1e-3 sigma C of 0 occur (~8e-4 of them), never as
    many as ``silent`` names (the gate's long-run layout, 72 steps x 2 ranks, 300 runs)."""
    g = torch.Generator().manual_seed(1)
    layout = [[("fc1.bias", 6), ("fc1.weight", 36), ("fc2.bias", 5), ("fc2.weight", 55)]] * 2
    seen = 0
    for _ in range(300):
        cells = [(t, r, torch.randn(102, generator=g, dtype=torch.float64)) for t in range(72) for r in range(2)]
        seen += sum(int((v.abs() < 1e-3).sum()) for _, _, v in cells)
        assert silent(cells, layout) is None
    assert 0.5 < seen / (300 * 144 * 102 * SILENT_P0) < 1.5  # the near-zero values are there


def test_ledger_verdicts_name_the_run():
    spec = SPEC.with_(dtype="float32")
    ledger = Ledger()
    case = Case("trajectory", "fixtures.specimens:Correct", spec, 2)
    ledger.add(case, [[fake_run(spec, factor=lambda t, r: 0.7)]])
    ledger.add(Case("deadlock_free", "x:Y", SPEC, 2), [[fake_run(SPEC)]])
    out = ledger.verdicts(Options())
    fails = [v for v in out if v.status == "fail"]
    assert len(fails) == 1 and fails[0].property == "noise_calibration" and fails[0].diagnosis == "mismatch"
    assert fails[0].config["releases"] == "trajectory" and fails[0].config["dtype"] == "float32"
    assert "float32" in fails[0].message and "sqrt" not in fails[0].message
    assert "only the float32 runs are off" in fails[0].message
    assert "--properties trajectory,noise_calibration" in fails[0].repro
    ok = Ledger()
    ok.add(case, [[fake_run(spec)]])
    (v,) = ok.verdicts(Options())
    assert v.status == "pass" and v.config["releases"] == "every run" and f"{ALPHA:.2g}"[:1] in v.message


def _with_history(outs, history, eps=None):
    for o in outs:
        o.accountant, o.accountant_history, o.epsilon = "rdp", history, eps
    return outs


def test_accountant_history_on_every_run():
    spec = RunSpec(steps=4, sampling="poisson", sample_rate=0.25, dataset_size=16, epochs=1, noise_multiplier=1.0)
    outs = [RankOutput(0, 1, steps=[StepOutput([0], None, 0.0) for _ in range(4)])]
    assert accountant_history_problem(spec, _with_history(outs, [(1.0, 0.25, 4)])) is None
    d, msg, _ = accountant_history_problem(spec, _with_history(outs, [(1.0, 0.25, 3)]))
    assert d == "accountant_mismatch" and "told 3 step(s)" in msg
    d, msg, _ = accountant_history_problem(spec, _with_history(outs, [(1.0, 0.125, 4)]))
    assert "sampling rate" in msg and "0.5 x q" in msg
    load = spec.with_(resume_at=2, phase="load", checkpoint_dir="x")
    two = [RankOutput(0, 1, steps=[StepOutput([0], None, 0.0) for _ in range(2)])]
    assert accountant_history_problem(load, _with_history(two, [(1.0, 0.25, 4)])) is None
    assert "starts again at the resume" in accountant_history_problem(load, _with_history(two, [(1.0, 0.25, 2)]))[1]
    assert "twice" in accountant_history_problem(load, _with_history(two, [(1.0, 0.25, 6)]))[1]
    asked = spec.with_(accountant_delta=1e-5)
    want = accounting.epsilon([(1.0, 0.25, 4)], 1e-5)
    assert accountant_history_problem(asked, _with_history(outs, [(1.0, 0.25, 4)], want)) is None
    assert "epsilon" in accountant_history_problem(asked, _with_history(outs, [(1.0, 0.25, 4)], want / 2))[1]


def test_noise_tied_to_the_local_batch_max_norm_is_named():
    spec = SPEC.with_(max_grad_norm=100.0, lr=0.0)  # every local batch below C
    model = reference_model(spec)
    grads = reference.per_sample_grads(model, reference_batch(spec, 0), spec.reduction)
    norms = reference.per_sample_norms(grads)
    own = [float(norms[r::2].max()) / 100.0 for r in range(2)]
    f = run_tests(decompose(spec, 2, fake_run(spec.with_(steps=1), factor=lambda t, r: own[r])), ALPHA_TEST)
    assert f.kind == "scale" and f.scope == "max_norm", f


def test_a_late_finding_names_no_cause_the_same_steps_of_other_runs_refute():
    """Noise halved from step 8 in every run: a run at lr 0.5 reads 0.5 from step 8 on, which is
    min(lr, 1). The lr-0 runs' whole-run std is right (most of them stop before step 8), but at steps
    >= 8 they are halved too: compared at the finding's place, nothing singles out the lr, and
    the message names no lr cause (it did, comparing whole runs: seed 5's NoiseHalvedFromStep64 gate)."""
    from dpfsdp_verify.properties.releases.analysis import contrasts
    from dpfsdp_verify.properties.releases.wording import cause

    late = lambda t, r: 0.5 if t >= 8 else 1.0  # noqa: E731
    moving = SPEC.with_(steps=10, lr=0.5)
    still = SPEC.with_(steps=12, lr=0.0)
    run = decompose(moving, 2, fake_run(moving, factor=late))
    short = SPEC.with_(steps=6, lr=0.0)
    others = [decompose(still, 2, fake_run(still, factor=late, seed=1))] + [
        decompose(short, 2, fake_run(short, factor=late, seed=s)) for s in (2, 3, 4, 5, 6, 7)]
    f = run_tests(run, ALPHA_TEST)
    assert f.kind == "scale" and f.scope == "from" and f.steps[0] == 8 and abs(f.ratio - 0.5) < 0.1
    whole = contrasts(run, [run, *others])
    assert abs(whole["lr"][1] - 1) < 0.06, whole  # the old comparison: the lr-0 runs look right as a whole
    assert "learning rate" in cause(run, 0.5, whole, whole_run=False)
    here = contrasts(run, [run, *others], f)
    assert abs(here["lr"][1] - 0.5) < 0.1  # at steps >= 8 they are halved too
    assert cause(run, f.ratio, here, whole_run=False) == ""

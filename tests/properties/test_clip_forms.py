"""Clip forms (``fixtures/clip_form_specimens.py``): DP-SGD's ``min(1, C/||g||)`` written as
``C/max(||g||, C)``, with a tiny epsilon, or as opacus' ``+ 1e-6`` with an explicit min passes every
check that compares with the reference; an epsilon of the wrong sign (a looser clip: privacy) and
one far beyond ``reference.MAX_CLIP_EPSILON`` (over-clipping: utility) still fail, named as such.
Plus ``clipfit.fit_clip_epsilon`` on synthetic coefficients."""

from __future__ import annotations

import pytest
import torch

from dpfsdp_verify import reference
from dpfsdp_verify.properties import run as run_property
from dpfsdp_verify.properties.analysis.clipfit import fit_clip_epsilon
from tests.verdict_helpers import assert_all_pass

F = "fixtures.clip_form_specimens:"
CHECKS = ("norm_fidelity", "clipped_step", "trajectory")


def run(pool, prop, target, **kw):
    kw.setdefault("timeout", 60)
    kw.setdefault("seed", 1)
    return run_property(prop, target, pool=pool, **kw)


@pytest.mark.parametrize("form", ["ClipByMaxNormC", "ClipTinyEpsilon", "ClipMinWithOpacusEpsilon"])
def test_correct_clip_forms_pass(pool, form):
    for prop in CHECKS:
        vs = run(pool, prop, F + form, world_sizes=(2,), models=("mlp",), reductions=("mean",),
                 dtypes=("float64",))
        assert_all_pass(vs)
    vs = run(pool, "clipped_step", F + form, world_sizes=(1,), models=("mlp",), reductions=("sum",),
             dtypes=("float64",), samplings=("fixed",))
    assert_all_pass(vs)
    if form == "ClipByMaxNormC":  # judged at its own epsilon, and says so
        assert "with epsilon" in vs[0].message and abs(vs[0].evidence["clip_epsilon"]) < 1e-12


@pytest.mark.slow
def test_max_norm_c_passes_checkpoint_resume(pool):
    assert_all_pass(run(pool, "checkpoint_resume", F + "ClipByMaxNormC", world_sizes=(1,), models=("mlp",)))


def test_looser_clip_is_a_privacy_violation(pool):
    vs = run(pool, "norm_fidelity", F + "ClipNegativeEpsilon", world_sizes=(1,), models=("mlp",),
             reductions=("mean",), dtypes=("float64",), data_layouts=("split",))
    assert [(v.status, v.diagnosis) for v in vs] == [("fail", "undercount")], [v.message for v in vs]
    assert "privacy violation" in vs[0].message
    vs = run(pool, "clipped_step", F + "ClipNegativeEpsilon", world_sizes=(1,), models=("mlp",),
             reductions=("mean",), dtypes=("float64",), samplings=("fixed",))
    assert [(v.status, v.diagnosis) for v in vs] == [("fail", "mismatch")]
    assert "min(1, C/(||g_i|| - 1e-06))" in vs[0].message and "looser" in vs[0].message, vs[0].message


def test_huge_epsilon_is_over_clipping(pool):
    vs = run(pool, "norm_fidelity", F + "ClipHugeEpsilon", world_sizes=(1,), models=("mlp",),
             reductions=("mean",), dtypes=("float64",), data_layouts=("split",))
    assert [(v.status, v.diagnosis) for v in vs] == [("fail", "mismatch")], [v.message for v in vs]
    assert "inflated" in vs[0].message and "utility loss" in vs[0].message
    vs = run(pool, "clipped_step", F + "ClipHugeEpsilon", world_sizes=(1,), models=("mlp",),
             reductions=("mean",), dtypes=("float64",), samplings=("fixed",))
    assert [(v.status, v.diagnosis) for v in vs] == [("fail", "mismatch")]
    assert "epsilon is 0.1, beyond the 1e-05 the gate accepts" in vs[0].message, vs[0].message


def test_fit_clip_epsilon_recovers_an_accepted_epsilon_and_clamps_others():
    norms = torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64)

    def coef(e):
        return reference.clip_coefficients(norms, 1.5, e)

    # a linear fit of a curve over [0, 1e-5]: off by second-order terms only (the checks then
    # recompute the reference at the fitted epsilon)
    for e in (0.0, 1e-12, 1e-6, 7e-6):
        assert fit_clip_epsilon(coef, coef(e)) == pytest.approx(e, abs=1e-14, rel=1e-5)
    assert fit_clip_epsilon(coef, coef(-1e-6)) == 0.0  # looser: the nearest accepted end
    assert fit_clip_epsilon(coef, coef(0.1)) == reference.MAX_CLIP_EPSILON


def test_trajectory_names_a_first_local_batch_of_one():
    """A trajectory whose first differing update is the first with a local batch of one sample says
    so (a batch of one left unclipped used to read "state carried between steps")."""
    from types import SimpleNamespace as NS

    from dpfsdp_verify.properties.training.trajectory import _first_drift_cause

    outputs = [NS(steps=[NS(indices=[1, 2]), NS(indices=[3]), NS(indices=[4, 5])]),
               NS(steps=[NS(indices=[6, 7]), NS(indices=[8, 9]), NS(indices=[0, 10])])]
    assert "update 1 is the first with a local batch of one sample (rank(s) [0])" in _first_drift_cause(outputs, 1)
    assert "state carried between steps" in _first_drift_cause(outputs, 2)


def test_rounding_level_epsilon_fit_counts_as_zero():
    """An exact ``min(1, C/||g||)`` read back through float64 rounding fits an epsilon of ~1e-15 of
    either sign (-8.88e-16 measured on the 48-step Poisson run): within the fit's rounding scale
    (``epsilon_rounding``), so 0 -- an accepted clip, never "the wrong sign" -- while a looser clip
    by 1e-6 is still named one."""
    from dpfsdp_verify.properties.analysis.clipfit import (describe_clip_fit, epsilon_rounding,
                                                          fit_clip_coefficients)

    norms = torch.tensor([2.1, 3.3, 4.0, 4.7, 5.9, 7.5], dtype=torch.float64)
    c = 4.404
    for e in (-8.88e-16, 1.78e-15):
        coef = (c / (norms + e)).clamp(max=1.0)
        assert abs(e) <= epsilon_rounding(coef, norms, c)
        fit = fit_clip_coefficients(coef, norms, c, 1e-9)
        assert fit is None or fit.kind != "epsilon", describe_clip_fit(fit, c)
    # the scale is rounding's, far below any epsilon a fork writes
    assert epsilon_rounding((c / norms).clamp(max=1.0), norms, c) < 1e-13
    looser = (c / (norms - 1e-6)).clamp(max=1.0)
    fit = fit_clip_coefficients(looser, norms, c, 1e-9)
    assert fit is not None and fit.kind == "epsilon" and fit.value == pytest.approx(-1e-6, rel=1e-6)
    assert "wrong sign" in describe_clip_fit(fit, c)


def test_long_run_judges_the_targets_own_epsilon(pool):
    """The 48-step Poisson run of clipped_step judges each step at the target's own accepted clip
    epsilon, as the one-step cases do: ``C/max(||g||, C)`` passes it (it failed at seeds 12345 and
    573172995, "an epsilon of the wrong sign"), and a looser clip still fails it, named looser."""
    kw = dict(world_sizes=(2,), models=("mlp",), reductions=("mean",), dtypes=("float64",), samplings=("fixed",),
              horizon=48, seed=12345)
    vs = run(pool, "clipped_step", F + "ClipByMaxNormC", **kw)
    long = [v for v in vs if "horizon" in v.config]
    assert len(long) == 1
    assert_all_pass(vs)
    assert "own clip epsilon" in long[0].message and long[0].evidence["clip_epsilon"] < 1e-12, long[0].message


@pytest.mark.slow  # test_rounding_level_epsilon_fit_counts_as_zero covers the fit; this the long run's path
def test_long_run_still_fails_a_looser_clip(pool):
    kw = dict(world_sizes=(2,), models=("mlp",), reductions=("mean",), dtypes=("float64",), samplings=("fixed",),
              horizon=48, seed=12345)
    vs = [v for v in run(pool, "clipped_step", F + "ClipNegativeEpsilon", **kw) if "horizon" in v.config]
    assert [(v.status, v.diagnosis) for v in vs] == [("fail", "mismatch")]
    assert "min(1, C/(||g_i|| - 1e-06))" in vs[0].message and "looser" in vs[0].message, vs[0].message

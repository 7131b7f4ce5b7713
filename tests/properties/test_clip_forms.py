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

    from dpfsdp_verify.properties.checks.trajectory import _first_drift_cause

    outputs = [NS(steps=[NS(indices=[1, 2]), NS(indices=[3]), NS(indices=[4, 5])]),
               NS(steps=[NS(indices=[6, 7]), NS(indices=[8, 9]), NS(indices=[0, 10])])]
    assert "update 1 is the first with a local batch of one sample (rank(s) [0])" in _first_drift_cause(outputs, 1)
    assert "state carried between steps" in _first_drift_cause(outputs, 2)

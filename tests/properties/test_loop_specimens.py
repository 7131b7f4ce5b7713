"""Loop and sampling specimens (``fixtures/audit_loop_specimens.py``) no other test ran: each fails
the property and diagnosis its bug breaks, in the narrowest run that reaches it (the specimen
catalog, docs/specimens.md, requires a test for every bug specimen).

* ``AccumClipsAgainstCOverPasses`` (clip to C / passes under accumulation): ``mode_equivalence``
  between the unsplit step and the step in physical batches, ``mismatch``;
* ``EmptyLocalBatchNoNoise`` (no noise from a rank whose Poisson batch is empty):
  ``noise_calibration`` under Poisson sampling, a release without noise;
* ``PaddingTokensTrained`` (padding positions in the loss): ``norm_fidelity`` on the masked model;
* ``SamplerReseededEachEpoch``, ``WithReplacement`` (not Poisson subsampling):
  ``sampling_accounting``, ``correlated_sampling``."""

from __future__ import annotations

import pytest

import dpfsdp_verify.properties as props

pytestmark = pytest.mark.slow  # ~25 s idle on 2 cores; the properties' code paths are covered by faster tests

A = "fixtures.audit_loop_specimens:"


def _failing(vs):
    return [v for v in vs if v.status == "fail"]


def test_clip_to_c_over_passes_breaks_accumulation_equivalence(pool):
    vs = props.run("mode_equivalence", A + "AccumClipsAgainstCOverPasses", pool=pool, world_sizes=(1,),
                   models=("mlp",), reductions=("mean",), dtypes=("float64",), samplings=("fixed",), timeout=120)
    bad = _failing(vs)
    assert bad and all(v.diagnosis == "mismatch" for v in bad)
    assert "physical_batches" in bad[0].message and "gradients differ" in bad[0].message


def test_empty_local_batch_without_noise_is_a_release_without_noise(pool):
    vs = props.run("noise_calibration", A + "EmptyLocalBatchNoNoise", pool=pool, world_sizes=(1,), models=("mlp",),
                   dtypes=("float64",), samplings=("poisson",), timeout=120)
    bad = _failing(vs)
    assert bad and all(v.config.get("sampling") == "poisson" for v in bad)
    assert any("PRIVACY VIOLATION" in v.message and "no noise" in v.message for v in bad)


def test_trained_padding_tokens_are_wrong_norms(pool):
    vs = props.run("norm_fidelity", A + "PaddingTokensTrained", pool=pool, world_sizes=(1,), models=("masked",),
                   dtypes=("float64",), samplings=("fixed",), timeout=120)
    assert vs and all(v.status == "fail" and v.diagnosis == "mismatch" for v in vs)
    assert "per-sample norms differ from the reference" in vs[0].message


def test_samplers_that_are_not_poisson_are_correlated_sampling(pool):
    for name in ("SamplerReseededEachEpoch", "WithReplacement"):
        vs = props.run("sampling_accounting", A + name, pool=pool, world_sizes=(1,), timeout=120)
        bad = _failing(vs)
        assert bad, f"{name} passed sampling_accounting"
        assert {v.diagnosis for v in bad} == {"correlated_sampling"}, name


@pytest.mark.xfail(strict=True, reason="a known escape (docs/precision.md): clip coefficients rounded to bf16 put a "
                   "clipped sample up to 2^-9 above C, inside the bf16 step bound; sensitivity_bound judges fp32 only")
def test_bf16_rounded_clip_coefficients_are_not_caught_under_bf16(pool):
    vs = props.run("clipped_step", A + "BF16ClipCoefficientsUnderMixedPrecision", pool=pool, world_sizes=(1,),
                   models=("mlp",), reductions=("mean",), samplings=("fixed",), precisions=("bf16-autocast",),
                   timeout=120)
    assert vs and _failing(vs), "every bf16 case passed"

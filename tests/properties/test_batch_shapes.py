"""Batch breadth: the default cases that catch the audit's batch-shape escapes.

* ``ChunkedNormsOffset`` (per-sample gradients in chunks of 8, later chunks with the first chunk's
  activations) fails norm_fidelity's large local batch (33 per rank, a second spec of the mlp/split/
  float64 case) as ``mismatch``;
* ``AccumDivisorRealised`` (the accumulating ``"mean"`` divides by the batch actually drawn) fails
  mode_equivalence's Poisson case of the built-in pair as ``mismatch``;
* ``RateFromLoaderLength`` (samples at 1/int(1/q), the accountant told q) fails sampling_accounting's
  ``fractional_rate`` case (N = 10, q = 0.3) as ``wrong_sample_rate``;
* ``Correct`` passes all three; the plans hold one new case (one new spec for norm_fidelity) per world size.
"""

from __future__ import annotations

import pytest
import dpfsdp_verify.properties as props
from dpfsdp_verify.properties import PROPERTIES
from dpfsdp_verify.properties.engine.contract import Options
from tests.verdict_helpers import assert_all_pass, by

N = "fixtures.audit_noise_specimens:"
L = "fixtures.audit_loop_specimens:"
CORRECT = "fixtures.specimens:Correct"


def _plan(pid, **kw):
    prop = PROPERTIES[pid]
    return prop.plan(prop.with_defaults(Options.build("t", world_sizes=[1, 2], **kw)))


def test_plans_one_new_case_per_world_size():
    nf = _plan("norm_fidelity")
    # ws x models x layouts x reductions x dtypes, + the layer zoo once per world size: no new case
    assert len(nf) == 2 * 2 * 2 * 2 * 2 + 2
    large = [c for c in nf if len(c.specs) == 2]
    assert [(c.world_size, c.specs[1].global_batch_size, c.spec.global_batch_size, c.spec.model, c.spec.dtype,
             c.spec.data_layout) for c in large] == [(1, 33, 4, "mlp", "float64", "split"),
                                                     (2, 66, 8, "mlp", "float64", "split")]
    poisson = [c for c in _plan("mode_equivalence") if c.spec.poisson]
    assert [(c.world_size, c.spec.dataset_size, c.spec.sample_rate, len(c.specs)) for c in poisson] == [
        (1, 16, 0.25, 1), (2, 32, 0.25, 1)]
    assert all(c.spec.noise_multiplier == 0 for c in poisson)
    frac = [c for c in _plan("sampling_accounting") if c.labels.get("dataset") == "fractional_rate"]
    assert [(c.world_size, c.spec.dataset_size, c.spec.sample_rate) for c in frac] == [(1, 10, 0.3)]
    assert len(_plan("sampling_accounting")) == 10


@pytest.mark.slow  # moved out of the README command to keep it near 5 min (CI runs it)
def test_chunked_norms_fail_the_large_local_batch(pool):
    vs = props.run("norm_fidelity", N + "ChunkedNormsOffset", pool=pool, world_sizes=(1, 2), models=("mlp",),
                   data_layouts=("split",), reductions=("mean",), dtypes=("float64",))
    assert len(vs) == 2  # mlp, split, mean, float64 at world sizes 1 and 2
    for v in vs:
        assert (v.status, v.diagnosis) == ("fail", "mismatch"), v.message
        assert v.message.startswith("at a local batch of 33 per rank (a local batch of 4 passes): per-sample norms "
                                    "differ from the reference")
        assert "The first 8 sample(s) of every rank's local batch are right" in v.message
        assert v.evidence["large_local_batch"] == 33


def test_realised_divisor_fails_the_poisson_pair(pool):
    vs = props.run("mode_equivalence", L + "AccumDivisorRealised", pool=pool, world_sizes=(1, 2), models=("mlp",))
    poisson = by(vs, sampling="poisson")
    assert len(poisson) == 2 and all(v.status == "fail" and v.diagnosis == "mismatch" for v in poisson)
    assert "gradients differ at step" in poisson[0].message
    assert_all_pass(by(vs, sampling=None))  # fixed batches hold the expected batch: identical


def test_rate_from_loader_length_fails_the_fractional_rate(pool):
    vs = props.run("sampling_accounting", L + "RateFromLoaderLength", pool=pool, world_sizes=(1,))
    [frac] = by(vs, dataset="fractional_rate")
    assert frac.status == "fail" and frac.diagnosis == "wrong_sample_rate"
    assert "not the configured q = 0.3" in frac.message
    assert_all_pass(by(vs, dataset="divisible"))  # q = 1/8 is 1/integer: the bug is invisible there


def test_correct_passes_the_new_cases(pool):
    nf = props.run("norm_fidelity", CORRECT, pool=pool, world_sizes=(1, 2), models=("mlp",),
                   data_layouts=("split",), reductions=("mean",), dtypes=("float64",))
    assert_all_pass(nf)
    assert all("at a local batch of 33 per rank too" in v.message for v in nf)
    assert_all_pass(by(props.run("mode_equivalence", CORRECT, pool=pool, world_sizes=(1, 2), models=("mlp",)),
                       sampling="poisson"))
    assert_all_pass(by(props.run("sampling_accounting", CORRECT, pool=pool, world_sizes=(1,)),
                       dataset="fractional_rate"))


def test_poisson_divisor_not_truncated_fails_the_fractional_expected_batch(pool):
    """``PoissonDivisorNotTruncated`` divides by q * N, not int(q * N): clipped_step's Poisson
    points run on N = 12 ws - 2 (q * N = 2.5, 5.5), where the two differ; Correct passes there."""
    kw = dict(pool=pool, world_sizes=(1, 2), models=("mlp",), reductions=("mean",), dtypes=("float64",),
              samplings=("poisson",))
    vs = props.run("clipped_step", N + "PoissonDivisorNotTruncated", **kw)
    assert [(v.config["world_size"], v.config["dataset_size"]) for v in vs] == [(1, 10), (2, 22)]
    assert all(v.status == "fail" and v.diagnosis == "mismatch" for v in vs), [v.message for v in vs]
    assert "exactly 0.8" in vs[0].message and "0.909" in vs[1].message
    assert_all_pass(props.run("clipped_step", CORRECT, **kw))

"""``clipped_step``'s parameter check: after the step the parameters are ``p - lr * grad`` for the
gradient the target reports. Where a float32 gradient is judged with its rounding allowance (a tiny
model whose gradients flow through a normalisation over two features), the parameters get ``lr``
times that allowance: gate seed 6001's explored draw (a d_model-2 transformer, float32, 49 physical
passes) had a correct target's gradient 1.2e-3 off the reference, inside its allowance, and its
parameters 6.6e-4 off against a fixed 1e-4 -- a false alarm ("the optimizer does not apply the DP
gradient it computed") on ``Correct`` and on every target at that seed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

import dpfsdp_verify.properties as props
from tests.plugin.test_plugin import assert_no_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DECAY = "fixtures.noisy_update_specimens:AppliesUnconfiguredWeightDecay"
PARAMS_WRONG = "but the parameters after the step"  # float32/64 and bf16 wordings


def test_an_update_other_than_the_reported_gradient_fails_the_parameter_check(pool):
    vs = props.run("clipped_step", DECAY, pool=pool, world_sizes=(1, 2), models=("mlp",),
                   dtypes=("float64", "float32"), samplings=("fixed",), timeout=60)
    failing = [v for v in vs if v.status == "fail"]
    assert failing and len(failing) == len([v for v in vs if v.status != "pass"]), [v.message for v in vs]
    assert all(v.diagnosis == "mismatch" and PARAMS_WRONG in v.message for v in failing), failing[0].message
    assert {v.config["dtype"] for v in failing} == {"float64", "float32"}


def _clipped_step_gate(target: str, tmp_path, tag: str) -> dict:
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "dpfsdp_verify", "run", "--target", target, "--properties",
                           "clipped_step", "--seed", "6001", "--explore", "4", "-q", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "DPFSDP_TEST_TAG": tag})
    assert out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_seed_6001_draw_passes_correct_and_fails_a_wrong_update(tmp_path):
    tag = uuid.uuid4().hex
    try:
        right = _clipped_step_gate("fixtures.specimens:Correct", tmp_path, tag)
        explored = [v for v in right["results"] if "explore" in v["config"]]
        assert explored and right["exit_code"] == 0, [v["message"] for v in right["results"] if v["status"] != "pass"]
        wrong = _clipped_step_gate(DECAY, tmp_path, tag)
        drawn = [v for v in wrong["results"] if "explore" in v["config"]]
        assert wrong["exit_code"] == 1 and any(v["status"] == "fail" and PARAMS_WRONG in v["message"] for v in drawn)
    finally:
        assert_no_ranks(tag)

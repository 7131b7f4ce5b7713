"""``scripts/gpu_check.py`` without a GPU: which runs a machine gets, the table it prints, and the
carried-wheel install (no network) that lets it run where opacus is missing. Its gate runs
themselves are the gate's own (tested everywhere else); docs/gpu.md says what has run on a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts",
                      "gpu_check.py")


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runs_follow_the_gpus(gpu_check):
    assert gpu_check.planned_runs(0) == [("gloo", ["--backend", "gloo"])]
    one = dict(gpu_check.planned_runs(1))
    assert one["nccl"] == ["--backend", "nccl", "--world-sizes", "1"]
    assert one["nccl-bf16"] == ["--backend", "nccl", "--world-sizes", "1", "--precisions", "bf16-autocast"]
    assert dict(gpu_check.planned_runs(8))["nccl"][-1] == "1,2"


def test_table_counts_per_property_and_run(gpu_check):
    counts = {s: 0 for s in gpu_check.STATUSES + ("expected",)}
    runs = [{"name": "gloo", "code": 0, "seconds": 61.2,
             "counts": {"clipped_step": {**counts, "pass": 12, "fail": 4, "expected": 4}}},
            {"name": "nccl", "code": 1, "seconds": 30.0,
             "counts": {"clipped_step": {**counts, "pass": 3, "error": 2}, "trajectory": {**counts, "skip": 1}}}]
    info = {"date": "2026-11-25 21:00 UTC", "card": "NVIDIA H100 80GB HBM3", "gpus": "1", "torch": "2.11.0+cu130",
            "cuda": "13.0"}
    text = gpu_check.table(info, runs, None)
    lines = text.splitlines()
    assert lines[0] == "GPU check 2026-11-25 21:00 UTC: NVIDIA H100 80GB HBM3 x1, torch 2.11.0+cu130, CUDA 13.0"
    assert "| clipped_step | 12 pass 4 fail (4 exp) | 3 pass 2 error |" in lines
    assert "| trajectory | - | 1 skip |" in lines
    assert "| **exit code** | 0 | 1 |" in lines and "| **wall time** | 61 s | 30 s |" in lines
    assert gpu_check.table(info, runs[:1], "no GPU visible").endswith("\n\nno GPU visible")


def _fake_wheel(directory, version="9.9.9"):
    """A minimal opacus wheel (one module saying its version): what ``--wheels`` carries."""
    path = os.path.join(directory, f"opacus-{version}-py3-none-any.whl")
    info = f"opacus-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("opacus/__init__.py", f"__version__ = {version!r}\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: opacus\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_carried_wheel_is_installed_without_network(gpu_check, tmp_path):
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    with pytest.raises(SystemExit, match=r"no opacus-\*\.whl in .*`pip download --no-deps opacus==1.6.0"):
        gpu_check.install_opacus(str(wheels), str(target))
    _fake_wheel(str(wheels))
    gpu_check.install_opacus(str(wheels), str(target))
    env = gpu_check._environment([str(target)])
    found = subprocess.run([sys.executable, "-c", "import opacus, dpfsdp_verify; print(opacus.__version__, "
                            "opacus.__file__, dpfsdp_verify.__file__)"], env=env, capture_output=True, text=True)
    version, opacus_file, own_file = found.stdout.split()
    assert version == "9.9.9" and opacus_file.startswith(str(target))  # the carried one, before any installed
    assert own_file.startswith(gpu_check.REPO)  # the checkout itself, no install needed


@pytest.mark.slow  # 3 gate plans in subprocesses per count; tests/gate/test_gate_platform.py covers the path in-process
@pytest.mark.parametrize("gpus", [1, 2])
def test_every_planned_run_plans_at_1_and_2_gpus(gpus):
    """The script's runs on a 1- or 2-GPU box (the count mocked through the gate's private
    ``_DPFSDP_VERIFY_SIMULATED_GPUS``), each planned with the gate's ``--dry-run``: all would run,
    the 3-rank cases skipped with the reason (the nccl runs exited 2 before, issue 33)."""
    env = {**os.environ, "_DPFSDP_VERIFY_SIMULATED_GPUS": str(gpus)}
    done = subprocess.run([sys.executable, SCRIPT, "--plan", "--", "--properties", "deadlock_free"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("gloo", "nccl", "nccl-bf16"):
        assert f"gpu_check: {name} plan (exit 0):" in done.stderr
    assert f"GPUs needed: {gpus} (one per rank; {gpus} visible)" in done.stderr
    assert f"needs 3 GPUs, {gpus} visible; run with --backend gloo for the 3-rank cases" in done.stderr


@pytest.mark.slow
def test_gloo_run_without_a_gpu(tmp_path):
    """The script end to end on this GPU-less machine: its gloo run (a short selection), the table."""
    out = tmp_path / "gpu-check.md"
    done = subprocess.run([sys.executable, SCRIPT, "--out", str(out), "--", "--properties", "clipped_step",
                           "--world-sizes", "1", "--models", "mlp", "--wide-world-size", "0",
                           "--node-world-size", "0", "--horizon", "0"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text()
    assert "| property | gloo |" in text and "| clipped_step | " in text and "| **exit code** | 0 |" in text
    assert "no GPU visible: the nccl and bf16 runs were not made" in text

"""Packaging facts a user and the ecosystem rely on, read from the installed metadata (as pip and
pytest's plugin index see them), not from pyproject.toml's text."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata, resources

from packaging.requirements import Requirement

import dpfsdp_verify

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIST = "dpfsdp-verify"


def _requirements(extra: str = ""):
    """The distribution's requirements that apply when installed with ``extra`` ('' = plain)."""
    out = []
    for text in metadata.requires(DIST) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": extra}):
            out.append(req.name)
    return out


def test_installing_the_gate_never_pulls_an_implementation_under_test():
    """A fork installed as `opacus 1.5.4+myfork` must survive `pip install dpfsdp-verify`: nothing
    the plain install requires may name opacus (nor the test-only tools)."""
    plain = _requirements()
    assert "torch" in plain
    assert not {"opacus", "hypothesis", "pytest"} & set(plain), plain
    assert "opacus" in _requirements("opacus")
    assert "hypothesis" in _requirements("fuzz")


def test_test_extra_holds_everything_the_tests_import():
    assert {"opacus", "hypothesis", "pytest", "pytest-xdist", "pytest-timeout", "jsonschema"} <= set(
        _requirements("test"))


def test_metadata_version_classifiers_license_and_typing():
    md = metadata.metadata(DIST)
    assert md["Version"] == dpfsdp_verify.__version__  # one version source
    classifiers = md.get_all("Classifier")
    for c in ("Framework :: Pytest", "Topic :: Scientific/Engineering :: Artificial Intelligence",
              "Topic :: Software Development :: Testing", "Programming Language :: Python :: 3.11",
              "License :: OSI Approved :: Apache Software License", "Typing :: Typed"):
        assert c in classifiers
    assert md["License"] == "Apache-2.0" or "Apache" in (md.get("License-Expression") or "")
    with open(os.path.join(REPO, "LICENSE")) as f:
        assert "Apache License" in f.read(300)
    pkg = resources.files("dpfsdp_verify")
    assert pkg.joinpath("py.typed").is_file() and pkg.joinpath("schema/report.schema.json").is_file()
    assert pkg.joinpath("properties/known_failures/opacus-1.6.0.toml").is_file()


def test_python_m_and_version_name_the_opacus_it_would_test():
    import opacus
    import torch

    r = subprocess.run([sys.executable, "-m", "dpfsdp_verify", "--version"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"dpfsdp-verify {dpfsdp_verify.__version__}" in r.stdout
    assert f"opacus {opacus.__version__} ({os.path.dirname(opacus.__file__)})" in r.stdout
    assert f"torch {torch.__version__}" in r.stdout


def test_pytest_plugin_works_without_hypothesis(tmp_path):
    """The plugin is loaded in every pytest session of an environment that has dpfsdp-verify; with
    hypothesis (the optional [fuzz] extra) absent it must not break pytest -- only asking for a
    hypothesis profile says what to install."""
    shadow = tmp_path / "shadow"
    (shadow / "hypothesis").mkdir(parents=True)
    (shadow / "hypothesis" / "__init__.py").write_text("raise ImportError('hypothesis hidden by the test')\n")
    (tmp_path / "test_user.py").write_text(
        "import pytest, torch, torch.distributed as dist\n\n"
        "@pytest.mark.distributed(world_size=2, timeout=60)\n"
        "def test_allreduce(rank, world_size):\n"
        "    t = torch.tensor([float(rank + 1)])\n"
        "    dist.all_reduce(t)\n"
        "    assert t.item() == 3.0\n")
    env = dict(os.environ, PYTHONPATH=str(shadow))
    env.pop("DPFSDP_HYPOTHESIS_PROFILE", None)
    # hypothesis' own pytest plugin is installed here; without hypothesis it would not be
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
           "-p", "no:xdist", "test_user.py"]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(cmd, cwd=tmp_path, env=dict(env, DPFSDP_HYPOTHESIS_PROFILE="ci"), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 4, r.stdout + r.stderr  # pytest's usage error
    assert "pip install hypothesis" in r.stderr

"""A fork on an older opacus API: ``--target opacus`` says in one line which API the adapter needs
and which is missing (exit 2), instead of a crash per case; upstream 1.6.0 has all of it."""

from __future__ import annotations

import os
import subprocess
import sys

from dpfsdp_verify.targets import opacus_api

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_upstream_opacus_has_the_api_the_adapter_drives():
    assert opacus_api.missing() == []


def test_a_fork_without_the_fsdp_path_is_told_in_one_line(tmp_path):
    fork = tmp_path / "opacus"  # a 1.5.x-like fork: PrivacyEngine and a data loader, no FSDP path
    (fork / "utils").mkdir(parents=True)
    (fork / "__init__.py").write_text('__version__ = "1.5.4+myfork"\nclass PrivacyEngine:\n    pass\n')
    (fork / "utils" / "__init__.py").write_text("")
    (fork / "data_loader.py").write_text("class DPDataLoader:\n    pass\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    # what the gate's plan calls for --target opacus (plan.load_target_info: a TargetLoadError is the
    # one-line exit 2); in a fresh process, where the fake fork is the importable opacus
    code = ("import sys; from dpfsdp_verify.gate.plan import load_target_info\n"
            "from dpfsdp_verify.errors import HintedError\n"
            "try:\n    load_target_info('opacus')\n"
            "except HintedError as e:\n    print(e, file=sys.stderr); sys.exit(2)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and "opacus 1.5.4+myfork lacks the API the opacus adapter drives" in err[0], err
    assert "opacus.utils.fsdp_utils.FSDP2Wrapper (FSDP2 wrapping)" in err[0]
    assert "opacus.data_loader.DPDataLoader" not in err[0]  # what it has is not listed

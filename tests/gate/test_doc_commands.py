"""Every command README.md and docs/*.md show is run by the tests, so a documented command cannot
land broken again (issue 33: docs/meshes.md's own command exited 3 for weeks).

Collected: each line of a ```bash / ```sh / plain ``` fence (backslash continuations joined; ``&&``
splits a line) that starts with ``dpfsdp-verify`` or ``python -m dpfsdp_verify``. A synopsis (a line
with ``[...]`` optional parts, ``...`` or a ``{...}`` placeholder) is not a command and is left out.
A command naming the docs' placeholder adapter (``my_pkg.adapter:MyFork``) is run with the Correct
specimen standing in for it, one naming the docs' own model (``my_model:MyModel``) with
``fixtures.user_models:MyModel`` (the same file).

* every ``run`` is planned with ``--dry-run`` (options checked, nothing started): exit 0;
* every other command that is short (``list``, ``--version``) runs for real: exit 0;
* ``slow``: the ``run`` commands whose planned estimate is at most ``REAL_RUN_BUDGET_S`` run for
  real: exit 0 with ``--expect``, else 0 or 1 (a verdict on the target) -- never 2 (usage) or 3
  (a bug of the suite), which is what broke.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

from dpfsdp_verify.gate import cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FENCE = re.compile(r"^```(bash|sh|)\n(.*?)^```", re.M | re.S)
PLACEHOLDER_TARGET = "my_pkg.adapter:MyFork"
STAND_IN = "fixtures.specimens:Correct"
#: the docs' own model (docs/models.md: ``my_model.py`` in the directory run from) and its stand-in,
#: the same file loaded by path from the checkout
PLACEHOLDER_MODEL, MODEL_STAND_IN = "my_model:MyModel", "fixtures.user_models:MyModel"
#: a documented run whose plan estimates at most this many seconds runs for real in the slow set
REAL_RUN_BUDGET_S = 40


def documented_commands():
    """``[(file:line, argv after the program name)]`` (module docstring)."""
    found = []
    for path in ["README.md"] + sorted(glob.glob(os.path.join("docs", "*.md"))):
        with open(os.path.join(REPO, path)) as f:
            text = f.read()
        for m in FENCE.finditer(text):
            first = text[:m.start(2)].count("\n") + 1
            lines = m.group(2).replace("\\\n", " ").split("\n")
            for i, line in enumerate(lines):
                for part in line.split("&&"):
                    part = part.split(" #")[0].strip()
                    if not part.startswith(("dpfsdp-verify", "python -m dpfsdp_verify")):
                        continue
                    if "[" in part or "..." in part or "{" in part:
                        continue  # a synopsis, not a command
                    argv = shlex.split(part)
                    argv = argv[1:] if argv[0] == "dpfsdp-verify" else argv[3:]
                    argv = [STAND_IN if a == PLACEHOLDER_TARGET else a.replace(PLACEHOLDER_MODEL, MODEL_STAND_IN)
                            for a in argv]
                    found.append((f"{path}:{first + i}", argv))
    return found


COMMANDS = documented_commands()
RUNS = [(where, argv) for where, argv in COMMANDS if argv[:1] == ["run"]]


def test_the_documented_commands_are_found():
    wheres = {where.split(":")[0] for where, _ in COMMANDS}
    assert {"README.md", "docs/meshes.md", "docs/precision.md"} <= wheres, COMMANDS
    assert any(argv[:1] == ["list"] for _, argv in COMMANDS) and len(RUNS) >= 5


@pytest.mark.parametrize("where, argv", RUNS, ids=[w for w, _ in RUNS])
def test_documented_run_is_planned(where, argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --json r.json and the like land here
    monkeypatch.syspath_prepend(REPO)  # the stand-in adapter, as from the checkout
    if "nccl" in argv:  # a GPU box's command (docs/gpu.md): planned as on one GPU, the count mocked
        from dpfsdp_verify.harness.backends import SIMULATED_GPUS_ENV

        monkeypatch.setenv(SIMULATED_GPUS_ENV, "1")
    code = cli.main(argv + ["--dry-run"])
    captured = capsys.readouterr()
    assert code == cli.EXIT_OK, f"{where}: {' '.join(argv)} --dry-run exited {code}: {captured.err.strip()}"
    assert "total:" in captured.out and "cases to run" in captured.out


SHORT = [(where, argv) for where, argv in COMMANDS if argv[:1] != ["run"]]


@pytest.mark.parametrize("where, argv", SHORT, ids=[w for w, _ in SHORT])
def test_documented_short_command_runs(where, argv):
    done = subprocess.run([sys.executable, "-m", "dpfsdp_verify", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{where}: {' '.join(argv)} exited {done.returncode}: {done.stderr[-800:]}"
    assert done.stdout.strip()


@pytest.mark.slow
@pytest.mark.timeout(1200)  # several real gate runs one after another (each planned at <= REAL_RUN_BUDGET_S)
def test_short_documented_runs_run_for_real(tmp_path):
    from dpfsdp_verify.gate.dryrun import describe
    from dpfsdp_verify.gate.plan import RunPlan

    ran = []
    for where, argv in RUNS:
        if "nccl" in argv:
            continue  # a GPU box's command: planned above with the GPU count mocked; scripts/gpu_check.py runs it
        plan = RunPlan.from_args(cli.build_parser().parse_args(argv), load_target=False)
        if describe(plan).seconds > REAL_RUN_BUDGET_S:
            continue
        done = subprocess.run([sys.executable, "-m", "dpfsdp_verify", *argv, "-q"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=900, env={**os.environ, "PYTHONPATH": REPO})
        allowed = (0,) if "--expect" in argv else (0, 1)
        assert done.returncode in allowed, f"{where}: {' '.join(argv)} exited {done.returncode}: {done.stderr[-1500:]}"
        ran.append(where)
    assert ran  # at least the short ones (the README's replay line, the mesh command)

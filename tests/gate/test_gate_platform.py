"""Issue 33: the gate as documented, where features meet and on machines other than this one.

* the mesh command of docs/meshes.md (``--meshes`` without ``--world-sizes``) plans without the
  long runs (``horizon_point`` raised on the empty world-size list) and without the wide cases;
* ``--backend nccl --world-sizes 1`` on one GPU (the count mocked): the default 3-rank cases are
  ``skip`` verdicts naming the GPUs, the rest is planned, exit 0 with ``--expect opacus-1.6.0``; a
  world size the user names beyond the GPUs stays exit 2;
* an expectation's ``when`` (torch range) is matched against ``torch.__version__`` (faked here);
* ``run --dry-run`` starts no rank and imports no opacus.

None of these starts a rank: they plan, and the plan is what changed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dpfsdp_verify.gate import cli, expectations
from dpfsdp_verify.gate.expectations import ExpectationsError, apply, environment, parse, version_in_range
from dpfsdp_verify.gate.plan import RunPlan
from dpfsdp_verify.properties import PROPERTIES
from dpfsdp_verify.properties.engine.contract import Case
from dpfsdp_verify.verdict import Verdict

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MESH_COMMAND = ["run", "--meshes", "hsdp:2x2,tp:2x2", "--properties",
                "norm_fidelity,clipped_step,noise_calibration,trajectory"]


def plan_items(argv):
    plan = RunPlan.from_args(cli.build_parser().parse_args(argv))
    return plan, {pid: PROPERTIES[pid].plan(PROPERTIES[pid].with_defaults(plan.options)) for pid in plan.properties}


# -- item 1: docs/meshes.md's command ------------------------------------------------------------


def test_mesh_command_plans_only_the_meshes():
    # the two properties that crashed, on their cheapest model (the whole command: test_doc_commands)
    plan, items = plan_items(MESH_COMMAND[:3] + ["--properties", "clipped_step,noise_calibration", "--models", "mlp",
                                                 "--dtypes", "float64", "--target", "fixtures.specimens:Correct"])
    assert plan.options.world_sizes == () and plan.options.wide_world_size == 0
    for pid, its in items.items():
        cases = [c for c in its if isinstance(c, Case)]
        assert cases and all(c.spec.mesh in ("hsdp:2x2", "tp:2x2") for c in cases), pid
        assert not any("horizon" in c.labels for c in cases), pid  # a long run is 1-D
    # with --world-sizes both run, and the long run is at the largest 1-D world size, never a mesh
    _, both = plan_items(MESH_COMMAND[:3] + ["--properties", "clipped_step", "--world-sizes", "2", "--models", "mlp",
                                             "--dtypes", "float64", "--target", "fixtures.specimens:Correct"])
    longs = [c for c in both["clipped_step"] if isinstance(c, Case) and "horizon" in c.labels]
    assert [(c.world_size, c.spec.mesh) for c in longs] == [(2, "")]


# -- item 2: nccl with fewer GPUs than the default's 3-rank cases --------------------------------


@pytest.fixture
def one_gpu(monkeypatch):
    import torch

    monkeypatch.delenv("_DPFSDP_VERIFY_SIMULATED_GPUS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_nccl_on_one_gpu_skips_the_three_rank_cases_and_plans_the_rest(one_gpu):
    plan, items = plan_items(["run", "--backend", "nccl", "--world-sizes", "1", "--expect", "opacus-1.6.0",
                              "--properties", "deadlock_free,sampling_accounting"])
    assert plan.options.wide_world_size == 3
    cases = [c for its in items.values() for c in its if isinstance(c, Case)]
    skips = [v for its in items.values() for v in its if isinstance(v, Verdict)]
    assert cases and {c.world_size for c in cases} == {1} and {c.backend for c in cases} == {"nccl"}
    # the 3-rank case, and the 4-rank node case (2 nodes x 2) likewise
    assert [(v.property, v.status, v.config["world_size"]) for v in skips] == [("deadlock_free", "skip", 3),
                                                                               ("sampling_accounting", "skip", 4)]
    assert skips[0].message == "needs 3 GPUs, 1 visible; run with --backend gloo for the 3-rank cases"
    assert skips[1].message == "needs 4 GPUs, 1 visible; run with --backend gloo for the 4-rank cases"
    # the shipped expectations: a skipped case is not exercised, never "no longer holds"
    outcome = apply(plan.expectations, skips, environment("nccl"))
    assert outcome.holds and not outcome.unmet


def test_nccl_on_one_gpu_dry_run_exits_0_and_names_the_skips(one_gpu, capsys):
    assert cli.main(["run", "--dry-run", "--backend", "nccl", "--world-sizes", "1", "--expect", "opacus-1.6.0",
                     "--properties", "deadlock_free"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "GPUs needed: 1 (one per rank; 1 visible)" in out
    assert "deadlock_free ws=3 " in out and "needs 3 GPUs, 1 visible; run with --backend gloo" in out


@pytest.mark.parametrize("args, says", [
    (["--world-sizes", "1,2"], "world_size=2 but 1 GPU(s) visible"),
    (["--world-sizes", "1", "--wide-world-size", "3"], "world_size=3 but 1 GPU(s) visible"),
    (["--meshes", "hsdp:2x2"], "needs 4 GPUs, 1 visible"),
])
def test_nccl_beyond_the_gpus_named_explicitly_is_a_usage_error(one_gpu, capsys, args, says):
    assert cli.main(["run", "--dry-run", "--backend", "nccl", "--properties", "deadlock_free", *args]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert says in err and err.startswith("dpfsdp-verify: error:") and len(err.splitlines()) == 1, err


# -- item 3: expectations with an environment condition ------------------------------------------

WHEN_FILE = """version = 1
[[expect]]
property = "clipped_step"
config = { model_kwargs = { d_ff = 1 } }
status = "error"
diagnosis = "placement_mismatch"
reason = "finding 3: torch >= 2.13 refuses the Replicate gradient"
when = { torch = ">= 2.13", backend = "gloo" }
"""


def _short_layer(status, diagnosis=None):
    return Verdict("clipped_step", status, {"world_size": 2, "model": "transformer", "model_kwargs": {"d_ff": 1}},
                   diagnosis=diagnosis)


@pytest.mark.parametrize("version, applies", [("2.11.0+cu130", False), ("2.13.0+cpu", True), ("2.14.1", True),
                                              ("2.13.0a0+git12ab", True), ("2.12.9", False)])
def test_when_torch_range_follows_torch_version(monkeypatch, version, applies):
    import torch

    monkeypatch.setattr(torch, "__version__", version)
    exp = parse(WHEN_FILE, "when.toml", properties=list(PROPERTIES))
    assert environment()["torch"] == version
    passed = apply(exp, [_short_layer("pass")])
    failed = apply(exp, [_short_layer("error", "placement_mismatch")])
    if applies:  # strict as ever: a pass means the entry no longer holds; the failure is expected
        assert not passed.holds and "no longer holds" in passed.unmet[0].message
        assert failed.holds and len(failed.expected) == 1
    else:  # not applied: a pass is fine, and the failure it would have accepted is news
        assert passed.holds and not passed.unmet
        assert [e.index for e, _ in passed.not_applicable] == [1]
        assert passed.not_applicable[0][1] == [f"torch {version} is not >= 2.13"]
        assert not failed.holds and len(failed.unexpected) == 1
    json_ = passed.to_json()
    assert json_["environment"]["torch"] == version and len(json_["not_applicable"]) == (0 if applies else 1)


def test_when_backend_and_device_and_opacus():
    exp = parse(WHEN_FILE.replace('backend = "gloo"', 'device = "cuda", opacus = ">= 1.6, < 1.7"'), "w.toml",
                properties=list(PROPERTIES))
    env = {"torch": "2.13.0", "opacus": "1.6.0", "backend": "nccl", "device": "cuda"}
    assert exp.entries[0].applies(env)
    assert not exp.entries[0].applies({**env, "device": "cpu"})
    assert not exp.entries[0].applies({**env, "opacus": "1.7.0"})
    assert not exp.entries[0].applies({**env, "opacus": None})  # not installed: no version meets a range
    assert environment("nccl")["device"] == "cuda" and environment("gloo")["device"] == "cpu"
    assert version_in_range("2.13", "== 2.13.0") and not version_in_range("2.13.1", "< 2.13.1, >= 2.11")


@pytest.mark.parametrize("when, says", [
    ('{ torch = "2.13" }', "is not a version range"),
    ('{ torch = ">= two" }', "is not a version range"),
    ('{ cuda = ">= 12" }', "unknown when key 'cuda'"),
    ('{ backend = "mpi" }', "is not one of gloo, nccl"),
    ('">= 2.13"', "'when' must be a table"),
])
def test_bad_when_is_refused_with_one_line(when, says):
    with pytest.raises(ExpectationsError, match=says):
        parse(WHEN_FILE.replace('{ torch = ">= 2.13", backend = "gloo" }', when), "w.toml",
              properties=list(PROPERTIES))


def test_shipped_finding_3_needs_torch_2_13():
    exp = expectations.load("opacus-1.6.0")
    # finding 3, and the same mechanism on the real LoRA adapter at 3 ranks (docs/findings.md R4)
    placement = [e for e in exp.entries if e.diagnosis == "placement_mismatch"]
    # finding 3 at its d_ff=1 case and at noise_calibration's one-row case, then the LoRA adapter's
    assert [e.config.get("model") for e in placement] == [None, None] + ["llama_lora"] * 3
    base = {"opacus": "1.6.0", "backend": "gloo", "device": "cpu"}
    for entry in placement:
        assert entry.when == {"torch": ">= 2.13"}
        assert not entry.applies({**base, "torch": "2.11.0+cu130"}) and entry.applies({**base, "torch": "2.14.1"})
    # the real architectures' crashes are pinned to the transformers they were measured with (R1, R3)
    measured = [e for e in exp.entries if "transformers" in e.when]
    assert {e.config["model"] if isinstance(e.config["model"], str) else tuple(e.config["model"])
            for e in measured} == {"gpt2", ("bert", "vit")}
    for entry in measured:
        assert entry.when == {"transformers": ">= 5.18, < 5.19"}
        assert entry.applies({**base, "transformers": "5.18.0"}) and not entry.applies({**base, "transformers": None})
    others = [e for e in exp.entries if e not in placement and e not in measured]
    assert all(not e.when for e in others)  # every other entry holds everywhere


# -- item 4: --dry-run ---------------------------------------------------------------------------


#: run in a fresh interpreter: torch and numpy cannot be imported at all (a finder refuses them), no rank
#: can start; prints whether opacus was imported
NO_TORCH_PROBE = (
    "import sys\n"
    "class Refuse:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('torch', 'numpy'):\n"
    "            raise ImportError('the dry run imported ' + name)\n"
    "sys.meta_path.insert(0, Refuse())\n"
    "from dpfsdp_verify.harness import group\n"
    "def refuse(*a, **k): raise AssertionError('a rank was started')\n"
    "group.WorkerGroup.__init__ = refuse\n"
    "from dpfsdp_verify.gate import cli\n"
    "code = cli.main(['run', '--dry-run'] + sys.argv[1:])\n"
    "print('RESULT', code, 'opacus' in sys.modules, 'torch' in sys.modules)\n")


@pytest.mark.parametrize("argv", [["--expect", "opacus-1.6.0"],
                                  ["--meshes", "hsdp:2x2,tp:2x2"],
                                  ["--properties", "privacy_audit,noise_calibration", "--precisions", "bf16-fsdp"],
                                  ["--models", "lora,tied,masked,zoo", "--physical-batch-size", "2"]],
                         ids=["default", "meshes", "audit-bf16", "models-accumulation"])
def test_dry_run_starts_nothing_and_imports_neither_torch_nor_opacus(argv):
    """The plan of a gloo run needs no torch: its clip bounds and parameter shapes are the run's to
    compute (``Options.planning``, which the dry run sets); the cases are the same (next test)."""
    done = subprocess.run([sys.executable, "-c", NO_TORCH_PROBE, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    result = [line.split() for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert result and result[0][1:] == ["0", "False", "False"], done.stdout + done.stderr
    assert "GPUs needed: 0" in done.stdout and "estimated" in done.stdout


@pytest.mark.parametrize("argv", [pytest.param([], marks=pytest.mark.slow),  # ~4 s of reference norms idle
                                  pytest.param(["--meshes", "hsdp:2x2,tp:2x2"], marks=pytest.mark.slow),
                                  ["--properties", "privacy_audit,noise_calibration,clipped_step",
                                   "--world-sizes", "1,2", "--precisions", "fp32,bf16-fsdp"]],
                         ids=["default", "meshes", "audit-bf16"])
def test_dry_run_plans_the_cases_a_run_plans(argv):
    """With ``Options.planning`` every case is planned as a run plans it (same properties, world sizes,
    meshes and skips); only the values a run derives from the reference (C, draws) are placeholders."""
    from dpfsdp_verify.gate.dryrun import describe
    from dpfsdp_verify.gate.plan import RunPlan

    plan = RunPlan.from_args(cli.build_parser().parse_args(["run", *argv]), load_target=False)
    dry, real = describe(plan), describe(plan, planning=False)
    assert [(p.property, dict(p.cases), p.skips) for p in dry.properties] == \
        [(p.property, dict(p.cases), p.skips) for p in real.properties]
    assert dry.n_cases >= 40


def test_dry_run_usage_errors_exit_2(capsys):
    assert cli.main(["run", "--dry-run", "--world-sizes", "0"]) == cli.EXIT_USAGE
    assert "world sizes must be >= 1" in capsys.readouterr().err
    assert cli.main(["run", "--dry-run", "--launcher", "torchrun"]) == cli.EXIT_USAGE or "WORLD_SIZE" in os.environ

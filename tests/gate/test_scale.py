"""``dpfsdp-verify scale``: the at-scale hang risk of a DP data pipeline, from its own draws.

Every draw below is seeded (``per_rank``/``same`` with a fixed ``--seed``), so each figure and
each agreement verdict is deterministic: a failure here is a change, never a flaky draw.
Cheap: a few hundred nominal steps (the benchmark in docs/scale.md uses 1000 at 1024 ranks).
"""

from __future__ import annotations

import json
import re
import time

import pytest

from dpfsdp_verify.gate import cli
from dpfsdp_verify.gate.scale import ScaleConfig, closed_forms, scale_report, wilson
from dpfsdp_verify.targets import load_target

C = "fixtures.specimens:Correct"
P = "fixtures.poisson_specimens:"
S = "fixtures.scale_specimens:"


def _report(ref, **kw):
    return scale_report(load_target(ref), ScaleConfig(**kw), ref)


def _by_ws(report):
    return {r["world_size"]: r for r in report["world_sizes"]}


def test_wilson_interval_known_values():
    est, lo, hi = wilson(0, 10)
    assert est == 0 and lo == 0 and abs(hi - 0.2775) < 1e-3
    est, lo, hi = wilson(5, 10)
    assert abs(lo - 0.2366) < 1e-3 and abs(hi - 0.7634) < 1e-3


def test_correct_lock_step_never_diverges_and_empties_match_closed_form():
    # ws=16 does not divide N=330: ranks own 21 or 20 samples (n_r differs by rank); b ~ 2
    rows = _by_ws(_report(C, dataset_size=330, sample_rate=0.1, world_sizes=(4, 16), steps=300,
                          physical_batch_size=2, seed=3))
    r = rows[16]
    assert r["rank_samples"] == [20, 21] and not r["skips_empty"] and r["nominal_steps_seen"]
    # a lock-step pipeline: empty local batches happen often, yet the ranks never diverge
    assert r["some_rank_empty"]["mc"] > 0.5
    assert r["some_rank_empty"]["agrees"] and r["rank_empty"]["agrees"]
    cf = 1 - (1 - 0.9 ** 21) ** 10 * (1 - 0.9 ** 20) ** 6
    assert abs(r["some_rank_empty"]["closed_form"] - cf) < 1e-12
    assert r["diverge"]["mc"] == 0 and r["diverge"]["closed_form"] == 0 and r["diverge"]["agrees"]
    assert r["diverge"]["closed_form_if_skipping"] > 0.99   # what skipping would have cost
    assert r["hang_step"]["mc"] is None
    # accumulation still pairs collectives across steps: pass counts differ, as the closed form says
    assert r["passes_differ"]["mc"] > 0.5 and r["passes_differ"]["agrees"]
    assert r["rate_per_step_taken"]["agrees"] and r["rate_per_step_taken"]["closed_form"] == 0.1
    assert abs(r["size_correlation"]["mc"]) < 4 * r["size_correlation"]["noise"]


def test_upstream_opacus_hangs_at_512_ranks_with_b_2():
    """Upstream's distributed Poisson sampler skips empty local batches: at 512 ranks and an
    expected local batch of 2 the ranks' step counts diverge in every epoch, as the closed form
    says; at 8 ranks (b = 128) nothing is ever empty and nothing diverges."""
    rows = _by_ws(_report("opacus", dataset_size=102400, sample_rate=0.01, world_sizes=(8, 512), steps=300,
                          physical_batch_size=2, seed=0))
    big = rows[512]
    assert big["expected_local_batch"] == 2 and big["skips_empty"]
    assert big["source"].startswith("sample_masks") and big["verified_pairs"] >= 10
    assert big["diverge"]["mc"] == 1.0 and big["diverge"]["closed_form"] > 0.999 and big["diverge"]["agrees"]
    assert big["some_rank_empty"]["mc"] == 1.0 and big["some_rank_empty"]["agrees"]
    assert big["rank_empty"]["agrees"] and abs(big["rank_empty"]["mc"] - 0.99 ** 200) < 0.01
    assert big["first_divergence_step"]["agrees"] and big["hang_step"]["mc"] < 100
    # skipping empty batches raises the rate per step taken above q (the accountant is told q)
    rate = big["rate_per_step_taken"]
    assert rate["closed_form"] > 0.0115 and rate["agrees"] and rate["ci"][0] > 0.01
    small = rows[8]
    assert not small["skips_empty"] and small["diverge"]["mc"] == 0 and small["diverge"]["agrees"]


def test_skipping_specimen_without_nominal_steps():
    """A skipping pipeline seen only through sample_batches: the divergence is measured, the
    per-step empty probability is not (it does not say which steps it skipped)."""
    r = _by_ws(_report(P + "SkipEmptyLocalBatch", dataset_size=640, sample_rate=0.1, world_sizes=(32,), steps=100,
                       seed=1))[32]
    assert r["skips_empty"] and not r["nominal_steps_seen"]
    assert r["diverge"]["mc"] == 1.0 and r["diverge"]["agrees"]
    assert r["some_rank_empty"]["mc"] is None and r["rank_empty"]["agrees"]


def test_correlated_ranks_are_seen():
    """Ranks seeded alike draw identical masks (CorrelatedAcrossRanks; opacus under ``same``):
    the local batch sizes correlate ~1 and the independent-ranks closed form is refuted."""
    bad = _by_ws(_report(P + "CorrelatedAcrossRanks", dataset_size=320, sample_rate=0.1, world_sizes=(16,),
                         steps=200, seeding="same", seed=2))[16]
    assert bad["size_correlation"]["mc"] > 0.99 and bad["some_rank_empty"]["agrees"] is False
    good = _by_ws(_report(C, dataset_size=320, sample_rate=0.1, world_sizes=(16,), steps=200, seeding="same",
                          seed=2))[16]
    assert abs(good["size_correlation"]["mc"]) < 4 * good["size_correlation"]["noise"]
    up = _by_ws(_report("opacus", dataset_size=1600, sample_rate=0.01, world_sizes=(16,), steps=100,
                        seeding="same"))[16]
    assert up["size_correlation"]["mc"] > 0.99 and up["diverge"]["mc"] == 0


def test_fast_path_is_checked_against_the_real_sampler():
    """A replay that models the sampler (every rank one mask) would report no hang risk for a job
    that hangs; it is refused and the real sampler is iterated instead, saying so."""
    r = _by_ws(_report(S + "MaskReplayIgnoresSeeding", dataset_size=1600, sample_rate=0.01, world_sizes=(16,),
                       steps=100))[16]
    assert "does not replay the target's sampler" in r["fast_path_refused"] and r["source"] == "sample_batches"
    assert r["skips_empty"] and r["diverge"]["mc"] == 1.0 and r["size_correlation"]["mc"] < 0.5
    good = _by_ws(_report("opacus", dataset_size=1600, sample_rate=0.01, world_sizes=(16,), steps=100))[16]
    assert good["fast_path_refused"] is None and good["verified_pairs"] >= 10
    assert good["diverge"]["mc"] == 1.0


def test_closed_form_some_rank_empty_formula():
    cfg = ScaleConfig(dataset_size=102400, sample_rate=0.01, world_sizes=(512,))
    cf = closed_forms(cfg, 512, skips=True)
    assert abs(cf["some_rank_empty"] - (1 - (1 - 0.99 ** 200) ** 512)) < 1e-12
    assert cf["diverge"] > 0.999


# -- CLI ------------------------------------------------------------------------------------


def _cli(capsys, *argv):
    code = cli.main(["scale", *argv])
    return code, capsys.readouterr()


BASE = ["--target", C, "--dataset-size", "320", "--sample-rate", "0.1", "--world-sizes", "2,16", "--steps", "50"]


@pytest.mark.parametrize("args, needle", [
    (["--sample-rate", "0"], "--sample-rate must be in (0, 1]"),
    (["--sample-rate", "1.5"], "--sample-rate must be in (0, 1]"),
    (["--dataset-size", "8", "--world-sizes", "16"], "smaller than world size 16"),
    (["--physical-batch-size", "0"], "--physical-batch-size must be a positive int"),
    (["--world-sizes", "0,8"], "--world-sizes must be a comma list of positive ints"),
    (["--world-sizes", "a,b"], "--world-sizes must be a comma list of positive ints"),
    (["--seeding", "rank"], "unknown --seeding"),
    (["--target", "fixtures.gate_specimens:WithoutDataPipeline"],
     "implement Target.sample_batches(spec, rank=None, world_size=None)"),
    (["--target", S + "OldSignatureSampleBatches"], "older sample_batches(spec); scale needs"),
    (["--target", "opacus", "--sample-rate", "0.03"], "opacus derives q = 1/len(data_loader)"),
])
def test_bad_input_exits_2_with_one_line(capsys, args, needle):
    code, out = _cli(capsys, *BASE, *args)
    assert code == 2
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "hint:" in lines[0], out.err


def test_a_rate_opacus_cannot_run_is_refused_before_anything_is_drawn(capsys):
    """The pipeline of issue 25: 1e6 samples, q = 0.001 at 8, 64, 512 and 1024 ranks. opacus runs
    q = 1/len(data_loader) only: 0.001 at 8 ranks (125 local samples per step), not at the others.
    Refused in seconds (it drew 8 ranks for 2 minutes, then listed ~250 rates), naming the two rates
    nearest to q at the first refused size, and every size refused."""
    t0 = time.perf_counter()
    code, out = _cli(capsys, "--target", "opacus", "--dataset-size", "1000000", "--sample-rate", "0.001",
                     "--world-sizes", "8,64,512,1024")
    took = time.perf_counter() - t0
    lines = out.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and not out.out, out
    # 64 ranks hold 15625 samples each: local batch 15 gives 1042 steps, 16 gives 977
    assert "world size 64:" in lines[0] and "1/1042 = 0.000959693 and 1/977 = 0.00102354" in lines[0]
    assert "also refused at world size(s) 512, 1024" in lines[0]
    assert "hint: --sample-rate 0.000959693 or 0.00102354 runs at world size 64" in lines[0]
    decimals = re.findall(r"\d+\.\d+", lines[0])
    assert len(decimals) <= 6, decimals  # q and the two nearest rates, twice: not a wall of numbers
    assert took < 20, took  # one step of rank 0 per world size (loaded 2-core machine: ~1 s of CPU)


def test_plot_without_matplotlib_exits_2_naming_the_extra(capsys, tmp_path):
    try:
        import matplotlib  # noqa: F401
        pytest.skip("matplotlib is installed")
    except ImportError:
        pass
    code, out = _cli(capsys, *BASE, "--plot", str(tmp_path / "risk.png"))
    assert code == 2 and "pip install matplotlib" in out.err and len(out.err.strip().splitlines()) == 1
    assert not (tmp_path / "risk.png").exists()


def test_json_fields(capsys, tmp_path):
    path = tmp_path / "scale.json"
    code, out = _cli(capsys, *BASE, "--physical-batch-size", "2", "--json", str(path))
    assert code == 0 and "world size 16" in out.out
    data = json.loads(path.read_text())
    assert set(data) == {"target", "config", "world_sizes"}
    assert data["config"] == {"dataset_size": 320, "sample_rate": 0.1, "physical_batch_size": 2,
                              "seeding": "per_rank", "steps": 50, "seed": 0, "world_sizes": [2, 16]}
    row = data["world_sizes"][1]
    assert {"world_size", "expected_local_batch", "rank_samples", "trials", "steps_per_epoch", "source",
            "verified_pairs", "skips_empty", "nominal_steps_seen", "rank_empty", "some_rank_empty", "diverge",
            "hang_step", "first_divergence_step", "passes_differ", "rate_per_step_taken", "size_correlation",
            "seconds", "fast_path_refused"} == set(row)
    for key in ("rank_empty", "some_rank_empty", "diverge", "passes_differ"):
        assert {"mc", "ci", "n", "closed_form", "agrees"} <= set(row[key])
    assert row["trials"] == 5 and row["steps_per_epoch"] == 10


def test_plot_writes_risk_vs_world_size(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "risk.svg"
    code, _ = _cli(capsys, *BASE, "--plot", str(path))
    assert code == 0 and "<svg" in path.read_text()


def test_matplotlib_is_only_the_plot_extra():
    from importlib import metadata

    from packaging.requirements import Requirement

    def names(extra):
        reqs = (Requirement(t) for t in metadata.requires("dpfsdp-verify") or [])
        return {r.name for r in reqs if r.marker is None or r.marker.evaluate({"extra": extra})}

    assert "matplotlib" in names("plot") and "matplotlib" not in names("")

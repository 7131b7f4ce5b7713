"""2-D meshes (``--meshes``, ``docs/meshes.md``): the mesh reference against hand computations,
the gate's option and its usage errors, and -- at 4 gloo ranks -- the correct specimen passing on
HSDP and data x tensor parallel while each mesh specimen (``fixtures/mesh_specimens.py``) fails
with its property and diagnosis, and upstream opacus' verdicts on both meshes."""

import json

import pytest
import torch

import dpfsdp_verify.properties as props
from dpfsdp_verify.gate import cli
from dpfsdp_verify.targets.mesh import (Mesh, MeshError, rank_samples, replica_positions, split_norm_sq,
                                        world_summed_norms)
from dpfsdp_verify.properties.engine.contract import Options
from dpfsdp_verify.targets.base import RunSpec
from dpfsdp_verify.verdict import DIAGNOSES
from tests.verdict_helpers import assert_all_pass

S = "fixtures.specimens:"
M = "fixtures.mesh_specimens:"
HSDP, TP = "hsdp:2x2", "tp:2x2"


# -- the reference on a 2-D mesh, by hand ---------------------------------------------------------
def test_mesh_layouts_by_hand():
    hsdp, tp = Mesh.parse(HSDP), Mesh.parse("tp:2x3")
    # HSDP: every rank trains on its own samples; replicas of a shard are a column of the mesh
    assert hsdp.dim_names == ("replicate", "shard") and hsdp.data_degree == 4
    assert [hsdp.data_rank(r) for r in range(4)] == [0, 1, 2, 3]
    assert hsdp.replica_groups() == [[0, 2], [1, 3]] and hsdp.data_ranks() == [0, 1, 2, 3]
    # data x TP (2 x 3): ranks 0,1,2 are one data replica's TP peers, 3,4,5 the other's
    assert tp.dim_names == ("data", "tensor") and tp.world_size == 6 and tp.data_degree == 2
    assert [tp.data_rank(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert tp.tensor_groups() == [[0, 1, 2], [3, 4, 5]] and tp.replica_groups() == [[0, 3], [1, 4], [2, 5]]
    assert tp.data_ranks() == [0, 3]
    # samples: split over the data-parallel ranks only (8 samples: TP peers see the same 4)
    assert [rank_samples(tp, 8, r) for r in range(6)] == [[0, 2, 4, 6]] * 3 + [[1, 3, 5, 7]] * 3
    assert [rank_samples(hsdp, 8, r) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    spec = RunSpec(mesh="tp:2x3", global_batch_size=8)
    assert spec.rank_indices(0, 4, 6) == [1, 3, 5, 7]
    # the noise std per coordinate is sigma*C/B with B the global batch, whatever the mesh
    assert spec.with_(noise_multiplier=2.0).divisor == 8.0


def test_mesh_norms_by_hand():
    # two samples; a TP-sharded layer "a" (2 coordinates) and a whole layer "b" (1 coordinate)
    grads = {"a.weight": torch.tensor([[3.0, 4.0], [1.0, 2.0]], dtype=torch.float64),
             "b.weight": torch.tensor([[1.0], [2.0]], dtype=torch.float64)}
    sharded, whole = split_norm_sq(grads, ["a.weight"])
    assert sharded.tolist() == [25.0, 5.0] and whole.tolist() == [1.0, 4.0]
    # the true norm: sharded squares summed over the TP shards, the whole layer once: sqrt(26), sqrt(9)
    assert torch.allclose((sharded + whole).sqrt(), torch.tensor([26.0, 9.0], dtype=torch.float64).sqrt())
    tp = Mesh.parse(TP)
    rows = [[0], [0], [1], [1]]  # replica 0 (ranks 0, 1) holds sample 0, replica 1 (ranks 2, 3) sample 1
    assert replica_positions(tp, rows) == [[0, 1]]
    # summed over the world: both replicas' sharded squares (25 + 5), plus each rank's own whole part
    own = world_summed_norms(tp, sharded, whole, rows)
    assert [round(float(x[0] ** 2), 9) for x in own] == [31.0, 31.0, 34.0, 34.0]
    # opacus' rule: sharded part counted once per TP peer (x2), whole part from rank 0's sample only
    opacus = world_summed_norms(tp, sharded, whole, rows, "rank0", 2)
    assert [round(float(x[0] ** 2), 9) for x in opacus] == [61.0] * 4


def test_mesh_names_and_specs_refuse_what_they_cannot_run():
    for bad in ("hsdp", "hsdp:2", "ring:2x2", "tp:0x2", "hsdp:2x2x2"):
        with pytest.raises(MeshError):
            Mesh.parse(bad)
    with pytest.raises(ValueError, match="Poisson sampling runs on HSDP meshes only"):
        RunSpec(mesh=TP, sampling="poisson", sample_rate=0.25, dataset_size=16)
    with pytest.raises(ValueError, match="split batches only"):
        RunSpec(mesh=HSDP, physical_batch_size=2)
    with pytest.raises(ValueError, match="split batches only"):
        RunSpec(mesh=HSDP, data_layout="replicated")
    # every rank of an HSDP mesh is a data-parallel rank: its Poisson sampler is the 1-D one
    assert RunSpec(mesh=HSDP, sampling="poisson", sample_rate=0.25, dataset_size=16).poisson
    with pytest.raises(ValueError, match="has 4 ranks, not 2"):
        RunSpec(mesh=HSDP).check_world_size(2)
    # a 1-D spec's JSON line is what it was before meshes existed; a mesh spec round-trips
    assert "mesh" not in RunSpec().to_json()
    assert RunSpec.from_json(RunSpec(mesh=TP).to_json()).mesh == TP


def test_mesh_points_keep_1d_configs_unchanged():
    prop = props.PROPERTIES["norm_fidelity"]
    axes = dict(models=("mlp",), reductions=("mean",), dtypes=("float64",))
    one_d = prop.plan(prop.with_defaults(Options(world_sizes=(2,), **axes)))
    both = prop.plan(prop.with_defaults(Options(world_sizes=(2,), meshes=(HSDP, TP), **axes)))
    assert [c.config() for c in both[:len(one_d)]] == [c.config() for c in one_d]
    assert all("mesh" not in c.config() for c in one_d)
    meshed = both[len(one_d):]
    assert [(c.config()["mesh"], c.world_size) for c in meshed] == [(HSDP, 4), (TP, 4)]
    # options a mesh does not run (accumulation) leave its cases as they are, never a spec it refuses
    for pid in ("clipped_step", "trajectory"):
        p = props.PROPERTIES[pid]
        opts = p.with_defaults(Options(world_sizes=(), meshes=(HSDP,), params=(("physical_batch_size", 2),), **axes))
        assert all(c.spec.physical_batch_size == 0 and c.spec.mesh == HSDP for c in p.plan(opts))
    assert "--meshes hsdp:2x2" in meshed[0].repro() and "--world-sizes" not in meshed[0].repro()
    # a property that does not run on meshes says so, once per mesh
    dl = props.PROPERTIES["deadlock_free"]
    skips = [v for v in dl.plan(dl.with_defaults(Options(world_sizes=(2,), meshes=(HSDP,)))) if not hasattr(v, "spec")]
    assert [(v.status, v.config["mesh"]) for v in skips] == [("skip", HSDP)]


@pytest.mark.parametrize("args, says", [
    (["--meshes", "ring:2x2"], "unknown mesh kind 'ring'"),
    (["--meshes", "hsdp:2"], "is not KIND:AxB"),
    (["--meshes", "hsdp:4x5"], "20 gloo ranks is more than"),
])
def test_meshes_usage_errors_exit_2_with_one_line(capsys, args, says):
    assert cli.main(["run", "--properties", "clipped_step", *args]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert says in err and err.startswith("dpfsdp-verify: error:") and "hint:" in err, err
    assert len(err.splitlines()) == 1


def test_torchrun_job_size_must_be_the_meshes():
    from dpfsdp_verify.gate.plan import UsageError, parse_meshes

    assert parse_meshes("hsdp:2x2,tp:2x2,hsdp:2x2", "gloo") == [HSDP, TP]
    with pytest.raises(UsageError, match="is not this torchrun job's 2 ranks"):
        parse_meshes(HSDP, "gloo", job_world_size=2)


def test_mesh_diagnoses_are_in_the_vocabulary():
    assert {"replica_divergence", "replicated_counted", "sample_mixing"} <= set(DIAGNOSES)
    schema = json.load(open(props.__file__.rsplit("/", 2)[0] + "/schema/report.schema.json"))
    assert "replica_divergence" in json.dumps(schema) and "replicated_counted" in json.dumps(schema)


# -- 4 gloo ranks: Correct passes, each specimen fails with its diagnosis -------------------------
def run(pool, prop, target, mesh, **kw):
    kw.setdefault("timeout", 120)
    kw.setdefault("models", ("mlp",))
    kw.setdefault("dtypes", ("float64",))
    kw.setdefault("reductions", ("mean",))
    out = props.run(prop, target, pool=pool, world_sizes=(), meshes=(mesh,), **kw)
    assert out and all(v.config.get("mesh") == mesh for v in out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [HSDP, TP])
def test_correct_passes_on_meshes(pool, mesh):
    for prop in ("norm_fidelity", "clipped_step", "noise_calibration", "trajectory"):
        assert_all_pass(run(pool, prop, S + "Correct", mesh))


@pytest.mark.slow
@pytest.mark.parametrize("target, mesh, prop, diagnosis, says", [
    ("PerRankNoiseStreams", HSDP, "noise_calibration", "replica_divergence", "must add the IDENTICAL noise"),
    ("PerRankNoiseStreams", HSDP, "trajectory", "replica_divergence", "replicas drift apart"),
    ("NoiseDividedByShardGroup", HSDP, "noise_calibration", "mismatch", "2 = W/S: noise divided by the shard group"),
    ("NormsSummedOverWorld", TP, "norm_fidelity", "sample_mixing", "-- (0, 1), (2, 3)"),
    ("ReplicatedCountedOnEveryPeer", TP, "norm_fidelity", "replicated_counted", "counted once"),
    ("NoiseDividedByWorld", TP, "noise_calibration", "mismatch", "1/2 = D/W: noise divided by the world size"),
    ("SamplerSplitOverPeers", TP, "clipped_step", "mismatch", "processed samples [0, 4, 8, 12] but was given [0, 2, 4, "
     "6, 8, 10, 12, 14] (missing [2, 6, 10, 14]): the data path does not feed each rank the samples it was given (on "
     "tp:2x2 the 2 tensor-parallel peers of a data replica share its samples"),
])
def test_mesh_specimen_fails_with_its_diagnosis(pool, target, mesh, prop, diagnosis, says):
    vs = run(pool, prop, M + target, mesh)
    failed = [v for v in vs if v.status == "fail"]
    assert failed and all(v.diagnosis == diagnosis for v in failed), [(v.diagnosis, v.message) for v in vs]
    assert says in failed[0].message, failed[0].message


@pytest.mark.slow
def test_per_rank_noise_streams_pass_1d_and_fail_hsdp(pool):
    one_d = props.run("trajectory", M + "PerRankNoiseStreams", pool=pool, world_sizes=(2,), models=("mlp",),
                      reductions=("mean",), timeout=120)
    assert_all_pass(one_d)
    drift = [v for v in run(pool, "trajectory", M + "PerRankNoiseStreams", HSDP) if v.status == "fail"]
    assert [v.config.get("noise_multiplier") for v in drift] == [1.0]  # the noise-0 case cannot drift
    assert drift[0].evidence["replica_divergence"]["step"] == 0


@pytest.mark.slow
def test_upstream_on_meshes(pool):
    """opacus 1.6.0 (docs/findings.md, the mesh findings): HSDP right under 'mean'; data x TP mixes
    the data replicas' samples and divides the noise by the world size."""
    hsdp = run(pool, "clipped_step", "opacus", HSDP) + run(pool, "trajectory", "opacus", HSDP)
    assert_all_pass(hsdp)
    norms = run(pool, "norm_fidelity", "opacus", TP)
    assert [(v.status, v.diagnosis) for v in norms] == [("fail", "sample_mixing")]
    assert "merge_flag=False" in norms[0].message
    noise = run(pool, "noise_calibration", "opacus", TP)
    assert [(v.status, v.diagnosis) for v in noise] == [("fail", "mismatch")]
    assert "D/W: noise divided by the world size" in noise[0].message

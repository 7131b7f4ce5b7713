"""Specimens on the real architectures (``fixtures/real_model_specimens.py``): ``RealCorrect``
passes ``norm_fidelity`` on every one of them, and each architecture's one-bug copy fails it with
the diagnosis and the layer or parameter named by the model's own names. Needs the ``models``
extra (skips without it); two ranks, split data, float64, one reduction: the smallest case that
shows each bug."""

from __future__ import annotations

import dataclasses

import pytest

import dpfsdp_verify.properties as props
from dpfsdp_verify.properties import PROPERTIES
from dpfsdp_verify.models.catalog import REAL_MODELS

pytest.importorskip("transformers", reason="the models extra (pip install -e '.[models]') is not installed")
pytest.importorskip("peft", reason="the models extra (pip install -e '.[models]') is not installed")

S = "fixtures.real_model_specimens:"

#: (specimen, model, diagnosis, words its message must hold: the layer or parameter by the model's own names)
SPECIMENS = [
    ("Gpt2PositionSummed", "gpt2", "sample_mixing",
     ["take parameter 'transformer.wpe.weight''s per-sample gradient as its sum over the local batch"]),
    ("LlamaRMSNormLeftOut", "llama", "undercount",
     ["leave out every LlamaRMSNorm layer", "'model.layers.0.input_layernorm'", "'model.norm'"]),
    ("Qwen2KeyProjectionLeftOut", "qwen2", "undercount",
     ["leave out parameters", "'model.layers.0.self_attn.k_proj.weight'", "'model.layers.0.self_attn.k_proj.bias'"]),
    ("BertTokenTypeLeftOut", "bert", "undercount",
     ["leave out parameter 'bert.embeddings.token_type_embeddings.weight'"]),
    ("ViTPositionLeftOut", "vit", "undercount", ["ViTEmbeddings layer 'vit.embeddings'"]),
    ("ResNetDownsampleNormLeftOut", "resnet_gn", "undercount",
     ["leave out parameters", "'layer2.downsample.1.weight'", "'layer2.downsample.1.bias'"]),
    ("LoRAValueLeftOut", "llama_lora", "undercount",
     ["leave out parameter 'base_model.model.model.layers.0.self_attn.v_proj.lora_B.default.weight'"]),
]


def _run(pool, target, model, ws=2):
    prop = PROPERTIES["norm_fidelity"]
    # the property's own cases for this model only (not the zoo's, nor the large-batch one)
    case = dataclasses.replace(prop, cases=lambda point: [c for c in prop.cases(point) if c.spec.model == model])
    return props.run(case, target, pool=pool, world_sizes=(ws,), data_layouts=("split",), reductions=("mean",),
                     dtypes=("float64",), models=(model,), timeout=300)


@pytest.mark.parametrize("specimen, model, diagnosis, words", SPECIMENS, ids=[s[0] for s in SPECIMENS])
def test_each_real_specimen_fails_norm_fidelity_naming_its_layer(pool, specimen, model, diagnosis, words):
    [v] = _run(pool, S + specimen, model)
    assert (v.status, v.diagnosis) == ("fail", diagnosis), v.message
    assert all(w in v.message for w in words), v.message


@pytest.mark.slow
@pytest.mark.parametrize("model", REAL_MODELS)
def test_real_correct_passes_every_real_model(pool, model):
    for ws in (1, 2):
        [v] = _run(pool, S + "RealCorrect", model, ws)
        assert v.status == "pass", (model, ws, v.message)

"""The models' names, sizes and knobs, without torch: what a plan reads (``dpfsdp_verify.models``
builds the models and batches from them and re-exports every name here).

The planning path (``run --dry-run``, the property registry, the configuration space) validates
model names and dimensions here without importing torch (``dpfsdp_verify.lazy``).
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

#: the models every property runs on by default (all parameters trainable, none tied)
BASE_MODELS = ("mlp", "conv", "transformer")
#: the fine-tuning models (``docs/finetune.md``): a frozen base with LoRA adapters, and a tiny LM
#: whose output head is its token embedding (tied weights); properties run them under ``--models``
FINETUNE_MODELS = ("lora", "tied")
#: variable-length sequences (``docs/sequences.md``): padded to a common length, an attention mask
#: that hides padding, ``IGNORE_INDEX`` targets on it, and an all-padding sequence in every batch
SEQUENCE_MODELS = ("masked",)
#: one model holding every layer type opacus' ghost clipping samples (``LayerZoo``): the norm property runs
#: it once per world size, so a norm registry that misses a layer type shows, naming it
ZOO_MODELS = ("zoo",)
#: samples of every scale (``ExtremeMLP``): per-sample norms from ~1 to ~1e20 in one batch
EXTREME_MODELS = ("extreme",)
#: gradient canaries with secret membership (``CanaryLayers``: embedding rows and Linear columns): the
#: privacy audit's model (``docs/audit.md``)
AUDIT_MODELS = ("canary",)
MODEL_NAMES = BASE_MODELS + FINETUNE_MODELS + SEQUENCE_MODELS + ZOO_MODELS + EXTREME_MODELS + AUDIT_MODELS
#: the input scale of sample ``i`` of an ``extreme`` batch: ``EXTREME_SCALES[i % 6]``. Its per-sample
#: gradient norm is about the scale (``ExtremeMLP``): ~1, ~1e2, ~1e6 and ~1e20, whose square (1e40)
#: overflows float32 (largest finite 3.4e38)
EXTREME_SCALES = (1.0, 1.0, 1e2, 1.0, 1e6, 1e20)

#: Sizes kept tiny on purpose: a 2-rank FSDP step on 2 CPU cores must cost milliseconds. Every
#: sharded dim (dim 0) is at least 8, so every rank up to 8 holds rows of every parameter's
#: dim-0 range or an empty shard past its end, never a parameter shorter than the world size
#: (opacus 1.6.0 crashes on those: docs/findings.md, finding 3; the DP-step check keeps one such case);
#: and none is divisible by 3, 4 or 8 (10, 11, 19 and 29), so at 2, 3, 4 and 8 ranks FSDP2's
#: ``ceil(dim0 / world_size)`` shards leave a short last shard or empty ones somewhere in each
#: model -- a shard-offset bug that holds only for full shards must show. The vocabulary (29) is
#: larger than a batch of 4 sequences of ``SEQ_LEN`` 10 tokens can cover, so some embedding rows
#: get no gradient (noise must still reach them: the noise check on unused embedding rows).
MLP_IN, MLP_HIDDEN, MLP_CLASSES = 6, 11, 10
CONV_CHANNELS, CONV_SIZE, CONV_CLASSES = 2, 6, 10
CONV_WIDTH, CONV_GROUPS, CONV_MIXER = 10, 2, 11
VOCAB, SEQ_LEN, D_MODEL, N_HEADS = 29, 10, 10, 2
LORA_RANK = 2
TIES = ("head", "none")
IGNORE_INDEX = -100
#: the padding token of the ``masked`` model (real tokens are ``1..vocab-1``)
PAD_ID = 0

#: canaries of a ``canary`` model and batch unless ``canaries`` says otherwise
CANARIES = 1000
#: the logits of a ``canary`` model: the embedding's width and the Linear layer's output rows (dim 0,
#: which FSDP shards: 10 rows, so every rank up to 8 holds some or an empty shard past the end)
CANARY_CLASSES = 10

#: The size (and layer-choice) keywords each model takes; ``build_model`` and ``make_batch`` accept
#: exactly these (plus ``BATCH_DIMS``). The batch depends on the ones in ``BATCH_USES``.
MODEL_DIMS = {
    "mlp": ("d_in", "hidden", "classes"),
    "conv": ("channels", "size", "classes", "width", "groups", "mixer"),
    "transformer": ("vocab", "seq_len", "d_model", "n_heads", "norm", "d_ff"),
    "lora": ("d_in", "hidden", "classes", "rank"),
    "tied": ("vocab", "seq_len", "d_model", "tie"),
    "masked": ("vocab", "seq_len", "d_model", "n_heads"),
    "zoo": ("vocab", "classes", "width"),
    "extreme": ("d_in", "hidden", "classes"),
    "canary": ("canaries",),
}
#: keywords only the batch uses (``build_model`` accepts and ignores them)
BATCH_DIMS = ("pad_fraction",)
BATCH_USES = {"mlp": ("d_in", "classes"), "conv": ("channels", "size", "classes"),
               "transformer": ("vocab", "seq_len", "pad_fraction"), "lora": ("d_in", "classes"),
               "tied": ("vocab", "seq_len", "pad_fraction"), "masked": ("vocab", "seq_len"),
               "zoo": ("vocab", "classes"), "extreme": ("d_in", "classes"), "canary": ("canaries",)}


#: Models given by the contract of ``docs/models.md`` (an object with ``build``, ``batch``, ``loss``)
#: under a short built-in name: ``{name: "package.module:ATTR"}``, ATTR a class or zero-argument
#: factory. ``--models NAME`` then runs exactly as ``--models package.module:ATTR`` would; nothing
#: else is needed to add one (the real architectures of ``dpfsdp_verify.models.real`` register here).
#: Real architectures (``dpfsdp_verify.models.real``, the ``models`` extra: transformers, peft), opt-in:
#: tiny random-initialised configs, no download
REAL_MODELS = ("gpt2", "llama", "qwen2", "bert", "vit", "resnet_gn", "llama_lora")
_REAL_CLASSES = ("GPT2", "Llama", "Qwen2", "Bert", "ViT", "ResNetGN", "LlamaLoRA")
CONTRACT_MODELS: Dict[str, str] = {n: f"dpfsdp_verify.models.real:{c}" for n, c in zip(REAL_MODELS, _REAL_CLASSES)}
#: names that stand for several models on ``--models`` (``real``: every real architecture)
MODEL_GROUPS: Dict[str, Tuple[str, ...]] = {"real": REAL_MODELS}

#: ``package.module:ATTR`` (ATTR may be dotted: ``module:Outer.Inner``)
_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_import_path(name: str) -> bool:
    """Whether ``name`` has the form of a user model ``package.module:ATTR`` (nothing imported)."""
    return bool(_IMPORT_PATH.fullmatch(name))


def contract_path(name: str) -> Optional[str]:
    """The ``package.module:ATTR`` a model name is given by (a user's import path, or a short name of
    ``CONTRACT_MODELS``), ``None`` for the built-in models (and unknown names)."""
    if name in CONTRACT_MODELS:
        return CONTRACT_MODELS[name]
    return name if is_import_path(name) else None


def expand_models(names) -> Tuple[str, ...]:
    """``--models`` values with every group (``MODEL_GROUPS``) replaced by its models, duplicates
    dropped, order kept. Raises ``ValueError`` naming an unknown model (torch-free: form only)."""
    out: list = []
    for name in names:
        for one in MODEL_GROUPS.get(name, (name,)):
            if one not in MODEL_DIMS and contract_path(one) is None:
                choices = ", ".join(MODEL_NAMES + tuple(CONTRACT_MODELS) + tuple(MODEL_GROUPS))
                raise ValueError(f"unknown model {one}: choose from {choices}, or give your own as "
                                 "package.module:ATTR (docs/models.md)")
            if one not in out:
                out.append(one)
    return tuple(out)


def check_dims(name: str, dims: dict) -> None:
    if contract_path(name) is not None and name not in MODEL_DIMS:
        if dims:
            raise ValueError(f"model {name!r} (docs/models.md) takes no dimensions, got {sorted(dims)}")
        return
    if name not in MODEL_DIMS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    unknown = sorted(set(dims) - set(MODEL_DIMS[name]) - set(BATCH_DIMS))
    if unknown:
        raise ValueError(f"model {name!r} takes no dimension(s) {unknown}; it takes "
                         f"{', '.join(MODEL_DIMS[name] + BATCH_DIMS)}")


__all__ = ["BASE_MODELS", "FINETUNE_MODELS", "SEQUENCE_MODELS", "ZOO_MODELS", "EXTREME_MODELS", "AUDIT_MODELS",
           "MODEL_NAMES", "EXTREME_SCALES", "MLP_IN", "MLP_HIDDEN", "MLP_CLASSES", "CONV_CHANNELS",
           "CONV_SIZE", "CONV_CLASSES", "CONV_WIDTH", "CONV_GROUPS", "CONV_MIXER", "VOCAB", "SEQ_LEN",
           "D_MODEL", "N_HEADS", "LORA_RANK", "TIES", "IGNORE_INDEX", "PAD_ID", "CANARIES",
           "CANARY_CLASSES", "MODEL_DIMS",
           "BATCH_DIMS", "BATCH_USES", "check_dims", "CONTRACT_MODELS", "MODEL_GROUPS", "is_import_path",
           "contract_path", "expand_models", "REAL_MODELS"]

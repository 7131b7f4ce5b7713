"""The models a run trains: the built-in seeded models and their batches (``builtin``, torch) and
their names, sizes and knobs (``catalog``, torch-free: what a plan reads).

Importing this package imports nothing heavy: ``from dpfsdp_verify import models`` then
``models.build_model(...)`` loads ``builtin`` (and torch) on first use, so ``models.catalog`` stays
usable on the torch-free planning path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names below are builtin's; at run time they are loaded on first use
    from .builtin import (AUDIT_MODELS, BASE_MODELS, BATCH_DIMS, BATCH_USES, CANARIES, CANARY_CLASSES, CONV_CHANNELS,
                          CONV_CLASSES,
                          CONV_GROUPS, CONV_MIXER, CONV_SIZE, CONV_WIDTH, D_MODEL, EXTREME_MODELS, EXTREME_SCALES,
                          FINETUNE_MODELS, IGNORE_INDEX, LORA_RANK, MLP, MLP_CLASSES, MLP_HIDDEN, MLP_IN, MODEL_DIMS,
                          MODEL_NAMES, N_HEADS, PAD_ID, SEQ_LEN, SEQUENCE_MODELS, TIES, VOCAB, ZOO_MODELS, Batch,
                          CanaryLayers, ConvNet, ExtremeMLP, LayerZoo, MaskedEncoder, TinyGPT, build_model,
                          canary_secrets, check_dims, embedded_canaries, make_batch, sequence_lengths)

__all__ = ["build_model", "make_batch", "Batch", "MODEL_NAMES", "MODEL_DIMS", "IGNORE_INDEX", "PAD_ID", "MLP",
           "ConvNet", "TinyGPT", "MaskedEncoder", "LayerZoo", "ExtremeMLP", "EXTREME_SCALES",
           "sequence_lengths", "CanaryLayers", "embedded_canaries", "CANARY_CLASSES", "canary_secrets", "CANARIES",
           "AUDIT_MODELS",
           "BASE_MODELS", "FINETUNE_MODELS", "SEQUENCE_MODELS", "ZOO_MODELS", "EXTREME_MODELS", "MLP_IN",
           "MLP_HIDDEN", "MLP_CLASSES", "CONV_CHANNELS", "CONV_SIZE", "CONV_CLASSES", "CONV_WIDTH",
           "CONV_GROUPS", "CONV_MIXER", "VOCAB", "SEQ_LEN", "D_MODEL", "N_HEADS", "LORA_RANK", "TIES",
           "BATCH_DIMS", "BATCH_USES", "check_dims"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import builtin
        return getattr(builtin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

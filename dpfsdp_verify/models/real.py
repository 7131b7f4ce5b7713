"""Real architectures as user models: tiny random-initialised configs of ``transformers`` and
``peft`` models and a GroupNorm ResNet, each a class with the user-model contract (``docs/models.md``)::

    build(seed) -> torch.nn.Module          # the same weights for the same seed
    batch(n, seed) -> (inputs, targets)     # inputs: a tensor, or a dict of keyword tensors (dim 0 = sample)
    loss(output, targets) -> [n]            # per-sample losses

No weights are downloaded and nothing touches the network: every model is built from a config in
this file. The libraries are imported only when a model is built (the ``models`` extra:
``pip install "dpfsdp-verify[models]"``); without them ``build`` raises ``ModelDependencyError``
with the install line.

Sizes follow the built-in models (``catalog``): vocabulary 29, sequences of 10 tokens, width 10,
MLP width 19, so FSDP2's dim-0 shards come out uneven at 2, 3 and 4 ranks somewhere in every
model. Dropout is off (a per-sample gradient must be a function of the sample). Output heads are
untied from the input embeddings: opacus 1.6.0 refuses tied parameters under FSDP (``tied`` in
``docs/finetune.md``), and a model that is refused at set-up gives no verdict on anything else.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn.functional as F

from .batch import seed_cpu
from .builtin import sequence_lengths
from .catalog import D_MODEL, IGNORE_INDEX, MLP_CLASSES, PAD_ID, SEQ_LEN, VOCAB

#: the MLP width of every real model (not divisible by 2, 3, 4 or 8)
D_FF = 19
#: images of the vision models: ``IMAGE_CHANNELS`` x ``IMAGE_SIZE`` x ``IMAGE_SIZE``
IMAGE_CHANNELS, IMAGE_SIZE = 2, 6
#: the LoRA rank of ``llama_lora`` and the modules it adapts
LORA_RANK, LORA_TARGETS = 2, ("q_proj", "v_proj")
#: the standard deviation of the transformers models' initial weights (theirs is 0.02: attention
#: logits then stay near 0, the attention near uniform, and the query and key projections' share
#: of a sample's gradient norm below float64's tolerance -- a check that leaves them out could not tell)
INIT_STD = 0.3
#: the token a ``bert`` batch hides a masked-LM target behind (real tokens are ``1..VOCAB-2``)
MASK_ID = VOCAB - 1

_SEED_LOCK = threading.Lock()


class ModelDependencyError(ImportError):
    """A real architecture's library is not installed; the message says what to install."""


def _require(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ModelDependencyError(f"{module} is not installed ({exc}); install the models extra: "
                                   f"pip install \"dpfsdp-verify[models]\"") from None


def _seeded(seed: int, make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``make()`` with torch's default generator at ``seed`` (libraries initialise from it), restored after."""
    with _SEED_LOCK, torch.random.fork_rng(devices=[]):
        seed_cpu(seed)
        return make()


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward`` / ``Qwen2RMSNorm.forward``, computing in float64 for a
    float64 input (theirs casts to float32, meant as an upcast from half precision); the same
    arithmetic for float32 and below."""
    dtype = hidden_states.dtype
    h = hidden_states.to(torch.promote_types(dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(dtype)


def _float64_rms_norms(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every transformers ``*RMSNorm`` computing in its input's precision
    (``_rms_norm_forward``): the float64 reference needs float64 arithmetic throughout, and a float32
    step inside a float64 model leaves ~1e-8 relative differences between two batchings of the same
    samples. The class, its parameters and what opacus does with it are unchanged."""
    import types

    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon"):
            m.forward = types.MethodType(_rms_norm_forward, m)
    return model


def _logits(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def token_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """``[n]``: each sequence's mean cross-entropy over its positions whose target is not
    ``IGNORE_INDEX`` (0 for a sequence without one)."""
    logits = _logits(output)
    n, t = targets.shape
    tok = F.cross_entropy(logits.reshape(n * t, logits.shape[-1]), targets.reshape(-1), reduction="none",
                          ignore_index=IGNORE_INDEX).view(n, t)
    return tok.sum(dim=1) / (targets != IGNORE_INDEX).sum(dim=1).clamp(min=1)


def class_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """``[n]``: each sample's cross-entropy."""
    return F.cross_entropy(_logits(output), targets, reduction="none")


def _lm_batch(n: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[n, SEQ_LEN]`` and next-token targets with about a quarter ``IGNORE_INDEX``
    (never position 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, SEQ_LEN), generator=g)
    y = torch.randint(0, VOCAB, (n, SEQ_LEN), generator=g)
    pad = torch.rand(n, SEQ_LEN, generator=g) < 0.25
    pad[:, 0] = False
    y[pad] = IGNORE_INDEX
    return x, y


class _CausalLM:
    """A decoder-only language model of ``transformers``: token ids in, next-token loss out."""

    def build(self, seed: int) -> torch.nn.Module:
        return _seeded(seed, self._make)

    def _make(self) -> torch.nn.Module:
        raise NotImplementedError

    def batch(self, n: int, seed: int) -> Tuple[Any, torch.Tensor]:
        return _lm_batch(n, seed)

    def loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        return token_loss(output, targets)


class GPT2(_CausalLM):
    """``transformers`` GPT-2: learned position embeddings (``wpe``), fused QKV in a ``Conv1D``."""

    def _make(self) -> torch.nn.Module:
        tr = _require("transformers")
        cfg = tr.GPT2Config(vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=D_MODEL, n_layer=1, n_head=2,
                            n_inner=D_FF, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                            eos_token_id=None, tie_word_embeddings=False, initializer_range=INIT_STD,
                            attn_implementation="sdpa")
        return tr.GPT2LMHeadModel(cfg)


def _llama_config(tr, **extra):
    return tr.LlamaConfig(vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=D_FF, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2, head_dim=D_MODEL,
                          max_position_embeddings=SEQ_LEN, tie_word_embeddings=False, attention_dropout=0.0,
                          initializer_range=INIT_STD, attn_implementation="sdpa", **extra)


class Llama(_CausalLM):
    """``transformers`` Llama: rotary position embeddings, ``LlamaRMSNorm``, SwiGLU MLP."""

    def _make(self) -> torch.nn.Module:
        tr = _require("transformers")
        return _float64_rms_norms(tr.LlamaForCausalLM(_llama_config(tr)))


class Qwen2(_CausalLM):
    """``transformers`` Qwen2: grouped-query attention (5 query heads share 1 key/value head), biased
    q/k/v projections, ``Qwen2RMSNorm``."""

    def _make(self) -> torch.nn.Module:
        tr = _require("transformers")
        cfg = tr.Qwen2Config(vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=D_FF, num_hidden_layers=1,
                             num_attention_heads=5, num_key_value_heads=1, head_dim=D_MODEL,
                             max_position_embeddings=SEQ_LEN, tie_word_embeddings=False, attention_dropout=0.0,
                             initializer_range=INIT_STD, attn_implementation="sdpa")
        return _float64_rms_norms(tr.Qwen2ForCausalLM(cfg))


class LlamaLoRA(_CausalLM):
    """``peft`` LoRA (rank 2 on ``q_proj`` and ``v_proj``) on the ``llama`` model; the base is frozen.
    ``lora_B`` is drawn at random (``init_lora_weights=False``): at peft's default zeros every
    ``lora_A`` gradient would be 0 and its norm check vacuous."""

    def _make(self) -> torch.nn.Module:
        tr = _require("transformers")
        peft = _require("peft")
        cfg = peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0,
                              target_modules=list(LORA_TARGETS), init_lora_weights=False)
        return peft.get_peft_model(_float64_rms_norms(tr.LlamaForCausalLM(_llama_config(tr))), cfg)


class Bert(_CausalLM):
    """``transformers`` BERT masked LM: padded sequences under an attention mask (an all-padding one
    in every batch of 2 or more), about a third of the real tokens hidden behind ``MASK_ID`` as targets."""

    def _make(self) -> torch.nn.Module:
        tr = _require("transformers")
        # type_vocab_size 11: a dim 0 of 2 would be shorter than 3 ranks (finding 3, shown elsewhere)
        cfg = tr.BertConfig(vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=D_FF, max_position_embeddings=SEQ_LEN, type_vocab_size=11,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD_ID,
                            tie_word_embeddings=False, initializer_range=INIT_STD, attn_implementation="sdpa")
        return tr.BertForMaskedLM(cfg)

    def batch(self, n: int, seed: int) -> Tuple[Any, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        lengths = sequence_lengths(n, SEQ_LEN, g)
        real = torch.arange(SEQ_LEN).unsqueeze(0) < lengths.unsqueeze(1)
        ids = torch.randint(1, MASK_ID, (n, SEQ_LEN), generator=g)
        hide = (torch.rand(n, SEQ_LEN, generator=g) < 0.35) & real
        hide[:, 0] = lengths > 0  # a sequence with real tokens has a target at position 0
        targets = torch.where(hide, ids, torch.full_like(ids, IGNORE_INDEX))
        ids = torch.where(hide, torch.full_like(ids, MASK_ID), ids)
        ids[~real] = PAD_ID
        return {"input_ids": ids, "attention_mask": real.long()}, targets


class _ImageClassifier:
    """An image classifier: ``[n, IMAGE_CHANNELS, IMAGE_SIZE, IMAGE_SIZE]`` in, ``MLP_CLASSES`` classes."""

    def build(self, seed: int) -> torch.nn.Module:
        return _seeded(seed, self._make)

    def _make(self) -> torch.nn.Module:
        raise NotImplementedError

    def batch(self, n: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, IMAGE_CHANNELS, IMAGE_SIZE, IMAGE_SIZE, generator=g, dtype=torch.float64)
        return x.float(), torch.randint(0, MLP_CLASSES, (n,), generator=g)

    def loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        return class_loss(output, targets)


class ViT(_ImageClassifier):
    """``transformers`` ViT: 2x2 patches (a ``Conv2d``), a class token and learned position embeddings
    held as parameters of ``ViTEmbeddings`` itself (``cls_token``, ``position_embeddings``, dim 0 of size 1)."""

    def _make(self) -> torch.nn.Module:
        tr = _require("transformers")
        cfg = tr.ViTConfig(image_size=IMAGE_SIZE, patch_size=2, num_channels=IMAGE_CHANNELS, hidden_size=D_MODEL,
                           num_hidden_layers=1, num_attention_heads=2, intermediate_size=D_FF,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=MLP_CLASSES,
                           initializer_range=INIT_STD, attn_implementation="sdpa")
        return tr.ViTForImageClassification(cfg)


class _BasicBlock(torch.nn.Module):
    """ResNet's basic block with GroupNorm: conv-norm-relu-conv-norm, plus the input (through a
    strided 1x1 conv and a norm when the shape changes), relu."""

    def __init__(self, c_in: int, c_out: int, stride: int, groups: int):
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.GroupNorm(groups, c_out)
        self.downsample: torch.nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                            nn.GroupNorm(groups, c_out))

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.downsample(x))


class ResNetGroupNorm(torch.nn.Module):
    """A ResNet with GroupNorm in place of BatchNorm (BatchNorm mixes samples; DP training swaps
    it for GroupNorm): a 3x3 stem, two stages of one basic block each (widths 10 and 15, the second
    strided), GroupNorm of 5 groups, global average pooling, a linear classifier. Parameter names
    follow torchvision's ResNet."""

    def __init__(self, channels: int = IMAGE_CHANNELS, widths: Tuple[int, int] = (D_MODEL, 15),
                 classes: int = MLP_CLASSES, groups: int = 5):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, widths[0], 3, padding=1, bias=False)
        self.bn1 = torch.nn.GroupNorm(groups, widths[0])
        self.layer1 = _BasicBlock(widths[0], widths[0], 1, groups)
        self.layer2 = _BasicBlock(widths[0], widths[1], 2, groups)
        self.fc = torch.nn.Linear(widths[1], classes)

    def forward(self, x):
        h = self.layer2(self.layer1(torch.relu(self.bn1(self.conv1(x)))))
        return self.fc(h.mean(dim=(2, 3)))


class ResNetGN(_ImageClassifier):
    """``ResNetGroupNorm`` (this file: torch only; timm's needs torchvision, which does not import
    beside torch's CPU wheel, see pyproject.toml)."""

    def _make(self) -> torch.nn.Module:
        return ResNetGroupNorm()


#: the real architectures by their short name (``--models gpt2,...``; ``real`` = all of them)
REAL_MODELS: Dict[str, type] = {"gpt2": GPT2, "llama": Llama, "qwen2": Qwen2, "bert": Bert, "vit": ViT,
                                "resnet_gn": ResNetGN, "llama_lora": LlamaLoRA}

__all__ = ["REAL_MODELS", "GPT2", "Llama", "Qwen2", "Bert", "ViT", "ResNetGN", "ResNetGroupNorm", "LlamaLoRA",
           "ModelDependencyError", "token_loss", "class_loss", "D_FF", "IMAGE_CHANNELS", "IMAGE_SIZE",
           "LORA_RANK", "LORA_TARGETS", "MASK_ID", "INIT_STD"]

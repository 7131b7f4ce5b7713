"""Tiny models and batches the suite checks DP-FSDP implementations with.

Every model and batch is a pure function of a seed, so each rank of a worker group (and the
single-process reference) builds bit-identical copies without communicating. Models only use
layers opacus 1.6.0 has a grad sampler or norm sampler for, so ghost clipping covers every
parameter; the reference refuses anything else (see ``reference.SUPPORTED_LAYERS``).

``build_model(name, seed, **dims)`` returns the model; ``make_batch(name, batch_size, seed,
**dims)`` returns ``Batch(inputs, targets, loss)`` where ``loss`` names the per-sample loss (see
``reference.per_sample_losses``). Both accept the same ``dims`` (``MODEL_DIMS[name]``; each
function ignores the ones that do not concern it, e.g. ``hidden`` for the batch), so one
``RunSpec.model_kwargs`` describes a matching model and batch. Layer sizes are what
``dpfsdp_verify.strategies`` varies: FSDP2 shards every parameter on dim 0, so a dim 0 smaller
than, equal to, or not divisible by the world size exercises empty and padded shards.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .batch import DEFAULT_GENERATOR, Batch, seed_cpu
from .catalog import (BASE_MODELS, FINETUNE_MODELS, SEQUENCE_MODELS, ZOO_MODELS, EXTREME_MODELS, AUDIT_MODELS,
                            MODEL_NAMES, EXTREME_SCALES, MLP_IN, MLP_HIDDEN,
                            MLP_CLASSES, CONV_CHANNELS, CONV_SIZE, CONV_CLASSES,
                            CONV_WIDTH, CONV_GROUPS, CONV_MIXER, VOCAB, SEQ_LEN,
                            D_MODEL, N_HEADS, LORA_RANK, TIES, IGNORE_INDEX, PAD_ID,
                            CANARIES, CANARY_CLASSES, MODEL_DIMS, BATCH_DIMS, BATCH_USES, check_dims, contract_path)

#: held while a model's parameters are drawn from torch's default generator (``build_model``; one
#: lock for the built-in models and the contract's, in ``batch.py``)
_DEFAULT_GENERATOR = DEFAULT_GENERATOR


class MLP(nn.Module):
    """Linear -> ReLU -> LayerNorm -> Linear: the smallest model with a norm layer."""

    def __init__(self, d_in: int = MLP_IN, hidden: int = MLP_HIDDEN, classes: int = MLP_CLASSES):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(self.norm(torch.relu(self.fc1(x))))


class ConvNet(nn.Module):
    """Conv2d -> GroupNorm -> Conv1d over rows -> Linear: covers both conv samplers.

    ``width`` (Conv2d out channels, GroupNorm size) must be a multiple of ``groups``; ``mixer`` is
    the Conv1d's out channels; ``size >= 2`` so the Conv1d (kernel 3) has an output.
    """

    def __init__(self, channels: int = CONV_CHANNELS, size: int = CONV_SIZE, classes: int = CONV_CLASSES,
                 width: int = CONV_WIDTH, groups: int = CONV_GROUPS, mixer: int = CONV_MIXER):
        super().__init__()
        if width % groups:
            raise ValueError(f"width={width} must be a multiple of groups={groups} (GroupNorm)")
        if size < 2:
            raise ValueError(f"size={size} must be >= 2 (the Conv1d over size*size positions has kernel 3)")
        self.conv2d = nn.Conv2d(channels, width, kernel_size=3, padding=1)
        self.gn = nn.GroupNorm(groups, width)
        self.conv1d = nn.Conv1d(width, mixer, kernel_size=3)
        self.fc = nn.Linear(mixer * (size * size - 2), classes)

    def forward(self, x):
        h = torch.relu(self.gn(self.conv2d(x)))  # [B, width, S, S]
        h = torch.relu(self.conv1d(h.flatten(2)))  # [B, mixer, S*S-2]
        return self.fc(h.flatten(1))


class _SelfAttention(nn.Module):
    """Multi-head attention built from Linear layers (opacus samples Linear on [B,T,D]); the
    subclasses say which keys each query may attend to."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.o = nn.Linear(d_model, d_model)

    def attend(self, x, allowed):
        """Attention of ``x`` [B,T,D] where ``allowed`` (broadcast to [B,heads,T(query),T(key)]) is true."""
        b, t, d = x.shape
        h = self.n_heads

        def heads(z):
            return z.view(b, t, h, d // h).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // h)
        att = att.masked_fill(~allowed, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.o(y)


class CausalSelfAttention(_SelfAttention):
    """Multi-head causal attention."""

    def forward(self, x):
        t = x.shape[1]
        return self.attend(x, torch.ones(t, t, dtype=torch.bool, device=x.device).tril())


class TinyGPT(nn.Module):
    """Token + position embeddings, one pre-norm block (attention, MLP), final norm, LM head.

    ``norm="layernorm"`` or ``"rmsnorm"`` picks the normalisation layer. Positions use an
    ``nn.Embedding`` (not a bare ``nn.Parameter``) so every parameter has an opacus sampler.
    ``d_model`` must be a multiple of ``n_heads``; ``d_ff`` (the MLP's width) defaults to
    ``2 * d_model - 1`` (19 by default: odd, so its shards are uneven at 2, 4 and 8 ranks too).
    """

    def __init__(self, vocab=VOCAB, seq_len=SEQ_LEN, d_model=D_MODEL, n_heads=N_HEADS, norm="rmsnorm",
                 d_ff=None):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}")
        d_ff = 2 * d_model - 1 if d_ff is None else d_ff
        norm_cls = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}[norm]
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.ln1 = norm_cls(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = norm_cls(d_model)
        self.mlp_in = nn.Linear(d_model, d_ff)
        self.mlp_out = nn.Linear(d_ff, d_model)
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        # contiguous(): opacus 1.6.0's Embedding ghost norm sampler calls ``input.view(-1, 1)``,
        # which fails on the stride-0 tensor ``expand_as`` returns.
        pos = torch.arange(t, device=idx.device).unsqueeze(0).expand_as(idx).contiguous()
        x = self.tok(idx) + self.pos(pos)
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp_out(F.gelu(self.mlp_in(self.ln2(x))))
        return self.head(self.ln_f(x))


class LoRAMLP(nn.Module):
    """A fine-tuned MLP: frozen base ``fc1 -> ReLU -> LayerNorm -> fc2`` with LoRA adapters.

    Each base Linear ``fcK`` (frozen) gets a low-rank update ``fcK_b(fcK_a(x))`` (``fcK_a``: in ->
    ``rank``, ``fcK_b``: ``rank`` -> out, both bias-free and trainable), added to its output. The
    LayerNorm is frozen whole (a frozen layer); ``fc2.bias`` stays trainable while ``fc2.weight``
    is frozen (a layer with both kinds, as in BitFit or a re-initialised head bias), so a target
    must tell frozen from trainable *within* a layer. Unlike LoRA's usual zero init of ``B``,
    every adapter is drawn at random: with ``B = 0`` the per-sample gradient of ``A`` is exactly
    zero at the first step, and a bug in it would not show.
    """

    def __init__(self, d_in: int = MLP_IN, hidden: int = MLP_HIDDEN, classes: int = MLP_CLASSES,
                 rank: int = LORA_RANK):
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank={rank} must be >= 1 (the LoRA adapters' inner dimension)")
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc1_a = nn.Linear(d_in, rank, bias=False)
        self.fc1_b = nn.Linear(rank, hidden, bias=False)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, classes)
        self.fc2_a = nn.Linear(hidden, rank, bias=False)
        self.fc2_b = nn.Linear(rank, classes, bias=False)
        with torch.no_grad():  # LayerNorm starts at (1, 0): give the frozen norm non-trivial values
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)
        for p in (self.fc1.weight, self.fc1.bias, self.norm.weight, self.norm.bias, self.fc2.weight):
            p.requires_grad_(False)

    def forward(self, x):
        h = torch.relu(self.fc1(x) + self.fc1_b(self.fc1_a(x)))
        h = self.norm(h)
        return self.fc2(h) + self.fc2_b(self.fc2_a(h))


class TiedLM(nn.Module):
    """A tiny LM whose output head *is* its token embedding (``tie="head"``, as GPT-2 ties them):
    ``head.weight`` and ``tok.weight`` are one tensor, so its gradient is the sum of the
    embedding's and the head's. Token + position embeddings, a pre-norm residual Linear block,
    final LayerNorm, bias-free head. ``tie="none"`` is the same model with a separate head (the
    same initial values): the untied twin.
    """

    def __init__(self, vocab=VOCAB, seq_len=SEQ_LEN, d_model=D_MODEL, tie="head"):
        super().__init__()
        if tie not in TIES:
            raise ValueError(f"tie={tie!r}: choose one of {', '.join(TIES)}")
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.ln = nn.LayerNorm(d_model)
        self.mix = nn.Linear(d_model, d_model)
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        if tie == "head":
            self.head.weight = self.tok.weight
        else:
            with torch.no_grad():
                self.head.weight.copy_(self.tok.weight)

    def forward(self, idx):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device).unsqueeze(0).expand_as(idx).contiguous()  # see TinyGPT
        x = self.tok(idx) + self.pos(pos)
        x = x + torch.tanh(self.mix(self.ln(x)))
        return self.head(self.ln_f(x))


class MaskedSelfAttention(_SelfAttention):
    """Bidirectional multi-head attention with a key padding mask derived from the token ids.

    A real position attends to the real positions of its own sequence only (``-inf`` on padding
    keys: exactly zero weight, so padding neither changes a real token's output nor receives
    gradient through it). Each position may also attend to itself, so a padding query -- and
    every query of an all-padding sequence -- has one finite score: a row of ``-inf`` would give a
    NaN softmax, and ``0 * NaN`` is NaN in the backward even where the loss ignores the position.
    """

    def forward(self, x, real):
        t = x.shape[1]
        eye = torch.eye(t, dtype=torch.bool, device=x.device)
        allowed = real.unsqueeze(1) | eye  # [b, t(query), t(key)]
        return self.attend(x, allowed.unsqueeze(1))


class MaskedEncoder(nn.Module):
    """A tiny token-tagging encoder over right-padded, variable-length sequences: token (``PAD_ID``
    is padding) + position embeddings, one pre-norm block (bidirectional attention under the
    padding mask, MLP), final LayerNorm, a per-token head. The mask is derived from the ids
    (``idx != PAD_ID``), as a tokenizer's ``attention_mask`` would mark them, so the batch stays
    ``(ids, targets)``. Bidirectional on purpose: with causal attention and right padding the mask
    would never hide anything from a real token. ``d_model`` must be a multiple of ``n_heads``.
    """

    def __init__(self, vocab=VOCAB, seq_len=SEQ_LEN, d_model=D_MODEL, n_heads=N_HEADS):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}")
        if vocab < 2:
            raise ValueError(f"vocab={vocab} must be >= 2 (token {PAD_ID} is padding)")
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = MaskedSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp_in = nn.Linear(d_model, 2 * d_model)
        self.mlp_out = nn.Linear(2 * d_model, d_model)
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        real = idx != PAD_ID
        pos = torch.arange(t, device=idx.device).unsqueeze(0).expand_as(idx).contiguous()  # see TinyGPT
        x = self.tok(idx) + self.pos(pos)
        x = x + self.attn(self.ln1(x), real)
        x = x + self.mlp_out(F.gelu(self.mlp_in(self.ln2(x))))
        return self.head(self.ln_f(x))


class LayerZoo(nn.Module):
    """Every layer type opacus 1.6.0's ghost clipping samples, each with its parameters, in one tiny
    classifier of token sequences: Embedding -> LayerNorm -> RMSNorm -> Conv1d -> InstanceNorm1d ->
    Conv1d (groups 2, dilation 2) -> Conv2d -> GroupNorm -> InstanceNorm2d -> Conv3d -> InstanceNorm3d
    -> Linear, with a Conv2d of stride 2 and groups 2 on a side branch into the Linear (a norm that
    leaves out convs with stride, groups or dilation != 1 undercounts); and the layer options models
    use: the Embedding with ``padding_idx`` 0, a bias-free Linear and a LayerNorm without affine
    parameters after the RMSNorm, the Conv3d without bias (a norm that counts a bias term a layer
    does not have overcounts, named). The sequence of ``seq_len = 8`` positions is read as a 1-D signal, then
    as a 2 x 4 image, then as a 2 x 2 x 2 volume. Every parameter has >= 8 rows, a count not divisible by
    3, 4 or 8 (``width`` 10, like the other default models: uneven shards, none short at 4 ranks). Not in
    ``BASE_MODELS``: the norm property runs it once
    per world size (a layer left out of a target's norm registry is then named); ``--models zoo``
    runs it everywhere."""

    SEQ_LEN = 8

    def __init__(self, vocab: int = VOCAB, classes: int = MLP_CLASSES, width: int = 10):
        super().__init__()
        if width % 2:
            raise ValueError(f"width={width} must be even (GroupNorm of 2 groups)")
        # the common layer options too: an embedding with a padding row (token 0: its gradient is 0), a
        # bias-free Linear, a LayerNorm without affine parameters, a conv without bias
        self.tok = nn.Embedding(vocab, width, padding_idx=0)
        self.ln = nn.LayerNorm(width)
        self.rms = nn.RMSNorm(width)
        self.proj = nn.Linear(width, width, bias=False)
        self.ln_plain = nn.LayerNorm(width, elementwise_affine=False)
        self.conv1d = nn.Conv1d(width, width, kernel_size=3, padding=1)
        self.in1d = nn.InstanceNorm1d(width, affine=True)
        # grouped and dilated (dilation 2, padding 2: the length stays 8)
        self.conv1d_gd = nn.Conv1d(width, width, kernel_size=3, padding=2, dilation=2, groups=2)
        self.conv2d = nn.Conv2d(width, width, kernel_size=3, padding=1)
        # strided and grouped, on a side branch into the classifier (2 x 4 -> 1 x 2)
        self.conv2d_sg = nn.Conv2d(width, width, kernel_size=3, stride=2, padding=1, groups=2)
        self.gn = nn.GroupNorm(2, width)
        self.in2d = nn.InstanceNorm2d(width, affine=True)
        self.conv3d = nn.Conv3d(width, width, kernel_size=3, padding=1, bias=False)
        self.in3d = nn.InstanceNorm3d(width, affine=True)
        self.fc = nn.Linear(width * self.SEQ_LEN + width * 2, classes)
        with torch.no_grad():  # norms start at (1, 0): give their affine parameters non-trivial values
            for norm in (self.ln, self.rms, self.in1d, self.gn, self.in2d, self.in3d):
                norm.weight.uniform_(0.5, 1.5)
                bias = getattr(norm, "bias", None)
                if bias is not None:
                    bias.uniform_(-0.5, 0.5)

    def forward(self, idx):
        # a tanh after every layer: a norm right after a layer would cancel that layer's per-channel
        # bias and scale (an InstanceNorm after a conv removes the conv's bias: its gradient is 0)
        b, t = idx.shape[0], torch.tanh
        x = t(self.rms(t(self.ln(self.tok(idx)))))                         # [B, 8, w]
        x = self.ln_plain(t(self.proj(x)))                                # [B, 8, w]
        x = t(self.in1d(t(self.conv1d(x.transpose(1, 2)))))               # [B, w, 8]
        x = t(self.conv1d_gd(x))                                          # [B, w, 8]
        x = t(self.in2d(t(self.gn(t(self.conv2d(x.reshape(b, -1, 2, 4)))))))  # [B, w, 2, 4]
        side = t(self.conv2d_sg(x))                                       # [B, w, 1, 2]
        x = t(self.in3d(t(self.conv3d(x.reshape(b, -1, 2, 2, 2)))))       # [B, w, 2, 2, 2]
        return self.fc(torch.cat([x.flatten(1), side.flatten(1)], dim=1))


class ExtremeMLP(nn.Module):
    """Linear -> tanh -> Linear whose first layer starts ~1e-20 x its usual initialisation, so that an
    input of scale s (``EXTREME_SCALES``) reaches the second layer at ~1e-20 s: the logits stay
    moderate (the softmax does not saturate, so no gradient vanishes) while the first layer's
    per-sample gradient, backprop x input, has norm ~s. One batch thus holds samples of norm ~1 and
    ~1e2, 1e6, 1e20: a clip coefficient wrong only far above C, and a squared norm that overflows
    float32 (the per-sample gradient itself, ~1e20, does not), show on it."""

    def __init__(self, d_in: int = MLP_IN, hidden: int = MLP_HIDDEN, classes: int = MLP_CLASSES):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, classes)
        with torch.no_grad():
            self.fc1.weight.mul_(1e-20)
            self.fc1.bias.mul_(1e-20)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))




class CanaryLayers(nn.Module):
    """White-box gradient canaries of two kinds (``docs/audit.md``): canaries ``0 .. e-1`` (``e =
    embedded_canaries(canaries)``, the first half) are rows of an ``Embedding(e + 1, CANARY_CLASSES)``,
    the others columns of a ``Linear(canaries - e, CANARY_CLASSES, bias=False)`` fed a one-hot input;
    the logits are the sum, every parameter initialised to zero. Sample ``i`` of a ``canary`` batch is
    token ``i`` (canary ``i``, a *member*) or token ``canaries`` (canary ``i`` is *out*), with label 0.
    A member's per-sample gradient is ``softmax(0) - e_0`` (norm ~0.95, the same for every canary
    while the parameters stay at zero, i.e. at lr 0) on its own embedding row or its own Linear
    column, and zero everywhere else: each layer's output is masked to the samples of its kind, so an
    embedding canary sends no gradient through the Linear layer (its input there is zero) and a Linear
    canary none through the embedding (it looks up the sink row ``e`` behind a zero mask). An *out*
    canary's gradient is zero: the canary coordinates are distributed exactly as if the sample were
    absent (add/remove DP). FSDP shards the embedding's rows (each canary on one shard) and the Linear
    weight's ``CANARY_CLASSES`` output rows (each canary's column across the shards), so the two kinds
    go through different layer types, clipping paths and shard layouts in one run. The secrets are
    ``canary_secrets`` of the batch seed."""

    def __init__(self, canaries: int = CANARIES):
        super().__init__()
        if canaries < 2:
            raise ValueError(f"canaries={canaries} must be >= 2 (one of each kind)")
        self.canaries, self.embedded = canaries, embedded_canaries(canaries)
        self.embedding = nn.Embedding(self.embedded + 1, CANARY_CLASSES)
        self.linear = nn.Linear(canaries - self.embedded, CANARY_CLASSES, bias=False)
        with torch.no_grad():
            self.embedding.weight.zero_()
            self.linear.weight.zero_()

    def forward(self, idx):
        e = self.embedded
        in_embedding = idx < e
        rows = torch.where(in_embedding, idx, torch.full_like(idx, e))
        columns = torch.arange(self.canaries - e, device=idx.device)
        one_hot = (columns.unsqueeze(0) == (idx - e).unsqueeze(1)).to(self.linear.weight.dtype)
        looked_up = self.embedding(rows) * in_embedding.unsqueeze(1).to(self.embedding.weight.dtype)
        return looked_up + self.linear(one_hot)


def embedded_canaries(canaries: int) -> int:
    """How many of a ``canary`` model's canaries are embedding rows (the first ones; the rest are
    Linear columns): half, rounded up."""
    return (canaries + 1) // 2


def canary_secrets(batch_size: int, seed: int) -> torch.Tensor:
    """``[batch_size]`` secrets S_i in {-1, +1} (uniform, independent) of a ``canary`` batch drawn
    from ``seed``: +1 puts canary ``i`` in the data (token ``i``), -1 leaves it out (the sink token)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (batch_size,), generator=g) * 2 - 1


def sequence_lengths(batch_size: int, seq_len: int, g: torch.Generator) -> torch.Tensor:
    """``[batch_size]`` real lengths of a ``masked`` batch: sample ``i`` is full (``seq_len``) when
    ``i % 3 == 0``, all padding (0) when ``i % 3 == 1``, else drawn uniformly from ``1..seq_len-1``
    (``1`` if ``seq_len`` is 1). Every batch of two or more samples thus holds different lengths and
    an all-padding sequence; split over 2 ranks (contiguously, or strided as a DistributedSampler
    does) a batch of 6 or more gives each rank one."""
    lengths = torch.randint(1, max(2, seq_len), (batch_size,), generator=g).clamp(max=seq_len)
    position = torch.arange(batch_size) % 3
    lengths[position == 0] = seq_len
    lengths[position == 1] = 0
    return lengths


def build_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, **dims) -> nn.Module:
    """A fresh model ``name`` (one of ``MODEL_NAMES``) with parameters drawn from ``seed``.

    ``dims`` are keywords of ``MODEL_DIMS[name]`` (sizes, ``norm``) overriding the defaults;
    ``BATCH_DIMS`` are accepted and ignored, so the same dict serves ``make_batch``. Raises
    ``ValueError`` for an unknown name, an unknown dimension, or inconsistent sizes.
    """
    check_dims(name, dims)
    if contract_path(name) is not None and name not in MODEL_DIMS:  # a model of its own (docs/models.md)
        from . import contract
        return contract.build_model(name, seed, dtype)
    ctor = {"mlp": MLP, "conv": ConvNet, "transformer": TinyGPT, "lora": LoRAMLP, "tied": TiedLM,
            "masked": MaskedEncoder, "zoo": LayerZoo, "extreme": ExtremeMLP,
            "canary": CanaryLayers}[name]
    kwargs = {k: v for k, v in dims.items() if k not in BATCH_DIMS}
    # torch's default generator is the process's: two threads building models at once (the gate judges
    # and explores in threads of its own) would draw from each other's seeds
    with _DEFAULT_GENERATOR, torch.random.fork_rng(devices=[]):
        seed_cpu(seed)
        model = ctor(**kwargs)
    return model.to(dtype)


def make_batch(name: str, batch_size: int, seed: int = 0, dtype: torch.dtype = torch.float32,
               pad_fraction: float = 0.25, **dims) -> Batch:
    """A batch of ``batch_size`` samples for model ``name``, drawn from ``seed``.

    ``dims`` are the same keywords ``build_model`` takes; those the batch does not depend on
    (``hidden``, ``norm``...) are ignored. For the transformer, about ``pad_fraction`` of the target
    positions are ``IGNORE_INDEX`` (never a whole sequence: position 0 always has a real target),
    which exercises opacus' per-sequence ``ignore_index`` handling. With the default dims the batch
    is the same as before dims existed. For ``masked``, sequence ``i`` has ``sequence_lengths``
    real tokens (ids ``1..vocab-1``) followed by ``PAD_ID`` inputs with ``IGNORE_INDEX`` targets
    (``pad_fraction`` is not used: padding is where the sequence ends).
    """
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    check_dims(name, dims)
    if contract_path(name) is not None and name not in MODEL_DIMS:  # a model of its own (docs/models.md)
        from . import contract
        return contract.make_batch(name, batch_size, seed, dtype)
    d = {k: v for k, v in dims.items() if k in BATCH_USES[name]}
    g = torch.Generator().manual_seed(seed)
    if name == "canary":
        m = d.get("canaries", CANARIES)
        if batch_size > m:
            raise ValueError(f"a canary batch holds at most its {m} canaries, got batch_size={batch_size}")
        secrets = canary_secrets(batch_size, seed)
        tokens = torch.where(secrets > 0, torch.arange(batch_size), torch.full((batch_size,), m))
        return Batch(tokens, torch.zeros(batch_size, dtype=torch.long), "cross_entropy")
    if name == "extreme":
        scale = torch.tensor([EXTREME_SCALES[i % len(EXTREME_SCALES)] for i in range(batch_size)], dtype=torch.float64)
        x = torch.randn(batch_size, d.get("d_in", MLP_IN), generator=g, dtype=torch.float64) * scale.unsqueeze(1)
        y = torch.randint(0, d.get("classes", MLP_CLASSES), (batch_size,), generator=g)
        return Batch(x.to(dtype), y, "cross_entropy")
    if name in ("mlp", "lora"):
        d_in, classes = d.get("d_in", MLP_IN), d.get("classes", MLP_CLASSES)
        x = torch.randn(batch_size, d_in, generator=g, dtype=torch.float64).to(dtype)
        y = torch.randint(0, classes, (batch_size,), generator=g)
        return Batch(x, y, "cross_entropy")
    if name == "conv":
        channels, size = d.get("channels", CONV_CHANNELS), d.get("size", CONV_SIZE)
        x = torch.randn(batch_size, channels, size, size, generator=g, dtype=torch.float64).to(dtype)
        y = torch.randint(0, d.get("classes", CONV_CLASSES), (batch_size,), generator=g)
        return Batch(x, y, "cross_entropy")
    if name == "zoo":
        x = torch.randint(0, d.get("vocab", VOCAB), (batch_size, LayerZoo.SEQ_LEN), generator=g)
        # every other sample ends in the embedding's padding token (its row gets no gradient): a draw of 8
        # tokens from 29 often has none, and a norm that counts the padding row is then never seen
        x[::2, -1] = PAD_ID
        y = torch.randint(0, d.get("classes", MLP_CLASSES), (batch_size,), generator=g)
        return Batch(x, y, "cross_entropy")
    vocab, seq_len = d.get("vocab", VOCAB), d.get("seq_len", SEQ_LEN)
    if name == "masked":
        lengths = sequence_lengths(batch_size, seq_len, g)
        x = torch.randint(1, max(2, vocab), (batch_size, seq_len), generator=g)
        y = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
        pad = torch.arange(seq_len).unsqueeze(0) >= lengths.unsqueeze(1)
        x[pad] = PAD_ID
        y[pad] = IGNORE_INDEX
        return Batch(x, y, "token_cross_entropy")
    x = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    y = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    pad = torch.rand(batch_size, seq_len, generator=g) < d.get("pad_fraction", pad_fraction)
    pad[:, 0] = False  # every sequence keeps at least one real target
    y[pad] = IGNORE_INDEX
    return Batch(x, y, "token_cross_entropy")


#: the models and batches, and (re-exported) every name of ``catalog``
__all__ = ["build_model", "make_batch", "Batch", "MODEL_NAMES", "MODEL_DIMS", "IGNORE_INDEX", "PAD_ID", "MLP",
           "ConvNet", "TinyGPT", "MaskedEncoder", "LayerZoo", "ExtremeMLP", "EXTREME_SCALES",
           "sequence_lengths", "CanaryLayers", "embedded_canaries", "CANARY_CLASSES",
           "canary_secrets", "CANARIES", "AUDIT_MODELS",
           "BASE_MODELS", "FINETUNE_MODELS", "SEQUENCE_MODELS", "ZOO_MODELS", "EXTREME_MODELS", "MLP_IN",
           "MLP_HIDDEN", "MLP_CLASSES", "CONV_CHANNELS", "CONV_SIZE", "CONV_CLASSES", "CONV_WIDTH",
           "CONV_GROUPS", "CONV_MIXER", "VOCAB", "SEQ_LEN", "D_MODEL", "N_HEADS", "LORA_RANK", "TIES",
           "BATCH_DIMS", "BATCH_USES", "check_dims"]

"""Hypothesis strategies for the configurations FSDP2 + DP gets wrong: shard shapes, world sizes,
global batch sizes and per-rank batch splits.

FSDP2 shards every parameter on dim 0 into ``world_size`` chunks and pads the last ones, so a
layer whose dim 0 is smaller than the world size leaves some ranks with an empty shard, and one
not divisible by it leaves a padded shard. Data loaders pad or drop, and Poisson sampling gives
each rank a different, possibly empty, local batch. These strategies generate exactly those
cases, small enough that one example costs milliseconds on a warm worker group::

    from hypothesis import given
    from dpfsdp_verify import strategies as dps

    @given(dps.run_specs(world_size=2, models=("mlp",)))
    def test_norms(spec): ...

Every strategy says what it generates and how it shrinks. Shrinking always heads for the
simplest configuration a human would write first: the smallest world size and dims, the
``DistributedSampler`` path with one sample per rank, float64, ``mean``, split data, no padding.
Model dimensions are returned as dicts of ``models.MODEL_DIMS`` keywords; ``run_specs`` stores
them in ``RunSpec.model_kwargs`` as sorted ``(key, value)`` pairs.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple, Union, cast

from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from ..config import space
from ..models import BASE_MODELS, MODEL_NAMES, TIES
from ..models.catalog import contract_path
from ..reference import REDUCTIONS
from ..config.space import choice, integer, real
from ..targets.base import DATA_LAYOUTS, SEEDINGS, RunSpec, capped_epochs
from . import strata as strata_mod

#: dim-0 sizes relative to the world size ``n``: ``smaller`` (d < n: some ranks hold an empty
#: shard), ``equal`` (d == n: one row each), ``indivisible`` (d % n != 0: a padded shard),
#: ``multiple`` (d % n == 0: even shards, the case everyone tests)
SHARD_RELATIONS = ("smaller", "equal", "indivisible", "multiple")
#: the dtypes drawn (the configuration space's: ``space.choice("dtype").drawn``)
DTYPES = choice("dtype").drawn
#: fraction of ignored (``IGNORE_INDEX``) target tokens in a transformer batch
PAD_FRACTIONS = (0.0, 0.25, 0.5)

IntOrStrategy = Union[int, st.SearchStrategy]


def _relation_holds(d: int, n: int, relation: str) -> bool:
    return {"smaller": d < n, "equal": d == n, "indivisible": d % n != 0, "multiple": d % n == 0}[relation]


def world_sizes(min_value: int = 1, max_value: int = 4) -> st.SearchStrategy[int]:
    """Numbers of ranks in ``[min_value, max_value]`` (default 1..4). Shrinks towards ``min_value``."""
    if not 1 <= min_value <= max_value:
        raise InvalidArgument(f"need 1 <= min_value <= max_value, got {min_value}, {max_value}")
    return st.integers(min_value, max_value)


def shard_dims(world_size: int, *, relations: Sequence[str] = SHARD_RELATIONS, min_value: int = 1,
               max_value: Optional[int] = None) -> st.SearchStrategy[int]:
    """Dim-0 sizes ``d`` in ``[min_value, max_value]`` whose relation to ``world_size`` is one of
    ``relations`` (see ``SHARD_RELATIONS``). ``max_value`` defaults to ``2 * world_size + 1`` so that,
    with all four relations, every case (empty shard, one row per rank, padded, even) is a likely
    draw. Shrinks towards the smallest allowed value. Raises ``InvalidArgument`` if no size in the
    range satisfies any relation (e.g. ``relations=("smaller",)`` at ``world_size=1``).
    """
    unknown = set(relations) - set(SHARD_RELATIONS)
    if unknown:
        raise InvalidArgument(f"unknown relations {sorted(unknown)}; choose from {SHARD_RELATIONS}")
    hi = 2 * world_size + 1 if max_value is None else max_value
    allowed = [d for d in range(min_value, hi + 1) if any(_relation_holds(d, world_size, r) for r in relations)]
    if not allowed:
        raise InvalidArgument(f"no dim-0 size in [{min_value}, {hi}] is {'/'.join(relations)} "
                              f"relative to world_size={world_size}")
    return st.sampled_from(allowed)


@st.composite
def mlp_dims(draw, world_size: int) -> Dict[str, int]:
    """``{"d_in", "hidden", "classes"}`` for ``models.MLP``: ``d_in`` in 1..4 (a dim 1, never
    sharded on), ``hidden`` (dim 0 of ``fc1`` and the LayerNorm) and ``classes`` (dim 0 of ``fc2``,
    at least 2 so the loss has a gradient) from ``shard_dims(world_size)``. Shrinks towards
    ``d_in=1, hidden=1, classes=2``.
    """
    return {"d_in": draw(st.integers(1, 4)), "hidden": draw(shard_dims(world_size)),
            "classes": draw(shard_dims(world_size, min_value=2, max_value=max(3, 2 * world_size + 1)))}


@st.composite
def conv_dims(draw, world_size: int) -> Dict[str, int]:
    """``{"channels", "size", "classes", "width", "groups", "mixer"}`` for ``models.ConvNet``:
    ``channels`` 1..3 and ``size`` 2..4 (image side; dims 1+, never sharded); ``groups`` 1..2 and
    ``width`` (dim 0 of the Conv2d and GroupNorm) the multiple of ``groups`` nearest above a
    ``shard_dims`` draw; ``mixer`` (dim 0 of the Conv1d) and ``classes`` (dim 0 of the Linear,
    >= 2) from ``shard_dims``. Shrinks towards ``channels=1, size=2, groups=1, width=1, mixer=1,
    classes=2``.
    """
    groups = draw(st.integers(1, 2))
    width = draw(shard_dims(world_size))
    width += (-width) % groups
    return {"channels": draw(st.integers(1, 3)), "size": draw(st.integers(2, 4)), "groups": groups, "width": width,
            "mixer": draw(shard_dims(world_size)),
            "classes": draw(shard_dims(world_size, min_value=2, max_value=max(3, 2 * world_size + 1)))}


def seq_lens(max_value: int = 4) -> st.SearchStrategy[int]:
    """Sequence lengths 1..``max_value`` (length 1: one token, attention over itself only; also the
    dim 0 of the position embedding). Shrinks towards 1."""
    return st.integers(1, max_value)


def pad_fractions() -> st.SearchStrategy[float]:
    """Fractions of target tokens masked with ``IGNORE_INDEX`` (never position 0), one of
    ``PAD_FRACTIONS``. Shrinks towards 0.0 (no padding)."""
    return st.sampled_from(PAD_FRACTIONS)


@st.composite
def transformer_dims(draw, world_size: int) -> Dict[str, object]:
    """Dims of ``models.TinyGPT``: ``vocab`` (dim 0 of the token embedding and the LM head, >= 2)
    and ``d_ff`` (dim 0 of ``mlp_in``) from ``shard_dims``; ``n_heads`` 1..2 and ``d_model`` (dim 0 of
    q, k, v, o and of the norms' weights) the multiple of ``n_heads`` nearest above a ``shard_dims``
    draw; ``seq_len`` from ``seq_lens()`` (dim 0 of the position embedding); ``norm`` ``rmsnorm`` or
    ``layernorm``; ``pad_fraction`` from ``pad_fractions()``. Shrinks towards ``vocab=2, seq_len=1,
    n_heads=1, d_model=1, d_ff=1, norm="rmsnorm", pad_fraction=0.0``.
    """
    n_heads = draw(st.integers(1, 2))
    d_model = draw(shard_dims(world_size))
    d_model += (-d_model) % n_heads
    return {"vocab": draw(shard_dims(world_size, min_value=2, max_value=max(3, 2 * world_size + 1))),
            "seq_len": draw(seq_lens()), "n_heads": n_heads, "d_model": d_model,
            "d_ff": draw(shard_dims(world_size)), "norm": draw(st.sampled_from(("rmsnorm", "layernorm"))),
            "pad_fraction": draw(pad_fractions())}


@st.composite
def lora_dims(draw, world_size: int) -> Dict[str, int]:
    """``mlp_dims`` plus ``rank`` (the LoRA adapters' inner dim, dim 0 of each ``*_a``) from
    ``shard_dims``, for ``models.LoRAMLP``. Shrinks towards ``d_in=1, hidden=1, classes=2, rank=1``."""
    return {**draw(mlp_dims(world_size)), "rank": draw(shard_dims(world_size))}


@st.composite
def tied_dims(draw, world_size: int) -> Dict[str, object]:
    """Dims of ``models.TiedLM``: ``vocab`` (dim 0 of the tied embedding/head, >= 2) and
    ``d_model`` from ``shard_dims``, ``seq_len`` from ``seq_lens()``, ``tie`` from ``TIES``,
    ``pad_fraction``. Shrinks towards ``vocab=2, seq_len=1, d_model=1, tie="head", pad_fraction=0``."""
    return {"vocab": draw(shard_dims(world_size, min_value=2, max_value=max(3, 2 * world_size + 1))),
            "seq_len": draw(seq_lens()), "d_model": draw(shard_dims(world_size)),
            "tie": draw(st.sampled_from(TIES)), "pad_fraction": draw(pad_fractions())}


@st.composite
def masked_dims(draw, world_size: int) -> Dict[str, object]:
    """Dims of ``models.MaskedEncoder``: ``vocab`` (>= 2: token 0 is padding) from ``shard_dims``,
    ``n_heads`` 1..2 and ``d_model`` the multiple of ``n_heads`` nearest above a ``shard_dims``
    draw, ``seq_len`` from ``seq_lens()``. Shrinks towards ``vocab=2, seq_len=1, n_heads=1,
    d_model=1`` (every batch still holds an all-padding sequence: ``models.sequence_lengths``)."""
    n_heads = draw(st.integers(1, 2))
    d_model = draw(shard_dims(world_size))
    d_model += (-d_model) % n_heads
    return {"vocab": draw(shard_dims(world_size, min_value=2, max_value=max(3, 2 * world_size + 1))),
            "seq_len": draw(seq_lens()), "n_heads": n_heads, "d_model": d_model}


def fixed_dims(world_size: int) -> st.SearchStrategy[Dict[str, object]]:
    """No dims: the models whose shape is their point (the layer zoo's layer types, the extreme
    model's norm scales) are built at their own sizes. Always ``{}``; nothing to shrink."""
    return st.just({})


MODEL_DIM_STRATEGIES = {"mlp": mlp_dims, "conv": conv_dims, "transformer": transformer_dims, "lora": lora_dims,
                        "tied": tied_dims, "masked": masked_dims, "zoo": fixed_dims, "extreme": fixed_dims,
                        "canary": fixed_dims}


def model_dims(model: str, world_size: int) -> st.SearchStrategy[Dict[str, object]]:
    """The dims strategy of ``model`` (``mlp_dims``, ``conv_dims`` or ``transformer_dims``) at
    ``world_size``. Raises ``InvalidArgument`` for an unknown model."""
    if model not in MODEL_DIM_STRATEGIES and contract_path(model) is not None:
        return st.just({})  # a model of its own (docs/models.md) has no dims to vary
    if model not in MODEL_DIM_STRATEGIES:
        raise InvalidArgument(f"unknown model {model!r}; choose from {MODEL_NAMES}")
    # each draws a Dict[str, int] or Dict[str, object]: read-only here, so a Dict[str, object]
    return cast(st.SearchStrategy[Dict[str, object]], MODEL_DIM_STRATEGIES[model](world_size))


def global_batch_sizes(world_size: int, *, min_per_rank: int = 1, min_value: int = 1,
                       max_value: Optional[int] = None) -> st.SearchStrategy[int]:
    """Global batch sizes in ``[max(min_value, world_size * min_per_rank), max_value]``;
    ``max_value`` defaults to ``2 * world_size + 2`` (so uneven and one-sample-per-rank batches
    are common draws). Shrinks towards the smallest. Raises ``InvalidArgument`` on an empty range.
    """
    lo = max(min_value, world_size * min_per_rank)
    hi = 2 * world_size + 2 if max_value is None else max_value
    if hi < lo:
        raise InvalidArgument(f"no global batch size in [{lo}, {hi}] (world_size={world_size}, "
                              f"min_per_rank={min_per_rank})")
    return st.integers(lo, hi)


@st.composite
def batch_splits(draw, global_batch: int, world_size: int, *, min_per_rank: int = 0) -> Tuple[Tuple[int, ...], ...]:
    """A split of the sample indices ``0..global_batch-1`` into ``world_size`` contiguous, ordered
    chunks, one per rank: ``((0, 1), (2,), ())`` -- what a rank-local (e.g. Poisson) sampler can
    give, uneven and, with ``min_per_rank=0``, empty on some ranks. Ranks 0..n-2 draw their sizes
    in turn (each at least ``min_per_rank``, leaving enough for the rest); the last rank gets the
    remainder. Shrinks towards every rank but the last holding ``min_per_rank`` samples and the
    last rank holding all the others. Raises ``InvalidArgument`` if
    ``global_batch < world_size * min_per_rank``.
    """
    if global_batch < world_size * min_per_rank:
        raise InvalidArgument(f"cannot give {world_size} ranks >= {min_per_rank} samples each out of {global_batch}")
    sizes, left = [], global_batch
    for r in range(world_size - 1):
        k = draw(st.integers(min_per_rank, left - min_per_rank * (world_size - 1 - r)))
        sizes.append(k)
        left -= k
    sizes.append(left)
    out, start = [], 0
    for k in sizes:
        out.append(tuple(range(start, start + k)))
        start += k
    return tuple(out)


def data_layouts(layouts: Sequence[str] = DATA_LAYOUTS) -> st.SearchStrategy[str]:
    """One of ``layouts`` (``"replicated"``: every rank holds the whole batch; ``"split"``: each
    rank holds its own samples). Shrinks towards ``"split"`` when it is allowed (the layout opacus
    defines a DP step for), else the first given."""
    layouts = tuple(layouts)
    return st.sampled_from(sorted(layouts, key=lambda x: x != "split"))


def reductions(values: Sequence[str] = REDUCTIONS) -> st.SearchStrategy[str]:
    """Loss reductions, ``"mean"`` or ``"sum"``. Shrinks towards the first given (``"mean"``)."""
    return st.sampled_from(tuple(values))


def dtypes(values: Sequence[str] = DTYPES) -> st.SearchStrategy[str]:
    """Model dtype names (``"float64"``, ``"float32"``; ``"bfloat16"`` if asked for: the properties
    have a tolerance for it, but not every target supports it on CPU). Shrinks towards the first
    given (``"float64"``)."""
    return st.sampled_from(tuple(values))


def dataset_sizes(world_size: int, *, max_value: Optional[int] = None) -> st.SearchStrategy[int]:
    """Poisson dataset sizes N in ``[world_size, max_value]`` (default ``4 * world_size + 3``: sizes
    the world size divides and sizes it does not, so ranks own different numbers of samples).
    Shrinks towards ``world_size`` (one sample per rank)."""
    hi = 4 * world_size + 3 if max_value is None else max_value
    if hi < world_size:
        raise InvalidArgument(f"no dataset size in [{world_size}, {hi}]: a rank would own no sample")
    return st.integers(world_size, hi)


def seeding_policies(values: Sequence[str] = SEEDINGS) -> st.SearchStrategy[str]:
    """How the ranks seed a Poisson sampler: ``same`` / ``per_rank`` / ``unseeded``
    (``RunSpec.seeding``). Shrinks towards the first given (``same``: what most scripts do)."""
    unknown = set(values) - set(SEEDINGS)
    if unknown:
        raise InvalidArgument(f"unknown seeding policies {sorted(unknown)}; choose from {SEEDINGS}")
    return st.sampled_from(tuple(values))


def opacus_sample_rate(dataset_size: int, world_size: int, local_batch: int) -> float:
    """The q opacus derives (``1/len(data_loader)``) for a DistributedSampler over ``dataset_size``
    samples at ``world_size`` ranks with local batch size ``local_batch``."""
    n_local = -(-dataset_size // world_size)
    return 1.0 / -(-n_local // max(1, min(local_batch, n_local)))


def with_whole_expected_batch(q: float, dataset_size: int) -> float:
    """``q``, or the nearest float above it where the expected batch ``int(q N)`` is at least 1: 1/k
    times N = k can round to 0.999... (1/49 * 49), which ``RunSpec`` refuses (opacus divides by that
    expected batch). A draw of such a q would stop the strategy (a test failed on N = 49)."""
    while q < 1.0 and int(q * dataset_size) < 1:
        q = math.nextafter(q, 2.0)
    return q


@st.composite
def poisson_params(draw, world_size: int, *, max_local_batch: int = 3, max_epochs: int = 3,
                   seedings: Sequence[str] = SEEDINGS) -> Dict[str, object]:
    """``RunSpec`` fields of a Poisson run at ``world_size`` ranks: ``dataset_size`` from
    ``dataset_sizes``, ``sample_rate`` q as opacus derives it from a local batch of 1..
    ``max_local_batch`` (``opacus_sample_rate``: an expected local batch of about that size, so
    empty local batches are likely), ``epochs`` 1..``max_epochs``, ``seeding`` from
    ``seeding_policies`` and ``sampling_seed`` 0..3. Shrinks towards N = world_size, local batch 1,
    one epoch, ``same`` seeding, seed 0."""
    n = draw(dataset_sizes(world_size))
    b = draw(st.integers(1, max_local_batch))
    q = with_whole_expected_batch(opacus_sample_rate(n, world_size, b), n)
    return {"sampling": "poisson", "dataset_size": n, "sample_rate": q,
            "epochs": draw(st.integers(1, max_epochs)), "seeding": draw(seeding_policies(seedings)),
            "sampling_seed": draw(st.integers(0, 3)), "steps": 0}


@st.composite
def run_specs(draw, world_size: IntOrStrategy, *, models: Sequence[str] = BASE_MODELS,
              layouts: Sequence[str] = DATA_LAYOUTS, reduction_values: Sequence[str] = REDUCTIONS,
              dtype_values: Sequence[str] = ("float64",), steps: int = 1, min_global_batch: int = 1,
              min_per_rank: int = 1, explicit_splits: bool = True, grad_sample_mode: str = "ghost_fsdp",
              seeds: bool = True, sampling_values: Sequence[str] = ("fixed",)) -> RunSpec:
    """A ``RunSpec`` for ``world_size`` ranks (an int, or a strategy such as ``world_sizes()``):
    the model from ``models`` with ``model_dims``; the layout, reduction and dtype from the given
    values; the global batch from ``global_batch_sizes``; ``steps`` steps.

    Split data uses one of two data paths: ``"sampler"`` -- ``rank_batches=None``, a global batch
    that is a multiple of ``world_size`` (what ``DistributedSampler`` gives) -- or, when
    ``explicit_splits``, ``"explicit"`` -- ``rank_batches`` from ``batch_splits(..., min_per_rank)``
    per step, uneven, empty on some ranks when ``min_per_rank=0`` (only for targets whose data path
    allows empty local batches). ``seeds`` also draws the model and batch seeds (0..3).

    ``sampling_values``: ``("fixed",)`` (default: no sampling draws at all) or with ``"poisson"``:
    the sampling is drawn (shrinking towards the first given) and a Poisson draw takes its
    fields from ``poisson_params(ws)`` (the fixed batch fields stay as drawn, unused).

    Shrinks towards: the smallest world size, the first model, its smallest dims, split data on
    the sampler path with the smallest multiple of ``world_size`` >= ``min_global_batch``, seeds
    0/1, and the first reduction and dtype. (Every branch draws the same number of values, so the
    shrinker compares configurations by value; see the comment in the code.)
    """
    ws = draw(world_size) if isinstance(world_size, st.SearchStrategy) else int(world_size)
    if ws < 1:
        raise InvalidArgument(f"world_size must be >= 1, got {ws}")
    model = draw(st.sampled_from(tuple(models)))
    dims = draw(model_dims(model, ws))
    layout = draw(data_layouts(layouts))
    # Every branch below makes the same number of draws: hypothesis shrinks towards *shorter*
    # choice sequences first, so a branch that drew less (say replicated data) would count as
    # simpler than a split with smaller dims; equal lengths let the values decide.
    can_split = explicit_splits and ws > 1 and "split" in layouts
    path = draw(st.sampled_from(("sampler", "explicit"))) if can_split else "sampler"
    extra = draw(st.integers(0, ws + 2))
    lo = max(1, min_global_batch)
    if layout == "replicated":
        batch = lo + extra
    elif path == "explicit":
        batch = max(lo, ws * min_per_rank) + extra
    else:  # DistributedSampler: a multiple of the world size, at least one sample per rank
        batch = ws * (max(1, -(-lo // ws)) + min(extra, 2))
    split_of = batch if (layout == "split" and path == "explicit") else max(batch, ws * min_per_rank)
    splits = tuple(draw(batch_splits(split_of, ws, min_per_rank=min_per_rank)) for _ in range(steps))
    rank_batches = splits if (layout == "split" and path == "explicit") else None
    model_seed, batch_seed = (draw(st.integers(0, 3)), draw(st.integers(1, 4))) if seeds else (0, 1)
    poisson: Dict[str, Any] = {}  # RunSpec's Poisson fields
    if tuple(sampling_values) != ("fixed",):
        sampling = draw(st.sampled_from(tuple(sampling_values)))
        params = draw(poisson_params(ws))  # drawn on both branches: equal-length choice sequences
        if sampling == "poisson":
            poisson, rank_batches = params, None
    return RunSpec(model=model, model_seed=model_seed, global_batch_size=batch, batch_seed=batch_seed,
                   data_layout="split" if poisson else layout, reduction=draw(reductions(reduction_values)),
                   dtype=draw(dtypes(dtype_values)), **{"steps": steps, **poisson}, grad_sample_mode=grad_sample_mode,
                   rank_batches=rank_batches, model_kwargs=tuple(sorted(dims.items())))


#: a drawn long run (more than one step) processes about this many samples in all (steps x
#: expected global batch), so one draw costs about what one of the gate's long runs costs (48
#: steps x 32 samples) and never runs into the job deadline on a loaded runner
LONG_RUN_SAMPLE_STEPS = 1600


#: a noisy draw's largest local batch: its releases feed the release judge only where the global batch is at
#: most half the model's coordinates (``releases/analysis.MAX_SPAN_FRACTION``: the signal is projected off
#: the batch's span) -- 32 samples at 4 ranks leave the default mlp (219 coordinates) 187 noise values a step;
#: at the 64 of the local-batch axis most noisy draws of the mlp and of model variants were not judged at all
NOISY_LOCAL_BATCH = 8


#: a noisy draw's steps (but a long run's) and model size: the release judge sees a std a few tenths off
#: in about steps x (coordinates - batch) noise values; a model variant's few coordinates (a 1-channel 2x2
#: conv: tens) in 2 steps were too few -- sigma capped at 3 (std 3/3.94 x) passed such a draw, run seed
#: 5101, 2026-11-29 -- the default sizes (mlp 219, transformer 1598, conv 4301 coordinates) in 4 steps are not
NOISY_STEPS = 4


#: the dims that are some parameter's dim 0 (``models.MODEL_DIMS``): what FSDP shards
DIM0_KEYS = ("hidden", "classes", "width", "mixer", "vocab", "d_model", "d_ff", "seq_len", "rank")


#: the dims a normalisation layer normalises over (the mlp's LayerNorm, the transformer's norms):
#: exploration draws them >= 2 (``_no_short_rows``)
NORMALISED_KEYS = ("hidden", "d_model")


def _no_short_rows(dims: Dict[str, object], ws: int) -> Dict[str, object]:
    """``dims`` with every dim 0 at least ``ws`` (kept a multiple of its heads / groups): a parameter
    with fewer rows than ranks is a fixed short-layer case's and fuzzing's, and upstream
    opacus 1.6.0 crashes on it (docs/findings.md, finding 3) -- an exploration that drew it would
    end there on every upstream run instead of looking further. And every dim a normalisation layer
    normalises over (``NORMALISED_KEYS``) at least 2: a LayerNorm over one feature has zero variance
    by construction, its output is its bias and nothing before it gets a gradient, and float32's
    rounding of ``x - mean`` (not exactly 0 in torch's fused kernel) comes out of it amplified by
    1/sqrt(eps) = 316 -- beyond the fixed float32 tolerance (the one-step check of the
    clipped DP step failed ``Correct`` on such a draw, a d_model 1 transformer, gate run seed 40191:
    docs/explore.md)."""
    out = {k: (max(v, ws) if k in DIM0_KEYS and isinstance(v, int) else v) for k, v in dims.items()}
    for key in NORMALISED_KEYS:
        if isinstance(out.get(key), int):
            out[key] = max(cast(int, out[key]), 2)
    for key, unit in (("d_model", "n_heads"), ("width", "groups")):
        if key in out and unit in out:
            out[key] += (-out[key]) % out[unit]  # type: ignore[operator]
    return out


def _int_range(name: str) -> Tuple[int, int]:
    return integer(name).drawn


def _int_in(strata, axis: str, lo: int, hi: int) -> st.SearchStrategy[int]:
    """Integers in ``lo..hi``, or in the draw's region of it (``strata``: ``fuzz/strata.py``)."""
    at = strata_mod.region(strata, axis)
    return st.integers(*(strata_mod.int_region(lo, hi, *at) if at else (lo, hi)))


def _float_in(strata, axis: str, lo: float, hi: float) -> st.SearchStrategy[float]:
    """Floats in ``[lo, hi]``, or in the draw's region of it (its top end excluded but for the last)."""
    at = strata_mod.region(strata, axis)
    if not at:
        return st.floats(lo, hi)
    a, b = strata_mod.float_region(lo, hi, *at)
    return st.floats(a, b, exclude_max=at[0] < at[1] - 1)


def _named_in(strata, axis: str, values: Sequence[Any]) -> st.SearchStrategy[Any]:
    """One of ``values``, or the draw's region's (a named axis' region is one value)."""
    at = strata_mod.region(strata, axis)
    return st.just(values[at[0]]) if at else st.sampled_from(tuple(values))


@st.composite
def explore_specs(draw, max_world_size: Optional[int] = None, *, models: Sequence[str] = space.EXPLORE_MODELS,
                  samplings: Sequence[str] = choice("sampling").drawn,
                  precisions: Sequence[str] = choice("precision").drawn,
                  physical: bool = True, long_runs: bool = True, resume: bool = False, noise: bool = False,
                  grad_sample_mode: str = "ghost_fsdp", strata: Optional["strata_mod.Strata"] = None):
    """``(world_size, spec, knobs)``: one configuration drawn from the configuration space
    (``dpfsdp_verify.config.space``; every range is the axis' ``explore``): the world size 1..``max_world_size``
    (default ``space.explore_max_world_size()``), a model of ``models`` at its default size or a
    variant (``model_dims``: conv groups, widths, norms...), the reduction, precision and dtype
    (a bf16 form over float32; a variant's every dim 0 at least the world size: ``_no_short_rows``),
    fixed batches of 1..64 samples per rank (``local_batch``) or
    Poisson sampling (q as opacus derives it for a local batch of 1..64 over 1..64 samples per rank,
    ``same`` or ``per_rank`` seeding), one step -- or, with ``long_runs``, a Poisson run of up to
    200 steps at lr 0 on the mlp (every step judged against the same parameters; its local batch
    capped so that it processes about ``LONG_RUN_SAMPLE_STEPS`` samples) -- the lr in (0, 1], and with
    ``physical`` a physical batch size (gradient accumulation) of 1..64 on fixed batches.
    ``knobs["clip_quantile"]`` in [0, 1] says where the property puts C among the reference norms
    (0: below every norm, all clipped; 1: above, none). With ``resume``, a third of the draws
    without accumulation also get ``knobs["resume_fraction"]`` in [0, 1): where among its steps the
    property checkpoints the run and resumes it in fresh ranks (``resume_at`` axis; none
    otherwise). With ``noise`` (a property that runs the draw with noise), ``knobs["noise_multiplier"]``:
    sigma in [0.5, 4] (the axis' ``explore`` range: at sigma 1 a noise std or a told sigma that is
    sigma^2, sqrt(sigma) or 1/sigma is right). ``strata`` (``fuzz/strata.py``: axis -> (region, count),
    exploration's draw ``i``): each stratified axis is drawn inside its region only -- the world size,
    model, precision and dtype, batch mode (fixed, accumulation, Poisson, resumed: then a resume
    point on every such draw), local batch, lr, C quantile and sigma. Shrinks towards one rank, the
    mlp at its default size, mean, fixed sampling, fp32 float64, one sample per rank, one step, no
    accumulation, no resume, the smallest lr and C below every norm, and sigma 0.5 (with ``strata``:
    the smallest of each region)."""
    hi = max_world_size or space.explore_max_world_size()
    ws = draw(_int_in(strata, "world_size", 1, hi))
    model = draw(_named_in(strata, "model", tuple(models)))
    variant = draw(st.booleans()) and not noise  # a noisy draw: the default size (NOISY_STEPS)
    dims = _no_short_rows(draw(model_dims(model, ws)), ws) if variant else {}
    reduction = draw(st.sampled_from(choice("reduction").drawn))
    at = strata_mod.region(strata, "batches")
    mode = strata_mod.batch_modes(samplings, physical, resume)[at[0]] if at else None
    pick = tuple(samplings) if mode in (None, "resumed") else ("poisson",) if mode == "poisson" else ("fixed",)
    sampling = draw(st.sampled_from(pick))
    lo_b, hi_b = _int_range("local_batch")
    local = draw(_int_in(strata, "local_batch", lo_b, min(hi_b, NOISY_LOCAL_BATCH) if noise else hi_b))
    per_rank = draw(st.integers(*_int_range("samples_per_rank")))
    seeding = draw(st.sampled_from(choice("seeding").drawn))
    # a third of the Poisson draws are long runs: each costs about what one of the gate's long runs does
    long = long_runs and sampling == "poisson" and draw(st.integers(0, 2)) == 2
    steps = draw(st.integers(*_int_range("steps"))) if long else 1
    if steps > 1:  # a long run's work is bounded: about LONG_RUN_SAMPLE_STEPS samples in all, the mlp
        local = max(1, min(local, LONG_RUN_SAMPLE_STEPS // (steps * ws)))
        model, dims = "mlp", {}
    # a long run is judged step by step against fp32 tolerances (the long runs' judges): fp32 only
    forms = strata_mod.precision_modes(precisions, DTYPES)
    if strata_mod.region(strata, "precision"):
        precision, dtype = draw(_named_in(strata, "precision", forms))
        precision, dtype = (precision, dtype) if steps == 1 else ("fp32", "float32" if precision != "fp32" else dtype)
    else:
        precision = draw(st.sampled_from(tuple(precisions))) if steps == 1 else "fp32"
        dtype = "float32" if precision != "fp32" else draw(st.sampled_from(DTYPES))
    lr = 0.0 if steps > 1 else draw(_float_in(strata, "lr", *real("lr").drawn))
    accumulate = mode == "accumulation" or (mode is None and physical and sampling == "fixed" and draw(st.booleans()))
    p = draw(st.integers(*_int_range("physical_batch_size"))) if accumulate else 0
    quantile = draw(_float_in(strata, "clip_quantile", *real("clip_quantile").drawn))
    knobs: Dict[str, Any] = {"clip_quantile": quantile}
    # resume without accumulation (space.combination_problem): a third of such draws, or the resumed region's
    if resume and not p and (mode == "resumed" or (mode is None and draw(st.integers(0, 2)) == 2)):
        knobs["resume_fraction"] = draw(st.floats(0.0, 1.0, exclude_max=True))
    if noise:
        knobs["noise_multiplier"] = draw(_float_in(strata, "noise_multiplier", *real("noise_multiplier").drawn))
    steps = NOISY_STEPS if noise and steps == 1 else steps
    seeds = dict(model_seed=draw(st.integers(0, 3)), batch_seed=draw(st.integers(1, 4)))
    base = dict(model=model, reduction=reduction, dtype=dtype, precision=precision, lr=lr, steps=steps,
                grad_sample_mode=grad_sample_mode, model_kwargs=tuple(sorted(dims.items())), **seeds)
    if sampling == "poisson":
        n = per_rank * ws
        q = with_whole_expected_batch(opacus_sample_rate(n, ws, local), n)
        per_epoch = int(1 / q)
        # twice the epochs the steps need: every rank stops after ``steps`` steps, so a sampler that
        # skips empty local batches (upstream opacus, docs/findings.md finding 6: pinned by the fixed
        # whole-epoch scenarios) does not run out of draws on one rank first
        spec = RunSpec(**base, sampling="poisson", sample_rate=q, dataset_size=n, seeding=seeding,
                       epochs=capped_epochs(steps, per_epoch), sampling_seed=draw(st.integers(0, 3)))
    else:
        spec = RunSpec(**base, global_batch_size=local * ws, physical_batch_size=p)
    return ws, spec, knobs


def spec_summary(spec: RunSpec, world_size: int) -> str:
    """A one-line human description of a spec, for failure reports: ``mlp(d_in=1, hidden=3,
    classes=2) at world_size=2, split [2|1], batch 3, mean, float64``."""
    dims = ", ".join(f"{k}={v}" for k, v in spec.model_kwargs)
    if spec.poisson:
        data = (f"Poisson sampling (N={spec.dataset_size}, q={spec.sample_rate:.4g}, {spec.epochs} epoch(s), "
                f"seeding {spec.seeding!r}, seed {spec.sampling_seed})")
    elif spec.rank_batches is not None:
        data = "split " + " ".join("[" + "|".join(str(len(r)) for r in step) + "]" for step in spec.rank_batches)
    else:
        data = spec.data_layout + (" (DistributedSampler)" if spec.data_layout == "split" else "")
    return (f"{spec.model}({dims}) at world_size={world_size}, {data}, batch {spec.global_batch_size}, "
            f"{spec.reduction}, {spec.dtype}, seeds model={spec.model_seed} batch={spec.batch_seed}")


__all__ = ["SHARD_RELATIONS", "DTYPES", "PAD_FRACTIONS", "world_sizes", "shard_dims", "mlp_dims", "conv_dims",
           "transformer_dims", "model_dims", "seq_lens", "pad_fractions", "global_batch_sizes", "batch_splits",
           "data_layouts", "reductions", "dtypes", "run_specs", "spec_summary", "dataset_sizes", "seeding_policies",
           "opacus_sample_rate", "poisson_params", "explore_specs", "LONG_RUN_SAMPLE_STEPS"]

"""The configuration space: every axis a DP-FSDP run varies along, its range, its default, which
combinations are valid, and the seeds of a run's random streams. Torch-free (``--help`` reads it).

A configuration of DP-SGD under FSDP is a point on these axes: where it runs (world size, a 2-D
mesh), what it trains (model and its variants, dtype, mixed precision, loss reduction), how the
batches are formed (data layout, fixed or Poisson sampling with rate q and a seeding policy, the
local batch size), the loop (steps, physical batch size under gradient accumulation, a resume
point), and the DP step itself (clip bound C, learning rate, noise multiplier). A bug that is
right at every point someone listed by hand is still wrong at some point of the space: the gate's
fixed cases are the floor, and exploration (``--explore DRAWS``, docs/explore.md) draws further
points from the ranges below (``Axis.explore``) and judges them with the properties' own judges.

* Each axis is a small value object (``Choice``, ``Integer``, ``Real``) that validates a value
  (``check`` -> ``None`` or the one-line problem; ``validate`` raises ``ValueError``) and states its
  full range, its default (read from ``defaults.py``, the one place defaults are written) and the
  sub-range exploration draws from.
* ``combination_problem`` says which combinations of values cannot run (the rules ``RunSpec``
  enforces, stated once in its own terms; ``tests/test_space.py`` checks the two agree).
* ``seed_for(run_seed, *names)``: a stream's seed derived by name from the run's seed -- a stable
  hash, so two streams with different names never share a seed by accident (an offset such as
  ``seed + 7`` could equal another stream's ``seed + 3`` at the next run seed), and ``--seed``
  replays every stream exactly. ``adjacent(seed, i)`` is the one sanctioned offset: streams whose
  seeds are adjacent *on purpose* (a generator seeded ``noise_seed + step`` repeats across them).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple, Type, TypeVar

from . import defaults as D

#: seeds are 31-bit (torch, numpy and the CLI's ``--seed`` all take them)
SEED_MODULUS = 2 ** 31


def seed_for(run_seed: int, *names: Any) -> int:
    """The seed of the random stream named ``names`` (e.g. a property id, then ``"fresh_job", 2``)
    in the run whose seed is ``run_seed``: a stable hash (blake2b of the names' ``repr``s, never
    Python's salted ``hash``), the same on every machine and Python version, different for every
    name and run seed."""
    if isinstance(run_seed, bool) or not isinstance(run_seed, int):
        raise ValueError(f"run seed must be an int, got {run_seed!r}")
    text = "\x1f".join([str(run_seed)] + [repr(n) for n in names])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") % SEED_MODULUS


def adjacent(seed: int, i: int) -> int:
    """The ``i``-th of a run of adjacent seeds starting at ``seed``: for streams that must be
    adjacent on purpose (a generator seeded with ``noise_seed + step`` gives run i+1's step k the
    noise of run i's step k+1, which only adjacent seeds expose)."""
    return (seed + i) % SEED_MODULUS


R = TypeVar("R")


def _explored(name: str, explore: Optional[R]) -> R:
    """A ranged axis' ``explore`` range; ``ValueError`` for an axis exploration never draws."""
    if explore is None:
        raise ValueError(f"axis {name} is not explored")
    return explore


@dataclass(frozen=True)
class Axis:
    """One axis: ``name``, what it means, its default (``None``: none / each property's own)."""

    name: str
    meaning: str
    default: Any = None

    def check(self, value: Any) -> Optional[str]:  # pragma: no cover - every axis overrides it
        raise NotImplementedError

    def validate(self, value: Any) -> Any:
        """``value`` if it is on the axis, else ``ValueError`` with the one-line problem."""
        problem = self.check(value)
        if problem:
            raise ValueError(problem)
        return value

    def describe(self) -> str:  # pragma: no cover - every axis overrides it
        raise NotImplementedError


@dataclass(frozen=True)
class Choice(Axis):
    """An axis of named values (``values``); exploration draws from ``explore`` (``None``: all;
    ``()``: none, exploration keeps the axis at its default)."""

    values: Tuple[str, ...] = ()
    explore: Optional[Tuple[str, ...]] = None

    @property
    def drawn(self) -> Tuple[str, ...]:
        """The values exploration draws from."""
        return self.values if self.explore is None else self.explore

    def __post_init__(self):
        if self.explore is None:
            object.__setattr__(self, "explore", self.values)
        bad = [v for v in tuple(self.explore or ()) + ((self.default,) if isinstance(self.default, str) else ())
               if v not in self.values]
        if bad:
            raise ValueError(f"axis {self.name}: {bad} not among {self.values}")

    def check(self, value: Any) -> Optional[str]:
        if value not in self.values:
            return f"{self.name} {value!r}: choose from {','.join(self.values)}"
        return None

    def describe(self) -> str:
        return ", ".join(self.values)


@dataclass(frozen=True)
class Integer(Axis):
    """An integer axis ``lo..hi`` (``hi=None``: unbounded); ``none`` is a value outside the range
    that means "off" (e.g. ``physical_batch_size`` 0: no accumulation); exploration draws from
    ``explore`` = ``(lo, hi)``."""

    lo: int = 0
    hi: Optional[int] = None
    none: Optional[int] = None
    explore: Optional[Tuple[int, int]] = None

    @property
    def drawn(self) -> Tuple[int, int]:
        """``(lo, hi)`` exploration draws from; ``ValueError`` for an axis it never draws."""
        return _explored(self.name, self.explore)

    def __post_init__(self):
        ex = self.explore
        if ex is not None and (ex[0] < self.lo or (self.hi is not None and ex[1] > self.hi) or ex[0] > ex[1]):
            raise ValueError(f"axis {self.name}: explore range {self.explore} outside {self.lo}..{self.hi}")

    def check(self, value: Any) -> Optional[str]:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{self.name} {value!r}: must be an integer"
        if self.none is not None and value == self.none:
            return None
        if value < self.lo or (self.hi is not None and value > self.hi):
            off = f" (or {self.none}: none)" if self.none is not None else ""
            return f"{self.name} {value}: must be in {self.lo}..{'' if self.hi is None else self.hi}{off}"
        return None

    def describe(self) -> str:
        none = f" ({self.none}: none)" if self.none is not None else ""
        return f"{self.lo}..{'' if self.hi is None else self.hi}" + none


@dataclass(frozen=True)
class Real(Axis):
    """A real axis between ``lo`` and ``hi`` (``lo_open``/``hi_open``: excluded; ``hi=None``:
    unbounded); exploration draws from ``explore`` = ``(lo, hi)``, open at ``lo`` when ``lo_open``."""

    lo: float = 0.0
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    explore: Optional[Tuple[float, float]] = None

    @property
    def drawn(self) -> Tuple[float, float]:
        """``(lo, hi)`` exploration draws from; ``ValueError`` for an axis it never draws."""
        return _explored(self.name, self.explore)

    def check(self, value: Any) -> Optional[str]:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            return f"{self.name} {value!r}: must be a number"
        low_bad = value <= self.lo if self.lo_open else value < self.lo
        high_bad = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        if low_bad or high_bad:
            return f"{self.name} {value!r}: must be in {self.describe()}"
        return None

    def describe(self) -> str:
        return (("(" if self.lo_open else "[") + f"{self.lo:g}, " + ("inf)" if self.hi is None else
                                                                    f"{self.hi:g}" + (")" if self.hi_open else "]")))


# -- the axes ---------------------------------------------------------------------------------------
#: the model names (``models.MODEL_NAMES``; ``tests/test_space.py`` checks they agree)
MODELS = ("mlp", "conv", "transformer", "lora", "tied", "masked", "zoo", "extreme", "canary")
#: the models exploration draws, with their variants (``models.MODEL_DIMS``: conv groups, widths...)
EXPLORE_MODELS = ("mlp", "conv", "transformer")

AXES: Dict[str, Axis] = {a.name: a for a in (
    Integer("world_size", "ranks in the job (gloo: processes on this host)", D.DEFAULT_WORLD_SIZES,
            lo=1, hi=D.MAX_GLOO_WORLD_SIZE, explore=(1, D.EXPLORE_MAX_WORLD_SIZE)),
    Integer("wide_world_size", "a world size >= 3 for the cheap rank-index cases (docs/horizon.md)", D.WIDE_WORLD_SIZE,
            lo=3, hi=D.MAX_GLOO_WORLD_SIZE, none=0),
    Integer("node_world_size", "an even world size >= 4 run as nodes of 2 ranks, for the cheap cases of bugs from "
            "the fourth rank on or across nodes (docs/horizon.md)", D.NODE_WORLD_SIZE, lo=4, hi=D.MAX_GLOO_WORLD_SIZE,
            none=0),
    Choice("mesh", "2-D mesh kind: HSDP replicas x shard, data x tensor parallel (docs/meshes.md)", None,
           values=("hsdp", "tp"), explore=()),
    Choice("data_layout", "each rank its own samples, or every sample on every rank", D.SPEC_DEFAULTS["data_layout"],
           values=("replicated", "split"), explore=("split",)),
    Choice("model", "the model trained (its dims are the model's variants: models.MODEL_DIMS)",
           D.SPEC_DEFAULTS["model"], values=MODELS, explore=EXPLORE_MODELS),
    Choice("reduction", "the loss reduction", D.SPEC_DEFAULTS["reduction"], values=("mean", "sum")),
    Choice("dtype", "the parameters' dtype", D.SPEC_DEFAULTS["dtype"], values=("float64", "float32", "bfloat16"),
           explore=("float64", "float32")),
    Choice("precision", "mixed precision: bf16 compute over float32 parameters (docs/precision.md)",
           D.SPEC_DEFAULTS["precision"], values=("fp32", "bf16-fsdp", "bf16-autocast")),
    Choice("sampling", "given batches, or DP-SGD's Poisson sampling", D.SPEC_DEFAULTS["sampling"],
           values=("fixed", "poisson")),
    Choice("seeding", "how the ranks seed a Poisson sampler", D.SPEC_DEFAULTS["seeding"],
           values=("same", "per_rank", "unseeded"), explore=("same", "per_rank")),
    Real("sample_rate", "Poisson q: each sample's probability of being in a step's batch", D.POISSON_DEFAULTS[0],
         lo=0.0, hi=1.0, lo_open=True, explore=(0.05, 1.0)),
    Integer("samples_per_rank", "Poisson dataset samples per rank (N = this x world size)", D.POISSON_DEFAULTS[1],
            lo=1, explore=(1, 64)),
    Integer("local_batch", "samples a rank processes in one step (default: each property's own)", None,
            lo=1, explore=(1, 64)),
    Integer("physical_batch_size", "gradient accumulation: physical passes of at most this many samples",
            0, lo=1, none=0, explore=(1, 64)),
    Integer("resume_at", "checkpoint after this many steps and resume in fresh ranks (docs/resume.md)", 0,
            lo=1, none=0, explore=(1, 199)),
    Integer("steps", "DP steps in the run", D.SPEC_DEFAULTS["steps"], lo=1, explore=(1, 200)),
    Integer("horizon", "steps of the long Poisson runs (docs/horizon.md)", D.HORIZON_STEPS, lo=1, none=0),
    Real("lr", "the SGD learning rate (0: the parameters never move)", D.SPEC_DEFAULTS["lr"], lo=0.0, hi=1.0,
         explore=(0.01, 1.0)),
    Real("max_grad_norm", "the clip bound C", D.SPEC_DEFAULTS["max_grad_norm"], lo=0.0, lo_open=True),
    Real("clip_quantile", "where C sits among the reference norms (0: below all, every sample clipped; 1: above "
         "all, none clipped)", 0.5, lo=0.0, hi=1.0, explore=(0.0, 1.0)),
    Real("noise_multiplier", "sigma: the noise std is sigma C", D.SPEC_DEFAULTS["noise_multiplier"], lo=0.0,
         explore=(0.5, 4.0)),
    Real("timeout", "deadline of one distributed job, seconds", D.DEFAULT_TIMEOUT_S, lo=0.0, lo_open=True),
    Integer("explore", "configurations each explored property draws, fixed by the seed (docs/explore.md)",
            D.DEFAULT_EXPLORE_DRAWS, lo=0),
    Integer("seed", "the run's statistical seed (every stream's seed derives from it: seed_for)", None,
            lo=0, hi=SEED_MODULUS - 1),
)}


def axis(name: str) -> Axis:
    """The axis ``name``; ``KeyError`` naming the axes for an unknown one."""
    try:
        return AXES[name]
    except KeyError:
        raise KeyError(f"no axis {name!r}; the axes: {', '.join(AXES)}") from None


A = TypeVar("A", bound=Axis)


def _typed(name: str, kind: Type[A]) -> A:
    found = axis(name)
    if not isinstance(found, kind):
        raise TypeError(f"axis {name!r} is a {type(found).__name__}, not a {kind.__name__}")
    return found


def choice(name: str) -> Choice:
    """The named-values axis ``name`` (typed: ``.values``, ``.drawn``); ``TypeError`` for another kind."""
    return _typed(name, Choice)


def integer(name: str) -> Integer:
    """The integer axis ``name`` (typed: ``.lo``, ``.hi``, ``.drawn``); ``TypeError`` for another kind."""
    return _typed(name, Integer)


def real(name: str) -> Real:
    """The real axis ``name`` (typed: ``.lo``, ``.hi``, ``.drawn``); ``TypeError`` for another kind."""
    return _typed(name, Real)


def explore_max_world_size() -> int:
    """The largest world size exploration draws: the world-size axis' ``explore`` range's top
    (``EXPLORE_MAX_WORLD_SIZE``), whatever the host's cores -- the same ``--seed`` must draw the same
    configurations on any machine, and more cores must not mean more ranks to start."""
    return integer("world_size").drawn[1]


def mesh_problem(mesh: str, sampling: str = "fixed", physical_batch_size: int = 0, resume_at: int = 0,
                 data_layout: str = "split") -> Optional[str]:
    """Why a 2-D mesh cannot run this loop (``None`` if it can, or for ``mesh=""``): split data only,
    no accumulation or resume; Poisson sampling on HSDP only (every rank of an HSDP mesh is a
    data-parallel rank, so its Poisson sampler is the 1-D one; a data x TP mesh would need its TP peers
    to draw the same mask, which no target contract says how to do)."""
    if not mesh:
        return None
    if physical_batch_size or resume_at or data_layout != "split":
        return (f"mesh {mesh}: 2-D meshes run split batches only (no accumulation, resume or replicated data)")
    if sampling != "fixed" and not mesh.startswith("hsdp:"):
        return f"mesh {mesh}: Poisson sampling runs on HSDP meshes only (hsdp:RxS), not on data x tensor parallel"
    return None


def combination_problem(world_size: int = 1, dtype: str = "float64", precision: str = "fp32",
                        sampling: str = "fixed", sample_rate: Optional[float] = None,
                        samples_per_rank: Optional[int] = None, physical_batch_size: int = 0, resume_at: int = 0,
                        steps: int = 1, mesh: str = "", data_layout: str = "split",
                        dataset_size: Optional[int] = None, **_ignored) -> Optional[str]:
    """Why these values cannot run together (``None`` if they can): the cross-axis rules, written
    once here (``RunSpec.__post_init__`` asks this function of every spec). ``dataset_size`` (the
    global N, as a spec states it) replaces ``samples_per_rank x world_size``; ``steps`` is the
    run's step count."""
    if precision != "fp32" and dtype != "float32":
        return f"precision {precision} is bf16 compute over float32 parameters: it needs dtype float32, not {dtype}"
    problem = mesh_problem(mesh, sampling, physical_batch_size, resume_at, data_layout)
    if problem:
        return problem
    if resume_at and physical_batch_size:
        return "resume_at with physical_batch_size: resume without accumulation"
    if resume_at and resume_at >= steps:
        return (f"resume_at={resume_at} must be smaller than the run's {steps} steps: at least one step must follow "
                "the checkpoint")
    if sampling == "poisson":
        q = D.POISSON_DEFAULTS[0] if sample_rate is None else sample_rate
        n = dataset_size if dataset_size is not None else (
            (D.POISSON_DEFAULTS[1] if samples_per_rank is None else samples_per_rank) * world_size)
        if int(q * n) < 1:
            return (f"expected batch int(q * dataset_size) = int({q:g} * {n}) is 0 (opacus would divide by zero): "
                    "raise q or the dataset size")
    return None


def option_table(names: Sequence[str] = tuple(AXES)) -> str:
    """The markdown table of ``names``' axes (docs/explore.md's is this table; a test checks it):
    axis, meaning, range, default, what exploration draws."""
    rows = ["| axis | meaning | range | default | exploration draws |", "|---|---|---|---|---|"]
    for name in names:
        a = AXES[name]
        explore = getattr(a, "explore", None)
        if isinstance(a, Choice):
            drawn = ", ".join(explore) if explore else "-"
        elif explore:
            drawn = f"{explore[0]:g}..{explore[1]:g}" if isinstance(a, Real) else f"{explore[0]}..{explore[1]}"
        else:
            drawn = "-"
        default = ("-" if a.default is None else ",".join(map(str, a.default)) if isinstance(a.default, tuple)
                   else f"{a.default:g}" if isinstance(a.default, float) else str(a.default))
        rows.append(f"| `{name}` | {a.meaning} | {a.describe()} | {default} | {drawn} |")
    return "\n".join(rows)


__all__ = ["SEED_MODULUS", "seed_for", "adjacent", "Axis", "Choice", "Integer", "Real", "MODELS", "EXPLORE_MODELS",
           "AXES", "axis", "choice", "integer", "real",
           "explore_max_world_size", "combination_problem", "option_table"]

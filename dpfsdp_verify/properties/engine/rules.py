"""The rules that say whether options can run at all: the sampling options, the precision options,
and a comparing property's modes -- each written once here (the CLI turns an answer into exit 2,
the API into ``ValueError``); ``contract`` re-exports them."""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, Tuple

from ...config.defaults import POISSON_DEFAULTS
from ...config.modes import Mode
from ...targets.base import PRECISIONS, SAMPLINGS, SEEDINGS


class Comparing(Protocol):
    """What the modes rule reads of a property (``contract.Property`` has it)."""

    @property
    def id(self) -> str: ...

    @property
    def compares_modes(self) -> bool: ...

    def modes_for(self, modes: Sequence[Mode]) -> Tuple[Mode, ...]: ...


def sampling_problem(samplings, seedings, sample_rate, dataset_size, world_size: int = 1) -> Optional[str]:
    """Why these sampling options cannot run (``None`` if they can): the one place the rules are
    written (the CLI turns the answer into exit 2, the API into ``ValueError``)."""
    for name, given, allowed in (("sampling", samplings, SAMPLINGS), ("seeding", seedings, SEEDINGS)):
        if given is not None and (not given or any(g not in allowed for g in given)):
            return f"{name} {','.join(given) or '(none)'}: choose from {','.join(allowed)}"
    if sample_rate is not None and not (isinstance(sample_rate, (int, float)) and 0.0 < sample_rate <= 1.0):
        return f"sample rate {sample_rate!r}: must be in (0, 1]"
    if dataset_size is not None:
        if not isinstance(dataset_size, int) or dataset_size < 1:
            return f"dataset size {dataset_size!r}: must be an integer >= 1"
        if dataset_size < world_size:
            return (f"dataset size {dataset_size} is smaller than the world size {world_size}: some rank would own "
                    "no sample")
        q = sample_rate or POISSON_DEFAULTS[0]
        if int(q * dataset_size) < 1:
            return (f"expected batch int(q * dataset size) = int({q} * {dataset_size}) is 0 (opacus would divide by "
                    "zero): raise the sample rate or the dataset size")
    elif sample_rate is not None and int(sample_rate * POISSON_DEFAULTS[1]) < 1:
        return (f"sample rate {sample_rate}: the default dataset ({POISSON_DEFAULTS[1]} samples per rank) gives an "
                "expected batch of 0; give --dataset-size too")
    return None


def precision_problem(precisions, dtypes) -> Optional[str]:
    """Why these precision options cannot run (``None`` if they can): the one place the rules are
    written (the CLI turns the answer into exit 2, the API into ``ValueError``)."""
    if precisions is None:
        return None
    if not precisions or any(p not in PRECISIONS for p in precisions):
        return f"precision {','.join(precisions) or '(none)'}: choose from {','.join(PRECISIONS)}"
    if any(p != "fp32" for p in precisions) and dtypes is not None and "float32" not in dtypes:
        return (f"precision {','.join(p for p in precisions if p != 'fp32')} is bf16 compute over float32 "
                f"parameters, but the dtypes are {','.join(dtypes)}: add float32 to the dtypes (or leave them out)")
    return None


def modes_problem(prop: Comparing, modes: Sequence[Mode]) -> Optional[str]:
    """Why ``prop`` cannot run under ``modes`` (``None`` if it can): the one place the rule
    "a comparing property needs two or more modes" is written."""
    if prop.compares_modes and len(prop.modes_for(modes)) < 2:
        return f"{prop.id} compares modes: it needs two or more --mode-env labels"
    return None


__all__ = ["sampling_problem", "precision_problem", "modes_problem"]

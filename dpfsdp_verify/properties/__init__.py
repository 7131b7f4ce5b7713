"""Properties: one module per property id, each building a ``Property`` (``contract.py``) that
says what it means, which cases it runs and how it judges them; ``runner.py`` runs any of them.

    from dpfsdp_verify.properties import PROPERTIES
    verdicts = PROPERTIES["norm_fidelity"]("opacus", world_sizes=(1, 2), models=("mlp",))

Keywords are those of ``contract.Options`` (``world_sizes``, ``modes`` as ``{label: {VAR: value}}``,
``grad_sample_mode``, ``models``, ``data_layouts``, ``reductions``, ``dtype``, ``backend``,
``timeout``) plus the property's own ``params`` (e.g. ``deadlock_free``'s ``local_batches``), and
``pool`` (a ``harness.Pool``; default: the process-wide one). One ``Verdict`` per configuration;
a hang or crash is a verdict, never an exception.

Adding a property: one module that defines ``PROPERTY = Property(...)``, plus one line in
``REGISTRY`` below. Whether it can be fuzzed is its ``fuzz`` recipe; nothing else names it.
"""

from __future__ import annotations

from typing import Dict, List

from . import (clipped_step, deadlock_free, mode_equivalence, noise_calibration, norm_fidelity,
               sampling_accounting, sensitivity_bound, trajectory)
from .contract import Case, FuzzRecipe, Options, Outputs, Point, Property, by_id, modes_problem

#: every property, in the order the gate runs and reports them
REGISTRY = (
    norm_fidelity.PROPERTY,
    clipped_step.PROPERTY,
    sensitivity_bound.PROPERTY,
    noise_calibration.PROPERTY,
    mode_equivalence.PROPERTY,
    trajectory.PROPERTY,
    deadlock_free.PROPERTY,
    sampling_accounting.PROPERTY,
)

PROPERTIES: Dict[str, Property] = by_id(REGISTRY)


def fuzzable() -> List[str]:
    """Ids of the properties that have a fuzz recipe."""
    return [p.id for p in REGISTRY if p.fuzz is not None]


__all__ = ["PROPERTIES", "REGISTRY", "Property", "Options", "Case", "Point", "Outputs", "FuzzRecipe", "fuzzable",
           "modes_problem"]

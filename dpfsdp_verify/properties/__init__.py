"""Properties, packaged by topic: each topic package holds its check(s) -- a module building a
``Property`` (``engine/contract.py``) that says what it means, which cases it runs and how it judges
them -- with the analysis and wording only that topic uses; ``engine/runner.py`` runs any of them.

* topics: ``clipping/`` (``norm_fidelity``, ``clipped_step``, ``sensitivity_bound``; the norm
  hypotheses and parameter shares that name a wrong norm), ``noise/`` (``noise_calibration``; its
  statistics, exact checks, repeat wording), ``releases/`` (the whole-run release judge),
  ``training/`` (``mode_equivalence``, ``trajectory``, ``checkpoint_resume``), ``hangs/``
  (``deadlock_free``), ``sampling/`` (``sampling_accounting``), ``audit/`` (``privacy_audit``; the
  counting and f-DP bounds). No check imports another check;
* shared below them: ``wording/`` (sentences several topics speak: failures, the accountant, noise
  messages), ``analysis/`` (pure statistics, fits and comparisons against the float64 reference,
  the accountant's history checks), ``engine/`` (the contract: ``Property``, ``Case``, ``Options``;
  the runner; the checks every run gets, ``prechecks``; the long-run settings, ``horizon``).

    from dpfsdp_verify import properties
    verdicts = properties.run("norm_fidelity", "opacus", world_sizes=(1, 2), models=("mlp",))

Keywords are those of ``contract.Options`` (``world_sizes``, ``modes`` as ``{label: {VAR: value}}``,
``grad_sample_mode``, ``models``, ``data_layouts``, ``reductions``, ``dtype``, ``backend``,
``timeout``) plus the property's own ``params`` (e.g. ``deadlock_free``'s ``local_batches``), and
``pool`` (a ``harness.Pool``; default: the process-wide one). One ``Verdict`` per configuration;
a hang or crash is a verdict, never an exception.

Adding a property: one module that defines ``PROPERTY = Property(...)``, plus one line in
``REGISTRY`` below. Whether it can be fuzzed is its ``fuzz`` recipe; nothing else names it.
"""

from __future__ import annotations

from typing import Dict, List, Union

from ..verdict import Verdict
from .audit import check as privacy_audit
from .clipping import clipped_step, norm_fidelity, sensitivity_bound
from .hangs import check as deadlock_free
from .noise import check as noise_calibration
from .sampling import check as sampling_accounting
from .training import checkpoint_resume, mode_equivalence, trajectory
from .engine.contract import Case, FuzzRecipe, Options, Outputs, Point, Property, by_id, modes_problem
from .engine.runner import run_property

#: every property, in the order the gate runs and reports them (an ``opt_in`` one only when named); the
#: privacy audit first: its one long run and its scoring overlap the many short cases after it
REGISTRY = (
    privacy_audit.PROPERTY,
    norm_fidelity.PROPERTY,
    clipped_step.PROPERTY,
    sensitivity_bound.PROPERTY,
    noise_calibration.PROPERTY,
    mode_equivalence.PROPERTY,
    trajectory.PROPERTY,
    deadlock_free.PROPERTY,
    sampling_accounting.PROPERTY,
    checkpoint_resume.PROPERTY,
)

PROPERTIES: Dict[str, Property] = by_id(REGISTRY)


def run(prop: Union[str, Property], target_ref: str, *, pool=None, **options) -> List[Verdict]:
    """Run property ``prop`` (an id or a ``Property``) against ``target_ref``: one ``Verdict`` per
    configuration. ``options`` are ``Options``' keywords plus the property's own ``params``
    (``TypeError`` for one it does not know); ``pool`` a ``harness.Pool`` (default: the
    process-wide one, ``harness.default_pool``).
    ``ValueError`` for an unknown id."""
    if isinstance(prop, str):
        if prop not in PROPERTIES:
            raise ValueError(f"unknown property {prop!r}; choose one of {', '.join(PROPERTIES)}")
        prop = PROPERTIES[prop]
    return run_property(prop, prop.options(target_ref, **options), pool)


def fuzzable() -> List[str]:
    """Ids of the properties that have a fuzz recipe."""
    return [p.id for p in REGISTRY if p.fuzz is not None]


__all__ = ["run", "PROPERTIES", "REGISTRY", "Property", "Options", "Case", "Point", "Outputs", "FuzzRecipe", "fuzzable",
           "modes_problem"]

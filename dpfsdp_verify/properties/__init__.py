"""Properties: one module per property id (DESIGN.md), each turning rank outputs into verdicts.

Every property is called the same way::

    PROPERTIES[id](target_ref, *, pool=None, world_sizes=(1, 2), modes=None,
                   grad_sample_mode="ghost_fsdp", models=None, data_layouts=None,
                   reductions=None, dtype="float64", backend="gloo", timeout=60.0) -> list[Verdict]

* ``target_ref``: what ``targets.load_target`` accepts (``"opacus"``, ``"pkg.mod:Attr"``, an
  entry-point name); it is loaded on the ranks, never in the caller.
* ``pool``: a ``harness.Pool`` (warm worker groups); ``None`` uses the process-wide default pool.
* ``world_sizes``: rank counts to run at (a property skips sizes it has nothing to say about, e.g.
  ``deadlock_free`` at 1).
* ``modes``: ``{label: {ENV_VAR: value}}``; each label is run as its own worker group with that
  environment (``None`` means ``{"default": {}}``). ``mode_equivalence`` compares the first label
  with each other one and needs at least two.
* ``models`` / ``data_layouts`` / ``reductions``: ``None`` means the property's defaults
  (``<module>.DEFAULT_*``); pass a subset to narrow a run.
* ``timeout``: seconds per worker-group job (the watchdog deadline); a hang becomes a ``hang`` /
  ``deadlock`` verdict, a crash an ``error`` / ``rank_crash`` verdict, never an exception.

One ``Verdict`` per configuration (``config`` = world_size, data_layout, model, mode,
grad_sample_mode, reduction). ``PROPERTIES[id].meaning`` is the one-line DP meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List

from ..verdict import Verdict
from . import (clipped_step, deadlock_free, mode_equivalence, noise_calibration, norm_fidelity,
               sensitivity_bound, trajectory)


@dataclass(frozen=True)
class Property:
    id: str
    meaning: str
    check: Callable[..., List[Verdict]]

    def __call__(self, target_ref: str, **kwargs) -> List[Verdict]:
        return self.check(target_ref, **kwargs)


PROPERTIES: Dict[str, Property] = {
    m.ID: Property(m.ID, m.MEANING, m.check)
    for m in (norm_fidelity, clipped_step, sensitivity_bound, noise_calibration, mode_equivalence, trajectory,
              deadlock_free)
}

__all__ = ["PROPERTIES", "Property"]

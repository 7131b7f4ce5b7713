"""dpfsdp_verify: correctness and deadlock checks for differentially-private training under FSDP.

Public modules (each lists its public names in ``__all__``; anything else is internal and may
change): ``reference`` (single-process float64 ground truth), ``models`` (tiny seeded models),
``harness`` (worker groups, watchdog, pool: ``run``, ``Pool``), ``targets`` and ``targets.base``
(the target contract: ``Target``, ``RunSpec``, ``StepOutput``, ``RankOutput``), ``targets.util``
and ``targets.progress`` (helpers for adapters), ``properties`` (``PROPERTIES``, ``Property``,
``Options``) and ``properties.compare`` (helpers for a property's judge), ``strategies`` and
``fuzz`` (hypothesis; the ``fuzz`` extra), ``hypothesis_profiles``. The pytest plugin
(``plugin``) and the gate (``gate``: ``dpfsdp-verify``, ``python -m dpfsdp_verify``) are used through pytest and the
command line. Importing this package imports nothing heavy (no torch).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

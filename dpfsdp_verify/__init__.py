"""dpfsdp_verify: correctness and deadlock checks for differentially-private training under FSDP.

Public modules (each lists its public names in ``__all__``; anything else is internal and may
change): ``reference`` (single-process float64 ground truth), ``models`` (tiny seeded models:
``models.builtin``; their names, torch-free, in ``models.catalog``), ``verdict`` (``Verdict``: what
a property returns, and the reports' vocabulary), ``errors``, ``config.defaults`` (the run's
defaults the CLI states; ``config`` holds the configuration, torch-free), ``harness`` (worker
groups, watchdog, pool: ``run``, ``Pool``), ``targets`` and ``targets.base`` (the target contract:
``Target``, ``RunSpec``, ``StepOutput``, ``RankOutput``), ``targets.util`` and ``targets.progress``
(helpers for adapters), ``properties`` (``PROPERTIES``, ``Property``, ``Options``) and
``properties.analysis.compare`` (helpers for a property's judge), ``fuzz`` and ``strategies``
(hypothesis; the ``fuzz`` extra; ``strategies`` is ``fuzz.strategies``),
``config.hypothesis_profiles``.

The layers, bottom up: ``config``, ``reference``, ``models``, ``verdict``, ``harness``; ``targets`` (the
rank side of a run); ``properties`` (cases, judges, the runner); ``fuzz`` (hypothesis over a
property's cases); ``plugin`` (pytest: ``@pytest.mark.distributed``, on the harness) and ``gate``
(``dpfsdp-verify``, ``python -m dpfsdp_verify``: cli -> plan -> run -> report; ``scale``; the gate
in a torchrun job). Importing this package imports nothing heavy (no torch).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

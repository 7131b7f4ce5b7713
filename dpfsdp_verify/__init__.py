"""dpfsdp_verify: correctness and deadlock checks for differentially-private training under FSDP.

Modules: ``reference`` (single-process ground truth), ``models`` (tiny seeded models),
``harness`` (worker groups, watchdog, diagnosis, pool), ``targets`` (implementations under test),
``properties`` (checks -> verdicts), ``strategies`` (hypothesis), ``plugin`` (pytest), ``cli``.
"""

__version__ = "0.1.0"

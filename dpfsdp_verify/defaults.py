"""The run's defaults that the command line states: kept free of torch, so that
``dpfsdp-verify --help`` (which prints them) starts in a fraction of a second. The modules that
use them (``targets.base``, ``properties.contract``, the properties) import them from here."""

#: upstream opacus' FSDP ghost-clipping mode: what the suite runs unless told otherwise
DEFAULT_GRAD_SAMPLE_MODE = "ghost_fsdp"
#: a Poisson point's q and samples per rank unless the options name others: local batch 2 over a
#: DistributedSampler (opacus derives q = 1/4; expected batch 2 x world size)
POISSON_DEFAULTS = (0.25, 8)
#: mode_equivalence's built-in pair: local batches of 5 (``pair_local_batch``) run in physical
#: batches of this many samples, passes [2, 2, 1] (``--physical-batch-size``)
PHYSICAL_BATCH = 2
#: checkpoint_resume: K steps, resumed after k (options ``steps`` / ``resume_at``, ``--resume-at``)
RESUME_STEPS, RESUME_AT = 4, 2

__all__ = ["DEFAULT_GRAD_SAMPLE_MODE", "POISSON_DEFAULTS", "PHYSICAL_BATCH", "RESUME_STEPS", "RESUME_AT"]

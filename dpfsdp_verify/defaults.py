"""The run's defaults that the command line states: kept free of torch, so that
``dpfsdp-verify --help`` (which prints them) starts in a fraction of a second. The modules that
use them (``targets.base``, ``properties.engine.contract``) import them from here. A property's own
options (``Property.params``: ``physical_batch_size``, ``resume_at``...) keep their defaults in the
property; ``dpfsdp-verify list`` prints them."""

#: upstream opacus' FSDP ghost-clipping mode: what the suite runs unless told otherwise
DEFAULT_GRAD_SAMPLE_MODE = "ghost_fsdp"
#: a Poisson point's q and samples per rank unless the options name others: local batch 2 over a
#: DistributedSampler (opacus derives q = 1/4; expected batch 2 x world size)
POISSON_DEFAULTS = (0.25, 8)

__all__ = ["DEFAULT_GRAD_SAMPLE_MODE", "POISSON_DEFAULTS"]

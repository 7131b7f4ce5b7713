"""Every default of a run, in one place: the values the command line states, the Python API
falls back to, and a ``RunSpec`` starts from. Kept free of torch, so that ``dpfsdp-verify
--help`` (which prints them) starts in a fraction of a second.

``dpfsdp_verify.config.space`` reads these: it is the configuration space (each axis, its range, which
combinations are valid) and gives each axis its default from here. Nothing else in the package
writes one of these numbers (``tests/test_space.py`` greps for strays); a property's own options
(``Property.params``: ``physical_batch_size``, ``resume_at``...) keep their defaults in the
property, and ``dpfsdp-verify list`` prints them."""

from typing import Any, Dict

#: upstream opacus' FSDP ghost-clipping mode: what the suite runs unless told otherwise
DEFAULT_GRAD_SAMPLE_MODE = "ghost_fsdp"
#: a Poisson point's q and samples per rank unless the options name others: local batch 2 over a
#: DistributedSampler (opacus derives q = 1/4; expected batch 2 x world size)
POISSON_DEFAULTS = (0.25, 8)
#: the world sizes the gate runs when ``--world-sizes`` is not given (the Python API's too)
DEFAULT_WORLD_SIZES = (1, 2)
#: gloo ranks are processes on this host: more than this is a mistake on a CI runner
MAX_GLOO_WORLD_SIZE = 16
#: deadline for one distributed job, seconds (marker ``timeout=``, ini ``dpfsdp_timeout``, ``--timeout``)
DEFAULT_TIMEOUT_S = 60.0
#: the gate's wide world size (``--wide-world-size``; ``properties/engine/horizon.py``)
WIDE_WORLD_SIZE = 3
#: the gate's node world size (``--node-world-size``; ``properties/engine/horizon.py``): 4 ranks as 2
#: simulated nodes x 2 local ranks (``harness.node_env``), the smallest layout where a rank index >= 3,
#: a collective over 4 ranks and LOCAL_RANK / GROUP_RANK repeating across nodes all show
NODE_WORLD_SIZE = 4
#: the gate's long-run length in steps (``--horizon``): 18 Poisson epochs of 4 steps, past step 64 (a noise
#: schedule halving at step 64, a clip cap dropped at step 50: issue 32; each long run ~1.5x a 48-step one)
HORIZON_STEPS = 72
#: q of the long runs, and samples per rank: an expected local batch of 16, so an empty local batch
#: (0.75^64 ~ 1e-8 per rank and step) never happens -- a sampler that skips empty batches (upstream
#: opacus' does) takes every step, and the long runs judge the late steps, not that finding
HORIZON_SAMPLE_RATE, HORIZON_SAMPLES_PER_RANK = 0.25, 64
#: configurations each explored property draws and judges after its fixed cases (``--explore``;
#: docs/explore.md, "How many draws"): a number the seed fixes, not seconds, so ``--seed S`` explores
#: the same configurations on a busy and an idle machine. Until 2026-11-28 a time budget of 6 s in
#: all, which a loaded box spent on one draw (the simplest configuration, always the same)
DEFAULT_EXPLORE_DRAWS = 4
#: seconds the whole exploration phase may take before the draws not yet run are dropped (the
#: report and the exit line say so): a cap for a loaded machine, never reached on 2 idle cores
DEFAULT_EXPLORE_CAP_S = 45.0
#: an environment variable that, when set, replaces ``DEFAULT_EXPLORE_DRAWS`` as the default of
#: ``--explore`` (draws; ``0``: fixed runs unless ``--explore`` is given). The package's own test
#: suite sets it to 0 (tests/conftest.py), so a test that runs the gate judges the fixed cases it
#: counts; ``tests/fuzz/test_explore.py`` runs the default
EXPLORE_ENV = "DPFSDP_VERIFY_EXPLORE"
#: the largest world size exploration draws, on every machine (``space.explore_max_world_size``): a
#: seed draws the same configurations on 2 cores and on 64. It was 8 capped at two ranks per core, so
#: a 16-core box drew (and kept warm) groups of up to 8 ranks that a 2-core CI box never drew
EXPLORE_MAX_WORLD_SIZE = 4
#: what a ``RunSpec`` is unless a property says otherwise (``targets.base.RunSpec``'s field defaults)
SPEC_DEFAULTS: Dict[str, Any] = dict(model="mlp", model_seed=0, global_batch_size=8, batch_seed=1, data_layout="split",
                     reduction="mean", max_grad_norm=1.0, noise_multiplier=0.0, noise_seed=1234, steps=1, lr=0.5,
                     dtype="float64", sampling="fixed", seeding="same", precision="fp32")
#: ``dpfsdp-verify scale`` (docs/scale.md): nominal steps per rank, the world sizes it projects to,
#: the sampling seed of the first epoch
SCALE_STEPS, SCALE_WORLD_SIZES, SCALE_SEED = 1000, (8, 64, 512, 1024), 0

#: Added to the norm in the clip coefficient, as opacus does (``norm + 1e-6``).
CLIP_EPSILON = 1e-6
#: The largest epsilon in the denominator the checks accept (``docs/clipping.md``, "Clip forms the
#: gate accepts"): ``min(1, C/(||g|| + e))`` for any ``0 <= e <= MAX_CLIP_EPSILON`` is DP-SGD's clip
#: (a stricter one: never more than C per sample); it costs a clipped sample a relative ``e/||g||``
#: of its coefficient, at most 1e-5 at the default models' norms (all >= 1). Ten times opacus'
#: 1e-6; ``C/max(||g||, C)`` (e = 0) and opacus' form both lie inside.
MAX_CLIP_EPSILON = 1e-5

__all__ = ["DEFAULT_GRAD_SAMPLE_MODE", "POISSON_DEFAULTS", "DEFAULT_WORLD_SIZES", "MAX_GLOO_WORLD_SIZE",
           "DEFAULT_TIMEOUT_S", "WIDE_WORLD_SIZE",
           "NODE_WORLD_SIZE", "HORIZON_STEPS", "HORIZON_SAMPLE_RATE", "HORIZON_SAMPLES_PER_RANK",
           "DEFAULT_EXPLORE_DRAWS", "DEFAULT_EXPLORE_CAP_S", "EXPLORE_ENV", "EXPLORE_MAX_WORLD_SIZE", "SPEC_DEFAULTS",
           "SCALE_STEPS",
           "SCALE_WORLD_SIZES",
           "SCALE_SEED", "CLIP_EPSILON", "MAX_CLIP_EPSILON"]

"""The gate's reach beyond its matrix: a third rank, two nodes and a long run (docs/horizon.md).

The matrix runs at 1 and 2 ranks and for 1-12 steps (36 in one noise run). Two classes of bugs
cannot show there:

* **bugs keyed on the rank index** -- a noise or sampler seed from ``rank % 2`` or ``LOCAL_RANK``,
  norms all-gathered and read at ``[rank % 2]``, pass counts agreed pairwise with ``rank ^ 1``,
  replicated noise sliced at ``rank * local_rows`` (right only while every earlier shard has as
  many rows as this one) -- are right at 1 and 2 ranks. At the *wide world size*
  (``Options.wide_world_size``, the gate's default ``WIDE_WORLD_SIZE`` = 3: ``rank % 2`` repeats,
  ``rank ^ 1`` has no partner, FSDP's dim-0 shards of the 64- and 16-row tensors are uneven, and the
  harness gives each rank a node of its own, so ``LOCAL_RANK`` is 0 everywhere:
  ``harness.node_env``) each property with a ``Property.wide`` runs the few cheap cases such a bug
  hits: noise (exact checks), norms, pass-count agreement;
* **bugs from the fourth rank on or across nodes** -- noise scaled down on ranks >= 3, norms
  all-reduced once there are 4 ranks, a seed from ``LOCAL_RANK + GROUP_RANK`` (distinct on one node
  and at one rank per node, repeated across nodes of 2), a rank-2 sampler at another rate -- are
  right at 1-3 ranks. At the *node world size* (``Options.node_world_size``, the gate's default
  ``NODE_WORLD_SIZE`` = 4, run as 2 simulated nodes x 2 local ranks by ``harness.node_env``) each
  property with a ``Property.nodes`` runs one or two cases: ``noise_calibration`` one noisy Poisson
  run at lr > 0 with C between the norms (``node_spec``), every release of it judged per rank and
  step (``releases/analysis.py``); ``norm_fidelity`` its wide case (one split step); and
  ``sampling_accounting`` its divisible dataset's draws;
* **bugs that start late** -- a clip cap dropped from step 6 or 50, noise reduced from step 40 or 64, a change
  from the third Poisson epoch, a log-metric collective on rank 0 every 16 steps -- are right for
  the first steps. Each property with a long run runs one (``horizon_point``): ``Options.horizon``
  steps (the gate's default ``HORIZON_STEPS``) of DP-SGD's Poisson sampling (``horizon_spec``:
  q = 1/4, so ``HORIZON_STEPS / 4`` epochs) at the largest world size of the run (>= 2, so a
  collective only some ranks issue hangs and the harness proves it, in ~2 s), every step judged.
  A long run's job has the whole ``--timeout`` (default 60 s): a correct one takes a few seconds,
  but tens of steps on a loaded runner must not read as a hang.

What lies beyond both is stated in docs/horizon.md.
"""

from __future__ import annotations

from typing import Iterable

# the gate's wide world size (``--wide-world-size``), long-run length (``--horizon``), and the long
# runs' q and samples per rank: config/defaults.py, the one place defaults are written
from ...config.defaults import (HORIZON_SAMPLE_RATE, HORIZON_SAMPLES_PER_RANK, HORIZON_STEPS, NODE_WORLD_SIZE,
                         WIDE_WORLD_SIZE)
from ...config.space import seed_for
from ...targets import RunSpec
from ..analysis.clipfit import upper_clip
from .contract import Point


def horizon_point(point: Point, models: Iterable[str], reductions: Iterable[str], dtypes: Iterable[str]) -> bool:
    """Whether ``point`` runs its property's long run: the options ask for one, this is a 1-D
    point at the largest of the run's 1-D world sizes (>= 2) and the first point along the other
    axes: the fixed-sampling point where fixed sampling is selected (the long run brings its own
    Poisson sampling), else the first seeding's Poisson point. A long run is 1-D: a 2-D mesh point
    never runs one, and a run of meshes only (``--meshes`` without ``--world-sizes``: no 1-D world
    size) has none."""
    o = point.options
    if point.mesh or not o.world_sizes:
        return False
    first = "fixed" if o.samplings is None or "fixed" in o.samplings else "poisson"
    first_seeding = point.seeding is None or o.seedings is None or point.seeding == o.seedings[0]
    return (o.horizon > 0 and point.world_size == max(o.world_sizes) >= 2 and point.precision == "fp32"
            and point.sampling == first and first_seeding
            and point.first_of_axes(tuple(models), tuple(reductions), tuple(dtypes)))


def horizon_spec(point: Point, **fields) -> RunSpec:
    """The long run's spec at ``point``: ``Options.horizon`` steps of Poisson sampling with
    ``per_rank`` seeding (each rank its own stream, as DP-SGD under FSDP runs), the sampling seed
    from the run's seed, plus ``fields``."""
    steps = point.options.horizon
    per_epoch = int(1 / HORIZON_SAMPLE_RATE)
    base = dict(sampling="poisson", sample_rate=HORIZON_SAMPLE_RATE,
                dataset_size=HORIZON_SAMPLES_PER_RANK * point.world_size, epochs=-(-steps // per_epoch),
                steps=steps, seeding="per_rank", sampling_seed=point.seed_for("horizon", "sampling"))
    return point.spec(**{**base, **fields})


#: the noise multiplier of the gate's noisy long run (not 1: at sigma 1 a std that leaves sigma out, or
#: has it squared, is right), and its lr (> 0: the noise is judged where the parameters move)
LONG_RUN_SIGMA, LONG_RUN_LR = 2.5, 0.5


def noisy_long_spec(point: Point) -> RunSpec:
    """The gate's one noisy long run at ``point`` (a ``horizon_point``): ``horizon_spec`` with noise
    (``LONG_RUN_SIGMA``) at ``LONG_RUN_LR``, C between the dataset's two largest norms
    (``clipfit.upper_clip``: batches without a clipped sample, where a norm-dependent noise scale
    shows), its sampling and noise seeds from the run's seed alone -- not the property's -- so that
    every property asking for it asks for the same run: ``deadlock_free`` (a collective some ranks
    skip late, a sampler that changes after some epochs) and ``noise_calibration`` (every step's
    noise, from the first step on) share one job (``runner.run_cases``' ``shared``)."""
    seed = point.options.seed
    return upper_clip(horizon_spec(point, noise_multiplier=LONG_RUN_SIGMA, lr=LONG_RUN_LR,
                                   sampling_seed=seed_for(seed, "horizon", "sampling"),
                                   noise_seed=seed_for(seed, "horizon", "noise")), planning=point.planning)


#: the node run's steps (one Poisson epoch at q = 1/4) and learning rate (> 0: the noise is judged
#: where the parameters move, as users train)
NODE_STEPS, NODE_LR = 4, 0.5


def node_spec(point: Point, **fields) -> RunSpec:
    """The node run's spec at ``point`` (the node world size): ``NODE_STEPS`` steps of Poisson
    sampling at the long runs' q and samples per rank (an expected local batch of 16: an empty one,
    which upstream's sampler skips, has probability ~1e-8 per rank and step), ``per_rank`` seeding,
    lr ``NODE_LR``, plus ``fields``."""
    base = dict(sampling="poisson", sample_rate=HORIZON_SAMPLE_RATE,
                dataset_size=HORIZON_SAMPLES_PER_RANK * point.world_size,
                epochs=-(-NODE_STEPS // int(1 / HORIZON_SAMPLE_RATE)), steps=NODE_STEPS, seeding="per_rank",
                sampling_seed=point.seed_for("nodes", "sampling"), lr=NODE_LR)
    return point.spec(**{**base, **fields})


def horizon_labels(spec: RunSpec) -> dict:
    """The config key that tells a long run's verdict from the matrix's: its length in steps."""
    return {"horizon": spec.steps}


__all__ = ["WIDE_WORLD_SIZE", "NODE_WORLD_SIZE", "NODE_STEPS", "NODE_LR", "node_spec",
           "HORIZON_STEPS", "HORIZON_SAMPLE_RATE", "HORIZON_SAMPLES_PER_RANK", "horizon_point",
           "horizon_spec", "horizon_labels", "LONG_RUN_SIGMA", "LONG_RUN_LR", "noisy_long_spec"]

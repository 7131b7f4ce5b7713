"""Hypothesis strategies for the configurations FSDP2 + DP gets wrong (shard shapes, world sizes,
batch sizes, per-rank batch splits, Poisson sampling): the public name of
``dpfsdp_verify.fuzz.strategies``, where the fuzz recipes draw from them::

    from hypothesis import given
    from dpfsdp_verify import strategies as dps

    @given(dps.run_specs(world_size=2, models=("mlp",)))
    def test_norms(spec): ...
"""

from .fuzz.strategies import *  # noqa: F401,F403
from .fuzz.strategies import __all__  # noqa: F401

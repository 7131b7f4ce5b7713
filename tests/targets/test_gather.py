"""``targets.util.full_tensors`` gathers every FSDP2 shard in one collective and must equal
DTensor's own ``full_tensor`` for every shard layout: dim 0 smaller than, equal to, and not
divisible by the world size (empty and short trailing shards). Runs on the plugin itself."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from dpfsdp_verify.targets.util import full_tensor, full_tensors


@pytest.mark.distributed(world_size=3, timeout=60)
def test_batched_gather_equals_full_tensor_on_uneven_shards(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1), nn.Linear(1, 3), nn.Linear(3, 5), nn.Linear(5, 7), nn.LayerNorm(7))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    params = list(model.parameters())
    if rank == world_size - 1:  # torch.chunk layout: trailing ranks hold the short or empty shards
        assert any(p.to_local().shape[0] == 0 for p in params), "the last rank must hold an empty shard"
    one_by_one = [full_tensor(p) for p in params]
    batched = full_tensors(params)
    assert len(batched) == len(params)
    for a, b, p in zip(batched, one_by_one, params):
        assert a.shape == p.shape and a.dtype == torch.float64
        assert torch.equal(a, b)

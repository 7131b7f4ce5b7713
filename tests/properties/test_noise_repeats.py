"""Repeated noise (``analysis/noise_exact.repeated_noise``) is found as a ``Repeat`` finding and worded
by ``wording/noise_repeats``: each kind of repetition on synthetic noise, its copy plain and negated."""
import pytest
import torch

from dpfsdp_verify.properties.noise.exact import repeated_noise
from dpfsdp_verify.properties.noise.repeats import NEGATED_NOTE, repeat_message, repeat_words


def _noise(runs, steps, shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[{n: torch.randn(*s, generator=g, dtype=torch.float64) for n, s in shapes.items()}
             for _ in range(steps)] for _ in range(runs)]


def _tiled(sign):
    n = _noise(1, 2, {"w": (64,)})
    n[0][0]["w"][32:40] = sign * n[0][0]["w"][0:8]
    return n, ["w"], 1, None


def _one_buffer(sign):
    n = _noise(1, 2, {"a": (16,), "b": (16,)})
    n[0][1]["b"][:] = sign * n[0][1]["a"]
    return n, ["a", "b"], 1, None


def _lag3(sign):
    """A pool of 3 noise vectors reused in turn: steps 3 and 4 repeat steps 0 and 1 (step 2 has no partner
    within 5 steps); a single repeat is worded as noise reused for some releases only (test_review_r6.py)."""
    n = _noise(1, 5, {"w": (4, 8)})
    n[0][3]["w"][:] = sign * n[0][0]["w"]
    n[0][4]["w"][:] = sign * n[0][1]["w"]
    return n, ["w"], 1, None


def _seed_plus_step(sign):
    n = _noise(2, 3, {"w": (16,)})
    n[1][0]["w"][:] = sign * n[0][1]["w"]
    return n, ["w"], 1, [5, 6]


def _ranks_alike(sign):
    n = _noise(1, 1, {"w": (4, 8)})
    n[0][0]["w"][2:4] = sign * n[0][0]["w"][0:2]
    return n, ["w"], 2, None


def _shard_offset(sign):
    n = _noise(1, 1, {"w": (6, 4)})
    n[0][0]["w"][3] = sign * n[0][0]["w"][1]
    return n, ["w"], 2, None


def _seed_plus_rank(sign):
    n = _noise(2, 1, {"w": (4, 8)})
    n[1][0]["w"][0:2] = sign * n[0][0]["w"][2:4]
    return n, ["w"], 2, [5, 6]


CASES = {
    "tiled": (_tiled, "the noise of 'w' repeats within itself at step 0 (offsets 0 and 32, 32 apart)",
              "a short noise buffer tiled over the tensor", None),
    "one_buffer": (_one_buffer, "'a' and 'b' get the same noise values at step 1 (run 0)",
                   "different tensors must get independent noise", "get the same noise values, one negated, at"),
    "across_steps": (_lag3, "the noise on 'w' is identical at steps 0 and 3 (lag 3, run 0)",
                     "a pool of 3 noise vectors reused in turn", "the noise on 'w' is negated at steps 0 and 3"),
    "seed_plus_step": (_seed_plus_step, "the noise on 'w' at step 1 of run 0 (noise seed 5) is identical to the "
                       "noise at step 0 of run 1 (noise seed 6)", "seeded from noise_seed + step", "is negated to"),
    "ranks_seeded_alike": (_ranks_alike, "rank 0's and rank 1's shards of 'w' get the same noise (run 0, step 0)",
                           "ranks seeded alike", "get the same noise, negated (run 0"),
    "shard_offset": (_shard_offset, "rank 1's shard of 'w' carries, from its row 0, the noise rank 0's shard "
                     "carries from its row 1 (run 0, step 0)", "a shard offset", None),
    "rank_seed_plus_rank": (_seed_plus_rank, "rank 1's shard of 'w' at step 0 of run 0 (noise seed 5) carries the "
                            "noise rank 0's shard carries at step 0 of run 1 (noise seed 6)",
                            "(e.g. a generator seeded noise_seed + rank: rank 1 of seed 5 is rank 0 of seed 6)", None),
}


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("sign", [1, -1])
def test_each_repeat_is_found_and_worded(kind, sign):
    make, what, cause, negated_what = CASES[kind]
    noise, names, ws, seeds = make(sign)
    found = repeated_noise(noise, names, ws, 1e-6, seeds)
    assert found is not None and found.kind == kind and found.negated == (sign < 0), found
    said, why = repeat_words(found)
    assert cause in why
    assert why.endswith(NEGATED_NOTE) == (sign < 0)
    if sign > 0 or negated_what is None:
        assert what in said, said
    else:
        assert negated_what in said and what not in said, said
    message = repeat_message(found, "at world_size=2")
    assert message.startswith(f"PRIVACY VIOLATION: {said} at world_size=2: {why}. Noise must be fresh")


def test_fresh_noise_repeats_nothing():
    noise, names, ws, seeds = _lag3(1)
    noise[0][3]["w"][:] = torch.randn(4, 8, dtype=torch.float64)
    noise[0][4]["w"][:] = torch.randn(4, 8, dtype=torch.float64)
    assert repeated_noise(noise, names, ws, 1e-6, seeds) is None

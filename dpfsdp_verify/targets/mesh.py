"""2-D device meshes: which ranks hold which samples and which parameter shards, and the
reference's aggregation rules on them. A ``RunSpec``'s layout (``RunSpec.layout``), so it sits
with the targets; the properties judge with its rules.

A 2-D run names its mesh ``KIND:AxB`` (``RunSpec.mesh``, the gate's ``--meshes``). Rank
``r = i * B + j`` sits at row ``i`` (dim 0) and column ``j`` (dim 1), torch's own layout
(``init_device_mesh`` fills a mesh in row-major order):

* ``hsdp:RxS`` -- HSDP, ``mesh_dim_names=("replicate", "shard")``: each parameter sharded over the
  S ranks of a row, the R rows replicas of each other. Data parallelism spans *both* dims (every
  rank trains on its own samples: FSDP and its replicas are all data parallel), so the
  data-parallel degree is R*S, the world size.
* ``tp:DxT`` -- data x tensor parallel, ``mesh_dim_names=("data", "tensor")``: each row is one
  data replica whose T ranks are tensor-parallel peers (the same samples, each holding a slice of
  the TP-sharded parameters); the data-parallel degree is D, not the world size.

What the reference says a correct implementation computes (``docs/meshes.md``):

* samples: the global batch is split over the data-parallel ranks (``data_rank``); TP peers see
  the same samples;
* per-sample norm: over the *whole* parameter vector -- the squares of the TP shards of a sample
  summed over its TP peers, a parameter every TP peer holds whole (not TP-sharded) counted once --
  and never summed across data replicas (those hold *other* samples: ``world_summed_norms`` is
  what summing across them gives; ``split_norm_sq`` splits a norm into its two parts);
* the clipped sum over the global batch and noise of std sigma*C per coordinate, divided by the
  global expected batch B (``RunSpec.divisor``), whatever the mesh;
* the replicas of one parameter shard (``replica_groups``) hold the same parameters, so they must
  add the *same* noise and stay bit-identical step after step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..lazy import torch

#: mesh kind -> (dim names, what the kind means)
MESH_KINDS: Dict[str, Tuple[Tuple[str, str], str]] = {
    "hsdp": (("replicate", "shard"), "data-replicas x FSDP shard"),
    "tp": (("data", "tensor"), "data x tensor parallel"),
}
_SYNTAX = re.compile(r"^([a-z]+):(\d+)x(\d+)$")


class MeshError(ValueError):
    """A mesh name that is not ``KIND:AxB`` with a known kind and both sides >= 1."""


@dataclass(frozen=True)
class Mesh:
    """A 2-D mesh layout (module docstring); built from its name with ``Mesh.parse``."""

    kind: str
    shape: Tuple[int, int]

    @classmethod
    def parse(cls, text: str) -> "Mesh":
        m = _SYNTAX.match(text.strip())
        if not m:
            raise MeshError(f"mesh {text!r} is not KIND:AxB (e.g. hsdp:2x2 or tp:2x2)")
        kind, a, b = m.group(1), int(m.group(2)), int(m.group(3))
        if kind not in MESH_KINDS:
            raise MeshError(f"unknown mesh kind {kind!r} in {text!r}: choose from {', '.join(MESH_KINDS)}")
        if a < 1 or b < 1:
            raise MeshError(f"mesh {text!r}: both sides must be >= 1")
        return cls(kind, (a, b))

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.shape[0]}x{self.shape[1]}"

    @property
    def dim_names(self) -> Tuple[str, str]:
        return MESH_KINDS[self.kind][0]

    @property
    def world_size(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def tensor_parallel(self) -> bool:
        return self.kind == "tp"

    @property
    def data_degree(self) -> int:
        """How many ranks hold disjoint samples: R*S under HSDP, D under data x TP."""
        return self.shape[0] if self.tensor_parallel else self.world_size

    def data_rank(self, rank: int) -> int:
        """Which slice of the data rank ``rank`` trains on (``0..data_degree-1``)."""
        return rank // self.shape[1] if self.tensor_parallel else rank

    def row(self, rank: int) -> int:
        """The replica (HSDP) or data replica (TP) rank ``rank`` belongs to: its row."""
        return rank // self.shape[1]

    def column(self, rank: int) -> int:
        """Its FSDP shard (HSDP) or tensor-parallel slice (TP): its column."""
        return rank % self.shape[1]

    def replica_groups(self) -> List[List[int]]:
        """Ranks holding the same parameter shard, one list per shard (a column of the mesh):
        they must hold bit-identical parameters and add identical noise."""
        a, b = self.shape
        return [[i * b + j for i in range(a)] for j in range(b)]

    def tensor_groups(self) -> List[List[int]]:
        """Tensor-parallel peers (a row under ``tp``): the same samples, one whole model between them."""
        a, b = self.shape
        return [[i * b + j for j in range(b)] for i in range(a)] if self.tensor_parallel else [[r]
                                                                                               for r in range(a * b)]

    def data_ranks(self) -> List[int]:
        """One rank per data slice (the first of each TP group): whose reports make up the batch."""
        return [g[0] for g in self.tensor_groups()]

    def build(self, device_type: str = "cpu"):
        """The ``DeviceMesh`` (``init_device_mesh``); a collective: every rank calls it alike."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.dim_names)


def parse_optional(text: str) -> Optional[Mesh]:
    """``Mesh.parse`` for a non-empty name, ``None`` for ``""`` (a 1-D run)."""
    return Mesh.parse(text) if text else None


def rank_samples(mesh: Mesh, batch_size: int, rank: int) -> List[int]:
    """The global indices rank ``rank`` trains on out of a batch of ``batch_size``: a
    ``DistributedSampler`` over the data-parallel ranks (strided by the data degree)."""
    return list(range(mesh.data_rank(rank), batch_size, mesh.data_degree))


def split_norm_sq(grads: Dict[str, torch.Tensor], sharded: Sequence[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(sharded_sq, whole_sq)``, each ``[B]``: every sample's squared gradient norm over the
    tensor-parallel-sharded parameters (``sharded``: their names) and over the parameters each TP
    peer holds whole, from per-sample gradients ``{name: [B, *shape]}``. The true squared norm is
    their sum: TP shards' squares add up over the peers, a whole parameter counts once."""
    n = len(next(iter(grads.values())))
    zero = torch.zeros(n, dtype=torch.float64)
    sq = {name: g.to(torch.float64).pow(2).reshape(n, -1).sum(1) for name, g in grads.items()}
    return (sum((v for k, v in sq.items() if k in sharded), zero),
            sum((v for k, v in sq.items() if k not in sharded), zero))


def replica_positions(mesh: Mesh, rows: Sequence[Sequence[int]]) -> List[List[int]]:
    """For each position j of a local batch, the samples at position j on every data replica
    (``rows[r]``: rank r's sample indices): what a sum over the whole world adds up per position."""
    data = mesh.data_ranks()
    return [[rows[r][j] for r in data] for j in range(len(rows[data[0]]))]


def world_summed_norms(mesh: Mesh, sharded_sq: torch.Tensor, whole_sq: torch.Tensor,
                       rows: Sequence[Sequence[int]], whole_from: str = "own",
                       sharded_times: int = 1) -> List[torch.Tensor]:
    """Per rank, ``[local batch]``: the norms a rank clips its samples with when the squared norms of
    the TP-sharded parameters are all-reduced over *every* rank, data replicas included (the wrong
    rule, ``sample_mixing``): at each position, the sharded squares of the samples at that position
    on all replicas, plus the whole parameters' squares of the rank's ``own`` sample, or of global
    ``rank0``'s sample alone (opacus' ``merge_flag=False`` parameters count on rank 0 only).
    ``sharded_times``: each TP peer contributes the *whole* TP-sharded layers' squares instead of
    its shard's (hooks that see the all-gathered activations), counted that many times."""
    positions = replica_positions(mesh, rows)
    mixed = torch.stack([sharded_sq[p].sum() for p in positions]) * sharded_times
    first = rows[mesh.data_ranks()[0]]
    return [(mixed + whole_sq[list(first if whole_from == "rank0" else own)]).sqrt() for own in rows]


__all__ = ["Mesh", "MeshError", "MESH_KINDS", "parse_optional", "rank_samples", "split_norm_sq", "replica_positions",
           "world_summed_norms"]

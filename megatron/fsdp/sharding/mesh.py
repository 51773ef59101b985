"""The data-parallel mesh: an inner axis (``dp_shard``) and an optional outer axis (``dp_outer``).

The inner axis is made of contiguous ranks, so it maps onto one node or NVLink
domain; the outer axis connects rank ``i`` of every domain. With ``N`` ranks
per domain and ``M`` domains, global rank ``j * N + i`` is inner rank ``i`` of
domain ``j``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch.distributed as dist


@dataclasses.dataclass(frozen=True, eq=False)
class DataParallelMesh:
    """Process groups of the two axes; ``outer_group=None`` means a flat mesh."""

    inner_group: Any = None
    outer_group: Optional[Any] = None

    @property
    def has_outer(self) -> bool:
        return self.outer_group is not None


def build_mesh(outer: int, ranks: Optional[Sequence[int]] = None) -> DataParallelMesh:
    """Split ``ranks`` (default: the whole world) into ``outer`` domains of contiguous ranks.

    A collective call: every rank of the default group must call it with the
    same arguments (``torch.distributed.new_group`` requires that), including
    ranks outside ``ranks``; those get ``None`` groups.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs torch.distributed to be initialised")
    ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
    if outer < 1 or len(ranks) % outer:
        raise ValueError(f"outer={outer} does not divide the {len(ranks)} data-parallel ranks; "
                         f"choose a divisor of {len(ranks)}")
    inner = len(ranks) // outer
    me = dist.get_rank()
    inner_group = outer_group = None
    for j in range(outer):
        members = ranks[j * inner:(j + 1) * inner]
        group = dist.new_group(members)
        if me in members:
            inner_group = group
    for i in range(inner):
        members = ranks[i::inner]
        group = dist.new_group(members)
        if me in members:
            outer_group = group
    return DataParallelMesh(inner_group, outer_group)

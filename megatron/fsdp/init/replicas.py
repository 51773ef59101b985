"""Make every replica equal to rank 0's at wrap time, as DDP does.

Why: ``fully_shard`` copies each rank's own parameters into its buffers. Under a level
that keeps replicas (``no_shard``, and on any level the frozen parameters and the
compute weights used before the first step), a model built differently on one rank
(another seed, a rank-dependent init) would train with diverging replicas forever,
silently: the wrap-time check compares names, shapes and dtypes only. So, like
``torch.nn.parallel.DistributedDataParallel``, every parameter is overwritten with the
values of rank 0 of each data-parallel axis before sharding: rank ``(0, 0)`` of the
mesh is the single truth for dense parameters, and rank ``(0, 0)`` of the expert mesh
for each expert instance. Module buffers are not touched (they are not sharded, and
under expert parallelism the dense axes span ranks that hold different experts).

Cost: one broadcast of each unit's parameters per axis of more than one rank, once, at
wrap time (recorded in the ledger as ``broadcast`` with tag ``replicas``).
Parameters still on the ``meta`` device are skipped: they have no values yet.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..collectives.comm import CommAxis

_BUCKET_BYTES = 64 << 20  # broadcast in flat buckets of at most this size


@torch.no_grad()
def broadcast_from_rank0(params: Sequence[Tuple[str, torch.nn.Parameter]], axes: Sequence[CommAxis]) -> None:
    """Overwrite ``params`` with their values on rank 0 of each of ``axes`` (inner first, then outer)."""
    axes = [axis for axis in axes if axis.size > 1]
    tensors = [p.data for _, p in params if p.device.type != "meta"]
    if not axes or not tensors:
        return
    for bucket in _buckets(tensors):
        flat = _flatten_dense_tensors(bucket)
        for axis in axes:
            axis.broadcast(flat, tag="replicas").wait()
        for t, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(value)


def _buckets(tensors: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """Consecutive runs of one dtype and at most ``_BUCKET_BYTES`` (same split on every rank)."""
    out: List[List[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not out or out[-1][0].dtype != t.dtype or size + nbytes > _BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out

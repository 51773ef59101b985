"""How far the engine's schedule runs ahead, from Megatron's ``DistributedDataParallelConfig``.

Megatron-FSDP sizes its prefetch and its reduce-scatter queue by elements:
``suggested_communication_unit_size`` (``S``) is the reduce-scatter queue's capacity and
``S // 2`` the all-gather prefetch size, and its default ``S`` is twice the elements of
one FSDP unit, i.e. one unit gathered ahead and two reductions queued. The engine counts
in units (``megatron.fsdp.Overlap``), so ``S`` maps to ``(S // 2) // unit`` units of
prefetch in each direction and ``S // unit`` reductions in flight, ``unit`` being the
mean element count of the model's unit modules. Unset, the engine's defaults apply:
one unit prefetched each way, as Megatron's default gives, and one reduction in flight
where Megatron's default queues two (the engine's default: a second
reduction in flight keeps one more unit's gradient alive through the backward's peak;
pass ``suggested_communication_unit_size`` for Megatron's queue).
"""

from __future__ import annotations

from typing import Dict, Iterable, Type

import torch

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig


def overlap_arguments(ddp_config: DistributedDataParallelConfig, module: torch.nn.Module,
                      unit_classes: Iterable[Type[torch.nn.Module]]) -> Dict[str, int]:
    """``megatron.fsdp.Overlap`` fields (``forward_prefetch``, ``backward_prefetch``, ``reductions_in_flight``)
    for ``fully_shard(overlap=Overlap(**fields))``."""
    size = getattr(ddp_config, "suggested_communication_unit_size", None)
    if size is None:
        return {}
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"suggested_communication_unit_size must be a number of elements >= 0, got {size!r}")
    classes = tuple(unit_classes)
    units = [m for m in module.modules() if isinstance(m, classes)]
    if not units:
        return {}
    unit = max(1, sum(p.numel() for m in units for p in m.parameters()) // len(units))
    prefetch = (size // 2) // unit
    return dict(forward_prefetch=prefetch, backward_prefetch=prefetch, reductions_in_flight=size // unit)

"""Megatron-Core adapter for the ``megatron.fsdp`` engine (see docs/adapter.md).

Importing this package imports Megatron-Core; the engine itself never does.
"""

from megatron.fsdp.library_warnings import silence_unactionable_warnings

silence_unactionable_warnings()

from .data_parallel import DEFAULT_UNIT_CLASSES, FullyShardedDataParallel, FullyShardedDataParallelConfig
from .distributed_index import FSDPDistributedIndex
from .finalize import finalize_model_grads
from .meta_build import build_on_meta_device
from .megatron_optimizer import FullyShardedMegatronOptimizer, get_fsdp_optimizer
from .pipeline_hooks import configure_schedule_hooks

__all__ = [
    "DEFAULT_UNIT_CLASSES", "FSDPDistributedIndex", "FullyShardedDataParallel", "FullyShardedDataParallelConfig",
    "FullyShardedMegatronOptimizer", "build_on_meta_device",
    "configure_schedule_hooks", "finalize_model_grads", "get_fsdp_optimizer",
]

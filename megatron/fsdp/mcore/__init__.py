"""Megatron-Core adapter for the ``megatron.fsdp`` engine (see docs/adapter.md).

Importing this package imports Megatron-Core; the engine itself never does.
"""

import warnings

# Megatron-Core announces on import that Transformer Engine and Apex are absent and
# that it falls back to torch implementations. A user can do nothing about it on a
# machine without them (the fallback is what CPU mode runs), so it is silenced here,
# once, for every module of the adapter.
warnings.filterwarnings("ignore", message=r".*Transformer Engine and Apex are not installed.*")

from .data_parallel import DEFAULT_UNIT_CLASSES, FullyShardedDataParallel
from .distributed_index import FSDPDistributedIndex
from .finalize import finalize_model_grads
from .optimizer import FullyShardedMegatronOptimizer, get_fsdp_optimizer
from .schedule import configure_schedule_hooks

__all__ = [
    "DEFAULT_UNIT_CLASSES", "FSDPDistributedIndex", "FullyShardedDataParallel", "FullyShardedMegatronOptimizer",
    "configure_schedule_hooks", "finalize_model_grads", "get_fsdp_optimizer",
]

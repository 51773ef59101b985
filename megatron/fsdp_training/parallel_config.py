"""The run's parallel layout as one typed view (``ParallelConfig``), read once from the validated arguments.

Megatron-LM's flags of the same names: the model-parallel sizes Megatron-Core's ``parallel_state`` is built
from, the data-parallel size they leave, and the data-parallel implementation with its sharding strategies
(``arguments/parallelism_flags.py`` and ``arguments/megatron_fsdp_flags.py`` check them).
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Parallel sizes, the data-parallel implementation and its sharding strategies."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: Optional[int]
    context_parallel_size: int
    expert_model_parallel_size: int
    expert_tensor_parallel_size: Optional[int]
    sequence_parallel: bool
    data_parallel_size: int
    use_megatron_fsdp: bool  # this project's engine; else Megatron-Core's DDP (the baseline)
    use_distributed_optimizer: bool
    num_distributed_optimizer_instances: int
    data_parallel_sharding_strategy: str
    outer_dp_sharding_strategy: str
    expert_data_parallel_sharding_strategy: Optional[str]
    expert_outer_dp_sharding_strategy: Optional[str]
    expert_num_distributed_optimizer_instances: Optional[int]
    distributed_timeout_minutes: int
    disable_gloo_process_groups: bool

    @classmethod
    def from_args(cls, args) -> "ParallelConfig":
        """Mapper: the parallel flags, after validation (which fills the derived sizes)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

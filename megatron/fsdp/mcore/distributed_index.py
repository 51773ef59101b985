"""``FSDPDistributedIndex``: the process groups the adapter needs, named by the role they play.

=====================  =========================================================  ==================
role                   Megatron-Core group                                        used for
=====================  =========================================================  ==================
``dp_shard`` (inner)   data parallel with context parallel; the *partial* group    engine inner axis
                       (inside one optimizer instance) when there are several
``dp_outer`` (outer)   across distributed-optimizer instances (None with one)      engine outer axis
``tp``                 tensor model parallel                                        SP norm grads
``mp``                 model parallel (tensor x pipeline)                           global grad norm
``embd``               first and last pipeline stage (tied embedding/output)       tied weight grads
=====================  =========================================================  ==================

Context parallel ranks see different tokens of the same samples and hold the
same parameters, so they are folded into the inner axis: their gradients are
summed and averaged together with data-parallel ones, exactly like
Megatron-Core's own DDP.

Example, 8 ranks, TP 2 x PP 2 x DP 2 (Megatron's default order ``tp-cp-ep-dp-pp``,
tensor parallel fastest):

* ``tp``: [0, 1] [2, 3] [4, 5] [6, 7]
* ``dp_shard``: [0, 2] [1, 3] [4, 6] [5, 7]
* pipeline: [0, 4] [1, 5] [2, 6] [3, 7]; ``mp`` (tp x pp): [0, 1, 4, 5] [2, 3, 6, 7]
* ``embd``: [0, 4] [1, 5] [2, 6] [3, 7] (first and last stage of each pipeline)
* with ``num_distributed_optimizer_instances=2`` on DP 4 (TP 2 x DP 4 = 8 ranks):
  ``dp_shard`` [0, 2] [4, 6] [1, 3] [5, 7] and ``dp_outer`` [0, 4] [2, 6] [1, 5] [3, 7].
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch.distributed as dist

from megatron.fsdp import DataParallelMesh


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


@dataclasses.dataclass(frozen=True, eq=False)
class FSDPDistributedIndex:
    dp_shard: Any
    dp_outer: Optional[Any]
    tp: Optional[Any]
    mp: Optional[Any]
    embd: Optional[Any]
    pp: Optional[Any] = None

    @property
    def mesh(self) -> DataParallelMesh:
        return DataParallelMesh(self.dp_shard, self.dp_outer)

    @property
    def tp_size(self) -> int:
        return _size(self.tp)

    @property
    def tp_rank(self) -> int:
        return 0 if self.tp is None else dist.get_rank(self.tp)

    @classmethod
    def from_parallel_state(cls, num_distributed_optimizer_instances: int = 1) -> "FSDPDistributedIndex":
        from megatron.core import parallel_state as ps

        several = num_distributed_optimizer_instances > 1
        dp_shard = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=several)
        dp_outer = ps.get_inter_distributed_optimizer_instance_group() if several else None
        if several and _size(dp_outer) != num_distributed_optimizer_instances:
            raise ValueError(
                f"num_distributed_optimizer_instances={num_distributed_optimizer_instances} but the "
                f"inter-instance group has {_size(dp_outer)} ranks; pass the same value to "
                "parallel_state.initialize_model_parallel(num_distributed_optimizer_instances=...)")
        return cls(
            dp_shard=dp_shard,
            dp_outer=dp_outer,
            tp=ps.get_tensor_model_parallel_group(),
            mp=ps.get_model_parallel_group(),
            embd=ps.get_embedding_group(check_initialized=False),
            pp=ps.get_pipeline_model_parallel_group(),
        )

    @classmethod
    def from_pg_collection(cls, pg_collection, num_distributed_optimizer_instances: int = 1) -> "FSDPDistributedIndex":
        several = num_distributed_optimizer_instances > 1
        dp_shard = getattr(pg_collection, "intra_dp_cp" if several else "dp_cp")
        return cls(
            dp_shard=dp_shard,
            dp_outer=getattr(pg_collection, "inter_dist_opt", None) if several else None,
            tp=getattr(pg_collection, "tp", None),
            mp=getattr(pg_collection, "mp", None),
            embd=getattr(pg_collection, "embd", None),
            pp=getattr(pg_collection, "pp", None),
        )

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
``pos_embd``           the stages holding learned position embeddings (first)      position emb. grads
``expt_dp_shard``      expert data parallel (partial group with several            expert inner axis
                       expert optimizer instances)
``expt_dp_outer``      across expert optimizer instances (None with one)           expert outer axis
``expt_mp``            expert tensor x expert model x pipeline parallel            expert grad norm
=====================  =========================================================  ==================

Expert parameters are replicated over fewer ranks than dense ones: with EP
expert-parallel ranks, ``expt_dp`` has ``world / (EP x expert TP x PP)`` ranks.
Their gradients are summed over ``expt_dp`` and scaled by ``1 / dp_cp_size``
(the dense data-parallel size), because the token dispatcher has already summed
each expert's gradient over the EP ranks whose tokens it saw.

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

from megatron.fsdp import DataParallelMesh, build_mesh


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
    pos_embd: Optional[Any] = None
    dp_cp_size: int = 1
    expt_dp_shard: Optional[Any] = None
    expt_dp_outer: Optional[Any] = None
    expt_mp: Optional[Any] = None

    @property
    def mesh(self) -> DataParallelMesh:
        return DataParallelMesh(self.dp_shard, self.dp_outer)

    @property
    def expert_mesh(self) -> DataParallelMesh:
        return DataParallelMesh(self.expt_dp_shard, self.expt_dp_outer)

    @property
    def tp_size(self) -> int:
        return _size(self.tp)

    @property
    def tp_rank(self) -> int:
        return 0 if self.tp is None else dist.get_rank(self.tp)

    @classmethod
    def from_parallel_state(cls, num_distributed_optimizer_instances: int = 1,
                            expert_instances: Optional[int] = None) -> "FSDPDistributedIndex":
        from megatron.core import parallel_state as ps

        several = num_distributed_optimizer_instances > 1
        expert_instances = expert_instances or num_distributed_optimizer_instances
        if expert_instances == num_distributed_optimizer_instances:
            expt_dp_shard = ps.get_expert_data_parallel_group(partial_expert_data_parallel=several)
            expt_dp_outer = ps.get_inter_distributed_optimizer_instance_group() if several else None
        else:
            expt_dp_shard, expt_dp_outer = _split_group(ps.get_expert_data_parallel_group(), expert_instances)
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
            pos_embd=ps.get_position_embedding_group(check_initialized=False),
            dp_cp_size=_size(ps.get_data_parallel_group(with_context_parallel=True)),
            expt_dp_shard=expt_dp_shard,
            expt_dp_outer=expt_dp_outer,
            expt_mp=ps.get_expert_tensor_model_pipeline_parallel_group(check_initialized=False),
        )

    @classmethod
    def from_pg_collection(cls, pg_collection, num_distributed_optimizer_instances: int = 1,
                           expert_instances: Optional[int] = None) -> "FSDPDistributedIndex":
        from megatron.core import parallel_state as ps

        several = num_distributed_optimizer_instances > 1
        dp_shard = getattr(pg_collection, "intra_dp_cp" if several else "dp_cp")
        expert_instances = expert_instances or num_distributed_optimizer_instances
        expt_dp = getattr(pg_collection, "expt_dp", None)
        if expert_instances == num_distributed_optimizer_instances:
            expt_dp_shard = getattr(pg_collection, "intra_expt_dp", None) if several else expt_dp
            expt_dp_outer = getattr(pg_collection, "inter_dist_opt", None) if several else None
        else:
            expt_dp_shard, expt_dp_outer = _split_group(expt_dp, expert_instances)
        return cls(
            dp_shard=dp_shard,
            dp_outer=getattr(pg_collection, "inter_dist_opt", None) if several else None,
            tp=getattr(pg_collection, "tp", None),
            mp=getattr(pg_collection, "mp", None),
            embd=getattr(pg_collection, "embd", None),
            pp=getattr(pg_collection, "pp", None),
            pos_embd=getattr(pg_collection, "pos_embd", None),
            dp_cp_size=_size(getattr(pg_collection, "dp_cp", None) or dp_shard),
            expt_dp_shard=expt_dp_shard,
            expt_dp_outer=expt_dp_outer,
            expt_mp=ps.get_expert_tensor_model_pipeline_parallel_group(check_initialized=False),
        )


def _split_group(group, instances: int):
    """Split the expert data-parallel group into ``instances`` domains of contiguous ranks (inner, outer).

    Used when the expert section has its own instance count (parallel_state builds
    the partial expert groups with the dense count only). A collective over the
    whole world: every rank learns every expert data-parallel group, then all
    create the same groups in the same order (``new_group``'s requirement; every
    rank wraps the same number of model chunks, so the calls match). The groups
    live as long as the model that holds them.
    """
    ranks = dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]
    if len(ranks) % instances:
        raise ValueError(f"expert_num_distributed_optimizer_instances={instances} does not divide the expert "
                         f"data-parallel size {len(ranks)}; choose a divisor of {len(ranks)}")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ranks)
    groups = sorted({tuple(r) for r in everyone})
    meshes = [build_mesh(outer=instances, ranks=list(g)) for g in groups]
    mesh = next(m for g, m in zip(groups, meshes) if dist.get_rank() in g)
    return mesh.inner_group, mesh.outer_group

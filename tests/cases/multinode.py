"""Where the axes of a two-axis mesh fall when ranks are numbered node by node (torchrun's numbering)."""

from __future__ import annotations

import torch.distributed as dist


def hsdp_rank_layout(ctx, ranks_per_node: int, instances: int = 2, ep: int = 1) -> dict:
    """The adapter's dense and expert axes under ``--num-distributed-optimizer-instances instances``,
    as global ranks, and the node (``rank // ranks_per_node``) of each."""
    from megatron.fsdp.mcore.distributed_index import FSDPDistributedIndex
    from megatron.fsdp_training.testing.gpt import Topology, parallel

    with parallel(ctx, Topology(instances=instances, ep=ep)):
        index = FSDPDistributedIndex.from_parallel_state(instances, instances)

        def ranks(group):
            return dist.get_process_group_ranks(group)
        axes = {"dp_shard": ranks(index.mesh.inner_group), "dp_outer": ranks(index.mesh.outer_group),
                "expt_dp_shard": ranks(index.expert_mesh.inner_group),
                "expt_dp_outer": ranks(index.expert_mesh.outer_group)}
    return {name: [(r, r // ranks_per_node) for r in group] for name, group in axes.items()}

"""The MoE parity matrix of tests/mcore/test_moe.py (also printed whole by tools/moe_report.py)."""

from megatron.fsdp_training.testing.gpt import Topology


def moe_topology(dispatcher: str, ep: int, **kw) -> Topology:
    """The tiny GPT with 4 experts per MoE layer, ``dispatcher`` tokens, ``ep``-way expert parallel."""
    return Topology(moe=dispatcher, ep=ep, **kw)


EP_CASES = [  # (dispatcher, EP, level of both sections)
    # alltoall at EP 1 and EP 2 runs in MIXED_CASES below (same dispatcher and EP, ZeRO-2 / ZeRO-3 dense):
    # with these, both dispatchers meet EP 1, 2 and 4, and every level meets an expert section.
    ("allgather", 1, "optim"),
    ("allgather", 2, "optim_grads"),
    ("alltoall", 4, "no_shard"),
    ("allgather", 4, "optim_grads_params"),
]

# name -> (topology, dense level, FullyShardedDataParallelConfig overrides, expected sections)
MIXED_CASES = {
    "dense ZeRO-3, experts ZeRO-1 (EP 2)": (
        moe_topology("alltoall", 2), "optim_grads_params", dict(expert_data_parallel_sharding_strategy="optim"),
        {"expert": ("optim x no_shard", 2, 1)}),
    "dense HSDP 2x2, experts flat (EP 2)": (
        moe_topology("alltoall", 2, instances=2), "optim_grads_params",
        dict(outer="no_shard", expert_num_distributed_optimizer_instances=1),
        {"dense": ("optim_grads_params x no_shard", 2, 2), "expert": ("optim_grads_params x no_shard", 2, 1)}),
    "dense ZeRO-2, experts HFSDP 2x2 (EP 1)": (
        moe_topology("alltoall", 1), "optim_grads",
        dict(expert_data_parallel_sharding_strategy="optim_grads_params", expert_outer_dp_sharding_strategy="optim",
             expert_num_distributed_optimizer_instances=2),
        {"expert": ("optim_grads_params x optim", 2, 2)}),
    # MoE with TP needs sequence parallel; expert DP = 4 / (EP 2 x expert TP 2) = 1. The alltoall
    # dispatcher gathers uneven token counts over TP, which gloo cannot (nor can Megatron's own DDP here).
    "EP 2 x TP 2 (SP), ZeRO-3": (
        moe_topology("allgather", 2, tp=2, sp=True), "optim_grads_params", {},
        {"expert": ("optim_grads_params x no_shard", 1, 1)}),
}

"""Pretrain a GPT with Megatron-Core; ``--use-megatron-fsdp`` shards it with megatron.fsdp.

    torchrun --nproc_per_node 4 pretrain_gpt.py --mock-data --use-megatron-fsdp \\
        --data-parallel-sharding-strategy optim_grads_params --train-iters 20

Without a GPU it runs on CPU with gloo (Megatron-Core CPU mode is switched on and said
once in the log). Without ``--use-megatron-fsdp`` it trains with Megatron-Core's own
DistributedDataParallel (and DistributedOptimizer with ``--use-distributed-optimizer``).
An installed package runs the same job as ``megatron-fsdp-pretrain`` or
``python -m megatron.fsdp_training``.
"""

from megatron.fsdp_training.__main__ import main

if __name__ == "__main__":
    main()

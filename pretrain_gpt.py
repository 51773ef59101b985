"""Pretrain a GPT with Megatron-Core; ``--use-megatron-fsdp`` shards it with megatron.fsdp.

    torchrun --nproc_per_node 4 pretrain_gpt.py --mock-data --use-megatron-fsdp \\
        --data-parallel-sharding-strategy optim_grads_params --train-iters 20

Without a GPU it runs on CPU with gloo (Megatron-Core CPU mode is switched on and said
once in the log). Without ``--use-megatron-fsdp`` it trains with Megatron-Core's own
DistributedDataParallel (and DistributedOptimizer with ``--use-distributed-optimizer``).
"""

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # CPU: a first compiled step would take seconds

from megatron.fsdp_training.training import main  # noqa: E402

if __name__ == "__main__":
    main()

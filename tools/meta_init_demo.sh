#!/usr/bin/env bash
# A GPT that no rank of a 24 GiB CPU machine could build eagerly: 1.0B parameters (20 layers,
# hidden 2048, byte-level vocabulary), ZeRO-3, fp32, trained for 3 iterations on 4 CPU ranks
# with --init-model-with-meta-device. Prints the build peak and the training peak per rank.
#
#   bash tools/meta_init_demo.sh [extra pretrain_gpt.py arguments, e.g. --optimizer sgd --sgd-momentum 0]
#
# Memory (docs/meta_init.md): the meta build peaks at ~1.2 GB per rank above the process (its 1.0 GB
# weight shard and at most one layer), with glibc's defaults; training with Adam
# needs 16 B/param / 4 ranks = 4.0 GB per rank plus ~1.3 GB of gathered units, activations and
# process (~21 GB for the 4 ranks); with SGD without momentum ~13 GB. Without the flag every
# rank would first hold the whole 4.0 GB model: ~22 GB just to build. Check `free -g` first.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

torchrun --nproc_per_node 4 pretrain_gpt.py --mock-data \
    --num-layers 20 --hidden-size 2048 --num-attention-heads 16 --seq-length 64 \
    --micro-batch-size 1 --global-batch-size 4 --train-iters 3 --eval-iters 0 \
    --lr 1e-4 --lr-warmup-iters 0 --log-interval 1 \
    --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params \
    --init-model-with-meta-device "$@"

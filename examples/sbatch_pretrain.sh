#!/bin/bash
# Megatron-FSDP pretraining on a SLURM cluster, in the style of Megatron-LM's sbatch scripts:
# one torchrun per node (srun), every node's torchrun told the node count, its node rank, the
# first node's address and a port; the Megatron-FSDP user guide's required and recommended flags.
#
#   sbatch --nodes 2 examples/sbatch_pretrain.sh [extra pretrain_gpt.py arguments]
#
# Settings come from the environment (defaults below). Without DATA_PATH the job trains on mock
# data. tests/training/test_multinode.py runs this script on one machine with an srun stand-in
# that starts the per-node commands side by side.
#SBATCH --job-name=megatron-fsdp-pretrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail

REPO=${REPO:-"$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"}     # this checkout
OUTPUT_PATH=${OUTPUT_PATH:-"$REPO/output/${SLURM_JOB_ID:-local}"}     # checkpoints (and logs)
DATA_PATH=${DATA_PATH:-""}                                             # PREFIX of tools/preprocess_data.py; empty: mock data
TOKENIZER_TYPE=${TOKENIZER_TYPE:-GPT2BPETokenizer}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}                                      # ranks per node (CPU processes without GPUs)
NUM_NODES=${SLURM_NNODES:-1}
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" 2>/dev/null | head -n 1 || echo localhost)}
MASTER_PORT=${MASTER_PORT:-6000}
SHARDING_STRATEGY=${SHARDING_STRATEGY:-optim_grads_params}            # inner (dp_shard) level: ZeRO-3
DP_OUTER=${DP_OUTER:-1}                                                # > 1: HSDP, the outer axis across nodes
TP=${TP:-1}
PP=${PP:-1}
NUM_LAYERS=${NUM_LAYERS:-24}
HIDDEN_SIZE=${HIDDEN_SIZE:-2048}
NUM_HEADS=${NUM_HEADS:-16}
SEQ_LENGTH=${SEQ_LENGTH:-2048}
MBS=${MBS:-2}
GBS=${GBS:-256}
TRAIN_ITERS=${TRAIN_ITERS:-10000}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}

if [ -n "$DATA_PATH" ]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer-type "$TOKENIZER_TYPE" --split 99,1,0)
else
    DATA_ARGS=(--mock-data)
fi

MEGATRON_FSDP_ARGS=(
    # The Megatron-FSDP user guide's required flags.
    --use-megatron-fsdp
    --data-parallel-sharding-strategy "$SHARDING_STRATEGY"
    --no-gradient-accumulation-fusion
    --use-distributed-optimizer
    --ckpt-format fsdp_dtensor
    # Recommended (--use-nccl-ub is not implemented on CUDA yet: docs/training.md).
    --calculate-per-token-loss
    --init-model-with-meta-device
    --grad-reduce-in-bf16
    --fsdp-double-buffer
    --num-distributed-optimizer-instances "$DP_OUTER"
)

PRETRAIN_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --num-layers "$NUM_LAYERS"
    --hidden-size "$HIDDEN_SIZE"
    --num-attention-heads "$NUM_HEADS"
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
    --micro-batch-size "$MBS"
    --global-batch-size "$GBS"
    --train-iters "$TRAIN_ITERS"
    --bf16
    --lr 3e-4
    --min-lr 3e-5
    --lr-decay-style cosine
    --lr-warmup-iters "${LR_WARMUP_ITERS:-100}"
    --weight-decay 0.1
    --clip-grad 1.0
    --adam-beta1 0.9
    --adam-beta2 0.95
    --log-interval "${LOG_INTERVAL:-10}"
    --eval-interval "${EVAL_INTERVAL:-1000}"
    --eval-iters "${EVAL_ITERS:-10}"
    --save "$OUTPUT_PATH/checkpoints"
    --save-interval "$SAVE_INTERVAL"
    --distributed-timeout-minutes "${TIMEOUT_MINUTES:-30}"
)

# One task per node; each runs torchrun for that node's ranks. SLURM_NODEID is read by the task,
# not here (hence the single quotes).
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c 'exec torchrun \
    --nnodes "$0" --node-rank "$SLURM_NODEID" --master-addr "$1" --master-port "$2" \
    --nproc-per-node "$3" "${@:4}"' \
    "$NUM_NODES" "$MASTER_ADDR" "$MASTER_PORT" "$GPUS_PER_NODE" \
    "$REPO/pretrain_gpt.py" "${DATA_ARGS[@]}" "${MEGATRON_FSDP_ARGS[@]}" "${PRETRAIN_ARGS[@]}" "$@"

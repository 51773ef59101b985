#!/usr/bin/env bash
# Train a small GPT on real text that needs no download: the Python standard library's
# own source files on this machine, tokenised byte by byte, on 4 CPU processes with
# megatron.fsdp ZeRO-3. The loss falls visibly within a few minutes on 2 cores.
#
#   bash examples/train_gpt_on_stdlib.sh [extra pretrain_gpt.py arguments]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1

out="${DATA_DIR:-${TMPDIR:-/tmp}/mfsdp-stdlib}"
mkdir -p "$out"
stdlib="$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"
if [ ! -f "$out/stdlib_text_document.idx" ]; then
    python tools/preprocess_data.py --input "$stdlib/*.py" --input-format text \
        --tokenizer-type ByteLevelTokenizer --append-eod --workers 2 \
        --output-prefix "$out/stdlib"
fi

# Each run trains afresh into the example's own checkpoint directory (what the sample below reads).
ckpt="$out/checkpoints"
rm -rf "$ckpt"
torchrun --nproc_per_node 4 pretrain_gpt.py --save "$ckpt" \
    --data-path "$out/stdlib_text_document" --split 98,2,0 --tokenizer-type ByteLevelTokenizer \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 4 --global-batch-size 32 --train-iters 200 \
    --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 10 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params \
    --log-interval 10 --eval-interval 50 --eval-iters 2 "$@"

# What the trained model says: a short sample continuing a prompt (shape and tokenizer come
# from the checkpoint; tools/generate.py --help lists the sampling flags).
echo "> sample from the trained model:"
python tools/generate.py --load "$ckpt" --prompt "def " --max-new-tokens 64 \
    --temperature 0.7 --top-k 40 --seed 1

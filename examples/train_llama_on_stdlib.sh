#!/usr/bin/env bash
# Train a small Llama-architecture model (RMSNorm, SwiGLU, RoPE, grouped-query attention,
# untied embeddings, no biases) with megatron.fsdp ZeRO-3 on 4 CPU processes, on text that
# needs no download: the Python standard library's own sources on this machine, with a
# Hugging Face byte-level BPE tokenizer trained locally on the same text. The loss falls
# visibly within a few minutes on 2 cores. Needs the test extra (tokenizers, transformers).
#
#   bash examples/train_llama_on_stdlib.sh [extra pretrain_gpt.py arguments]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false

out="${DATA_DIR:-${TMPDIR:-/tmp}/mfsdp-stdlib-llama}"
mkdir -p "$out"
stdlib="$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"
if [ ! -f "$out/bpe/tokenizer.json" ]; then
    python tools/train_hf_tokenizer.py --input "$stdlib/*.py" --vocab-size 4096 --output-dir "$out/bpe"
fi
if [ ! -f "$out/stdlib_text_document.idx" ]; then
    python tools/preprocess_data.py --input "$stdlib/*.py" --input-format text \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$out/bpe" --append-eod --workers 2 \
        --log-interval 25 --output-prefix "$out/stdlib"
fi

# Llama-3's shape, scaled down: 8 query heads sharing 2 key/value groups, SwiGLU MLP,
# RMSNorm, RoPE (base 500000), untied input/output embeddings, no linear biases.
# Each run trains afresh into the example's own checkpoint directory (what the sample below reads).
ckpt="$out/checkpoints"
rm -rf "$ckpt"
torchrun --nproc_per_node 4 pretrain_gpt.py --save "$ckpt" \
    --data-path "$out/stdlib_text_document" --split 98,2,0 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$out/bpe" \
    --num-layers 4 --hidden-size 128 --ffn-hidden-size 448 --num-attention-heads 8 \
    --group-query-attention --num-query-groups 2 --seq-length 128 --max-position-embeddings 128 \
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope --rotary-base 500000 \
    --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 \
    --micro-batch-size 4 --global-batch-size 32 --train-iters 150 \
    --lr 3e-3 --min-lr 3e-4 --lr-warmup-fraction 0.05 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params \
    --log-interval 10 --log-throughput --eval-interval 50 --eval-iters 2 "$@"

# What the trained model says: a short sample continuing a prompt (shape and tokenizer come
# from the checkpoint; tools/generate.py --help lists the sampling flags).
echo "> sample from the trained model:"
python tools/generate.py --load "$ckpt" --prompt "def " --max-new-tokens 64 \
    --temperature 0.7 --top-k 40 --seed 1

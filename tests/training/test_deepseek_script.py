"""NVIDIA's DeepSeek-V3 Megatron-FSDP launch script, as written, trains, saves and resumes on 4 CPU ranks.

The argument list of ``docs/discussions/megatron-fsdp-user-guide/example-scripts/sbatch_mfsdp_deepseek_v3.sh``
(Megatron-LM, the path the user guide names; its defaults USE_MEGATRON_FSDP=1,
SHARDING_STRATEGY=optim_grads_params, TP=1 EP=8 MBS=4 GBS=2048, PROFILE=0, WANDB=1), every flag in the
script's order, with only these changes:
  - tokenizer and data (a download and a corpus path): ``--tokenizer-type HuggingFaceTokenizer
    --tokenizer-model deepseek-ai/DeepSeek-V3 --data-path <DATA_PATH>`` -> ``NullTokenizer --vocab-size 1000
    --mock-data``; ``--data-cache-path``, ``--save``/``--load``, ``--tensorboard-dir`` -> a temporary directory;
  - dimensions: layers 61 -> 4 with ``--moe-layer-freq [0]*3+[1]*58`` -> ``[0]*1+[1]*3`` (one dense first
    layer), hidden 7168 -> 64, ffn 18432 -> 128, heads 128 -> 4, kv-channels 128 -> 16, sequence and positions
    4096 -> 32, experts 256 -> 8 (group-limited top-k 4 of 8 groups -> 2 of 4, top-k 8 -> 2), expert and
    shared-expert ffn 2048 -> 32, MLA ranks q 1536 -> 32, kv 512 -> 16, head dims 128/64/128 -> 16/8/16;
  - parallel sizes for 4 ranks: expert parallel 8 -> 2;
  - sample counts: micro batch 4 -> 1, global batch 2048 -> 8, train samples 585937500 -> 24 (3 iterations;
    the second launch 32: one more), lr decay samples 584765624 -> 40, warm-up samples 1536000 -> 8, eval every
    100 -> 3 iterations with 32 -> 1 batches, save every 100 -> 3;
  - data-loader workers 6 -> 1.
GPU-only choices (``--transformer-impl transformer_engine``, ``--use-flash-attn``, the hybridep flex
dispatcher, ``--moe-permute-fusion``, ``--use-nccl-ub``) stay and are substituted in one start-up line.
"""

import numpy as np

from megatron.fsdp.mcore_releases import HAS_LEGACY_GROUPED_MLP
from tests.cases.job_runs import pretrain

SCRIPT = """--distributed-timeout-minutes 60 --tensor-model-parallel-size 1 --expert-model-parallel-size 2
--expert-tensor-parallel-size 1 --context-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce
--overlap-param-gather --use-mcore-models --sequence-parallel --use-flash-attn --disable-bias-linear
--micro-batch-size 1 --global-batch-size 8 --train-samples {samples} --exit-duration-in-mins 220
--no-check-for-nan-in-loss-and-grad --manual-gc --manual-gc-interval 10 --recompute-granularity selective
--recompute-modules mlp moe mla_up_proj layernorm --transformer-impl transformer_engine --seq-length 32
--data-cache-path {out}/cache --tokenizer-type NullTokenizer --vocab-size 1000 --mock-data --split 99,1,0
--no-mmap-bin-files --no-create-attention-mask-in-dataloader --num-workers 1 --num-layers 4 --hidden-size 64
--ffn-hidden-size 128 --num-attention-heads 4 --kv-channels 16 --max-position-embeddings 32
--position-embedding-type rope --rotary-base 10000 --make-vocab-size-divisible-by 3232 --normalization RMSNorm
--norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --multi-latent-attention
--attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm
--lr-decay-samples 40 --lr-warmup-samples 8 --lr-warmup-init 3.9e-7 --lr 3.9e-6 --min-lr 3.9e-7
--lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --num-experts 8 --moe-layer-freq [0]*1+[1]*3
--moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32 --moe-router-load-balancing-type seq_aux_loss
--moe-router-topk 2 --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep
--moe-router-pre-softmax --moe-grouped-gemm --moe-aux-loss-coeff 1e-4 --moe-router-group-topk 2
--moe-router-num-groups 4 --moe-router-topk-scaling-factor 2.5 --moe-router-score-function sigmoid
--moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --moe-permute-fusion
--moe-router-force-load-balancing --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8
--v-head-dim 16 --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --mtp-num-layers 1
--mtp-loss-scaling-factor 0.1 --eval-iters 1 --eval-interval 3 --auto-detect-ckpt-format
--load {out}/checkpoints --save {out}/checkpoints --save-interval 3 --dist-ckpt-strictness log_all
--init-method-std 0.02 --log-timers-to-tensorboard --log-memory-to-tensorboard --log-num-zeros-in-grad
--log-params-norm --log-validation-ppl-to-tensorboard --log-throughput --log-interval 1 --logging-level 40
--tensorboard-dir {out}/tensorboard --bf16 --enable-experimental --use-megatron-fsdp
--data-parallel-sharding-strategy optim_grads_params --no-gradient-accumulation-fusion
--use-distributed-optimizer --calculate-per-token-loss --init-model-with-meta-device --ckpt-format fsdp_dtensor
--fsdp-double-buffer --use-nccl-ub --grad-reduce-in-bf16 --wandb-project your_own_wandb_project
--wandb-exp-name DeepSeek-V3-TP1EP8-MBS4GBS2048-hybridep-selective-recompute"""


def test_the_user_guides_deepseek_v3_script_trains_saves_and_resumes(tmp_path):
    first = pretrain(4, SCRIPT.format(samples=24, out=tmp_path).split(), capture_log=True)
    log = first["log"]
    assert first["iterations"] == 3 and len(first["losses"]) == 3 and all(np.isfinite(first["losses"])), log[-3000:]
    assert "| mtp_1 loss: " in log and "saved checkpoint at iteration        3" in log, log[-3000:]
    line = next(li for li in log.splitlines() if li.startswith("> substituted on this machine: "))
    for flag in ("--use-flash-attn", "--transformer-impl transformer_engine", "--moe-token-dispatcher-type flex",
                 "--moe-permute-fusion", "--use-nccl-ub"):
        assert flag in line, line
    # Megatron-Core 0.17+ builds SequentialMLP for --moe-grouped-gemm on CPU (0.16.1: GroupedMLP): said there only
    assert ("--moe-grouped-gemm -> SequentialMLP" in line) == (not HAS_LEGACY_GROUPED_MLP), line
    second = pretrain(4, SCRIPT.format(samples=32, out=tmp_path).split(), capture_log=True)
    assert second["start_iteration"] == 3 and second["iterations"] == 1, second["log"][-3000:]  # 4
    assert len(second["losses"]) == 1 and all(np.isfinite(second["losses"])), second["log"][-3000:]
    assert "saved checkpoint at iteration        4" in second["log"]

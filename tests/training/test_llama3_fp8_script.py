"""NVIDIA's FP8 Megatron-FSDP example, as written, trains, saves and resumes on 4 CPU ranks.

The argument list of Megatron-LM's ``examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh`` (main at
d98e8a64), with its defaults (USE_MEGATRON_FSDP=1, SHARDING_STRATEGY=optim_grads_params, DTYPE=fp8, mock data
and tokenizer: its "MOCK" arguments), every flag in the order the script passes them (MODEL_ARGS, TRAINING_ARGS
with the Megatron-FSDP and then the DDP flags, DTYPE_ARGS, MODEL_PARALLEL_ARGS, DATA_ARGS_LIST,
EVAL_AND_LOGGING_ARGS), launched as its last line does (``python -m torch.distributed.run ... pretrain_gpt.py``;
``USE_UV=0`` drops its ``uv run`` prefix, ``NSYS_PROFILE=0`` its profiler; here the job's training function in the
4-rank pool), with only these changes:
  - dimensions: layers 32 -> 4, hidden 4096 -> 64, ffn 14336 -> 128, heads 32 -> 4 with query groups 8 -> 2,
    kv-channels 128 -> 16, sequence and positions 8192 -> 32, vocabulary 128256 -> 1000;
  - ranks: GPUS_PER_NODE 8 -> 4;
  - sample counts: global batch 128 -> 8, train samples 1953125000 -> 24 (3 iterations; the second launch 48),
    lr decay samples 1949218748 -> 40, warm-up samples 3906252 -> 8, eval every 100 -> 3 iterations with
    32 -> 1 batches, save every 1000 -> 3;
  - paths: the data cache, ``--save``/``--load`` (its first argument) and ``--tensorboard-dir`` (its fifth) in a
    temporary directory.
``--split '99,1,0'`` keeps the quotes the script's unquoted expansion passes. The GPU-only choices stay and are
substituted in the one start-up line; FP8 without Transformer Engine is said in its own line.
"""

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.cases.job_runs import pretrain

SCRIPT = """--use-mcore-models --num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
--group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 32 --max-position-embeddings 32
--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
--swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
--untie-embeddings-and-output-weights --disable-bias-linear
--micro-batch-size 1 --global-batch-size 8 --train-samples {samples} --lr-decay-samples 40 --lr-warmup-samples 8
--lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0
--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --cross-entropy-loss-fusion
--no-check-for-nan-in-loss-and-grad --manual-gc --empty-unused-memory-level 1 --exit-duration-in-mins 235
--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --no-gradient-accumulation-fusion
--calculate-per-token-loss --init-model-with-meta-device --ckpt-format fsdp_dtensor --use-nccl-ub --fsdp-double-buffer
--fsdp-manual-registration --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
--mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --data-cache-path {out}/cache --tiktoken-pattern v2
--split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
--log-interval 1 --eval-iters 1 --eval-interval 3 --save-interval 3 --log-throughput --logging-level 20
--distributed-timeout-minutes 60 --save {out}/checkpoints --load {out}/checkpoints --tensorboard-dir {out}/tensorboard"""

GPU_ONLY = ("--attention-backend fused", "--cross-entropy-loss-fusion", "--empty-unused-memory-level 1",
            "--use-nccl-ub", "--fsdp-manual-registration", "--tiktoken-pattern v2", "--use-mcore-models",
            "--num-workers 1")


def test_nvidias_llama3_fp8_fsdp_script_trains_saves_and_resumes(tmp_path):
    first = pretrain(4, SCRIPT.format(samples=24, out=tmp_path).split(), capture_log=True)
    log = first["log"]
    assert first["iterations"] == 3 and len(first["losses"]) == 3 and all(np.isfinite(first["losses"])), log[-3000:]
    assert "saved checkpoint at iteration        3" in log, log[-3000:]
    line = next(li for li in log.splitlines() if li.startswith("> substituted on this machine: "))
    for flag in GPU_ONLY:
        assert line.count(flag + " -> ") == 1, (flag, line)
    fp8 = next(li for li in log.splitlines() if li.startswith("> FP8 (no Transformer Engine): "))
    assert "hybrid delayed recipe" in fp8 and "1024-step amax history (max)" in fp8, fp8
    assert "weights from megatron.fsdp's FP8 gather" in fp8, fp8
    assert len(first["fp8_scales"]) == 4 * 4 * 2 and all(v != [1.0] for v in first["fp8_scales"].values())
    saved = FileSystemReader(str(tmp_path / "checkpoints" / "iter_0000003")).read_metadata().state_dict_metadata
    weights = {k: v.properties.dtype for k, v in saved.items() if k.startswith("model.") and k.endswith(".weight")}
    assert len(weights) == 2 + 4 * 6 + 1 and set(weights.values()) == {torch.float32}, weights  # --bf16: main weights
    # delayed scaling's 1024-step amax histories: each layer's of its input, megatron.fsdp's of each weight it gathers
    inputs = {k: tuple(v.size) for k, v in saved.items() if k.endswith(".fp8_forward_history")}
    weights = {k: tuple(v.size) for k, v in saved.items() if k.endswith(".weight._fp8_amax_history")}
    assert len(inputs) == len(weights) == 4 * 4, (inputs, weights)
    assert set(inputs.values()) == {(1024, 1)} and set(weights.values()) == {(1024,)}, (inputs, weights)
    second = pretrain(4, SCRIPT.format(samples=48, out=tmp_path).split(), capture_log=True)
    assert second["start_iteration"] == 3 and second["iterations"] == 3, second["log"][-3000:]  # 4-6
    assert len(second["losses"]) == 3 and all(np.isfinite(second["losses"])), second["log"][-3000:]
    assert "saved checkpoint at iteration        6" in second["log"]

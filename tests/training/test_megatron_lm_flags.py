"""Megatron-LM's everyday flags: its Mixtral script as written, sample schedules, --decoupled-lr, --profile, --help."""

import glob
import gzip
import json
import os
import re

import numpy as np
import pytest

from megatron.fsdp_training.arguments import ArgumentError, build_parser, parse_args, validate_args
from megatron.fsdp_training.testing.job import PRETRAIN_MODEL, fsdp
from tests.cases.job_runs import B8, MODEL, assert_exact_resume, pretrain

# examples/mixtral/train_mixtral_8x7b_distributed.sh (Megatron-LM d98e8a64), every flag as the script passes it,
# with --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params added. Changed, and only these:
#   tokenizer: --tokenizer-type Llama2Tokenizer --tokenizer-model M -> NullTokenizer --vocab-size 1000;
#   sizes (a 2-rank CPU run): seq 4096 -> 32, max positions 32768 -> 64, layers 32 -> 2, hidden 4096 -> 64,
#   ffn 14336 -> 224 (the same 3.5 ratio), heads 32 -> 8 and query groups 8 -> 2 (the same 4 heads per group);
#   parallel sizes for 2 ranks: pipeline 4 -> 1, expert 8 -> 2 (the script needs >= 32 ranks);
#   sample counts: global batch 256 -> 8, train iters 500000 -> 3, lr decay iters 320000 -> 2, warm-up 500 -> 1;
#   the paths: a tiny indexed corpus for --data-path, a temporary directory for --save/--load/--tensorboard-dir.
MIXTRAL = """--use-mcore-models --disable-bias-linear --seq-length 32 --max-position-embeddings 64 --num-layers 2
--hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 8 --init-method-std 0.01 --attention-dropout 0.0
--hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 --no-masked-softmax-fusion
--no-position-embedding --rotary-base 1000000 --num-experts 8 --moe-router-topk 2
--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm
--moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
--tokenizer-type NullTokenizer --vocab-size 1000 --data-path {data} --split 99990,8,2
--micro-batch-size 1 --global-batch-size 8 --lr 1e-4 --train-iters 3 --lr-decay-iters 2 --lr-decay-style cosine
--min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 1 --clip-grad 1.0 --bf16 --tensor-model-parallel-size 1
--pipeline-model-parallel-size 1 --expert-model-parallel-size 2 --use-distributed-optimizer --sequence-parallel
--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save {ckpt} --load {ckpt}
--tensorboard-dir {ckpt}/tensorboard --no-load-optim --no-load-rng
--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"""


def _corpus(directory, documents: int = 6250, tokens: int = 40) -> str:
    """The fewest documents for which --split 99990,8,2 leaves the validation split one (start-up checks it)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(directory / "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(documents):
        doc = rng.integers(0, 1000, tokens).astype(np.uint16)
        builder.add_document(doc, [doc.size])
    builder.finalize(prefix + ".idx")
    return prefix


def test_mixtral_script_as_written_trains_3_iterations(tmp_path):
    argv = MIXTRAL.format(data=_corpus(tmp_path), ckpt=tmp_path / "ckpt").split()
    run = pretrain(2, argv, capture_log=True)
    log = run["log"]
    assert run["iterations"] == 3 and len(run["losses"]) == 3 and all(np.isfinite(run["losses"])), log[-3000:]
    assert "experts (EP 2, expert DP 1)" in log and "levels optim_grads_params (dp_shard)" in log, log[-3000:]
    assert "> substituted on this machine: --use-mcore-models -> nothing" in log
    assert "saved checkpoint at iteration        3" in log  # --save as the script gives it (--save-interval 10000)


def _sample_model(extra, samples=52):
    """PRETRAIN_MODEL (6 iterations of 8 samples) with its schedule given in samples, warm-up from a floor."""
    argv = list(PRETRAIN_MODEL)
    for flag in ("--train-iters", "--lr-warmup-iters"):
        i = argv.index(flag)
        del argv[i:i + 2]
    return argv + ["--train-samples", str(samples), "--lr-decay-samples", "44", "--lr-warmup-samples", "12",
                   "--lr-warmup-init", "1e-4", "--untie-embeddings-and-output-weights", "--log-params-norm",
                   "--log-num-zeros-in-grad"] + extra


DECOUPLED = ["--decoupled-lr", "5e-3", "--decoupled-min-lr", "2e-4"]
FIELDS = re.compile(r"learning rate: ([0-9.E+-]+) \|.*\| num zeros: (\d+) \| params norm: ([0-9.]+) \|")


def _fields(log):
    return [(float(lr), int(z), float(p)) for lr, z, p in FIELDS.findall(log)]


def _close(a, b, rtol=1e-5):
    return abs(a - b) <= rtol * abs(b) + 1e-7


def test_sample_schedule_and_decoupled_lr_match_megatron_ddp():
    """--train-samples 52 at 8 a batch is 6 iterations; warm-up over 12 samples from 1e-4, decay over 44. The
    embedding and output layer train at --decoupled-lr in their own groups: ZeRO-3 equals Megatron-Core's DDP
    (its get_standard_config_overrides groups; its DistributedOptimizer with both overlaps) within 1e-5 per
    iteration: loss, grad norm, learning rate, params norm (to the log's digits) and zeros in the gradients."""
    overlap = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    base = pretrain(2, _sample_model(DECOUPLED + overlap), capture_log=True)
    got = pretrain(2, _sample_model(DECOUPLED + overlap + fsdp("optim_grads_params")), capture_log=True)
    plain = pretrain(2, _sample_model(fsdp("optim_grads_params"), samples=24))  # 3 iterations, the same schedule
    assert len(base["losses"]) == len(got["losses"]) == 6
    for key in ("losses", "grad_norms"):
        for i, (a, b) in enumerate(zip(got[key], base[key])):
            assert _close(a, b), (key, i + 1, got[key], base[key])
    rows, base_rows = _fields(got["log"]), _fields(base["log"])
    assert len(rows) == len(base_rows) == 6
    for (lr, zeros, norm), (b_lr, b_zeros, b_norm) in zip(rows, base_rows):
        # the log's 3 decimals of the params norm; a gradient element may be exactly 0 in one reduction order only
        assert _close(lr, b_lr) and _close(norm, b_norm, 1e-4) and abs(zeros - b_zeros) <= 1e-3 * b_zeros, \
            (rows, base_rows)
    # Megatron-LM's schedule in samples: 12-sample warm-up from 1e-4 reaches --lr at 16 samples (iteration 2).
    assert _close(rows[0][0], 1e-4 + (1e-3 - 1e-4) * 8 / 12) and _close(rows[1][0], 1e-3 - (1e-3 - 1e-4) * (
        1 - (0.5 * (np.cos(np.pi * 4 / 32) + 1))))
    # The decoupled rate is used: without it the run differs from the second update on.
    assert plain["losses"][0] == got["losses"][0] and abs(plain["losses"][2] - got["losses"][2]) > 1e-4


RAMPUP = ["--rampup-batch-size", "4", "4", "16", "--train-samples", "40"]
RAMPUP_BATCHES = [4, 4, 4, 4, 8, 8, 8]  # the global batch of each iteration


@pytest.mark.mcore_only("HAS_RAMPUP_CALCULATOR", why="Megatron-Core 0.18 removed RampupBatchsizeNumMicroBatchesCalculator")
def test_rampup_batch_size_follows_megatron_core():
    """--rampup-batch-size 4 4 16 to a global batch of 8 over --train-samples 40: Megatron-Core 0.16.1's
    calculator gives each iteration's batch, and the job's schedule the same (7 iterations, its
    update_train_iters)."""
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator
    from megatron.fsdp_training.batch_rampup import BatchRampup

    args = validate_args(parse_args(_ramp_argv()), 2)
    rampup = BatchRampup.from_args(args)
    calculator = RampupBatchsizeNumMicroBatchesCalculator(8, 2, 2, False, 1, 4, 4, 16)
    consumed = 0
    for expected in RAMPUP_BATCHES:
        calculator.update(consumed, consistency_check=True)
        assert calculator.get_current_global_batch_size() == expected == rampup.global_batch_at(consumed), consumed
        consumed += expected
    assert args.train_iters == len(RAMPUP_BATCHES)


def test_rampup_batch_size_matches_ddp():
    """The ramp-up (Megatron-LM's rule: 4, 4, 4, 4, 8, 8, 8, checked against Megatron-Core 0.16.1's own calculator
    above): ZeRO-3 trains each iteration's batch as Megatron-Core's DDP does, within 1e-5, and logs each batch size."""
    from megatron.fsdp_training.batch_rampup import BatchRampup

    args = validate_args(parse_args(_ramp_argv()), 2)
    expected, consumed = [], 0
    for _ in range(args.train_iters):
        expected.append(BatchRampup.from_args(args).global_batch_at(consumed))
        consumed += expected[-1]
    assert expected == RAMPUP_BATCHES
    base = pretrain(2, _ramp_argv())
    got = pretrain(2, _ramp_argv() + fsdp("optim_grads_params"), capture_log=True)
    assert [int(b) for b in re.findall(r"global batch size: +(\d+)", got["log"])] == expected
    for key in ("losses", "grad_norms"):
        assert len(got[key]) == 7 and all(_close(a, b) for a, b in zip(got[key], base[key])), (key, got, base)


def _ramp_argv():
    argv = list(PRETRAIN_MODEL)
    for flag in ("--train-iters", "--lr-warmup-iters"):
        i = argv.index(flag)
        del argv[i:i + 2]
    return argv + RAMPUP + ["--lr-warmup-samples", "8"]


def test_decoupled_lr_groups_resume_exactly(tmp_path):
    """The decoupled groups' hyperparameters and state are checkpointed: a ZeRO-3 run resumed at iteration 5
    continues the straight run bitwise (10 iterations: warm-up, cosine decay, validation before and after)."""
    argv = MODEL + B8 + fsdp("optim_grads_params") + DECOUPLED + ["--untie-embeddings-and-output-weights"]
    straight = pretrain(2, argv + ["--save", str(tmp_path), "--save-interval", "5"])
    resumed = pretrain(2, argv + ["--load", str(tmp_path), "--ckpt-step", "5"])
    assert_exact_resume(straight, resumed, 5)


def test_profile_writes_a_trace_with_the_engines_ranges(tmp_path):
    """--profile --use-pytorch-profiler: a Chrome trace per rank in --tensorboard-dir holding the engine's
    named ranges (megatron/fsdp/collectives/profiling.py) of the profiled iterations."""
    argv = PRETRAIN_MODEL + fsdp("optim_grads_params") + [
        "--profile", "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "3",
        "--tensorboard-dir", str(tmp_path)]
    pretrain(2, argv)
    traces = sorted(glob.glob(str(tmp_path / "*.pt.trace.json*")))
    assert len(traces) == 2, os.listdir(tmp_path)  # all ranks (Megatron-LM's default --profile-ranks)
    opener = gzip.open if traces[0].endswith(".gz") else open
    with opener(traces[0], "rt") as f:
        names = {event.get("name", "") for event in json.load(f)["traceEvents"]}
    for prefix in ("fsdp.all_gather ", "fsdp.reduce ", "fsdp.install "):
        assert any(n.startswith(prefix) for n in names), (prefix, sorted(n for n in names if "fsdp" in n)[:20])
    assert "ProfilerStep#2" in names  # iteration 3, the window of --profile-step-start 2 --profile-step-end 3


NEW_FLAGS = """--train-samples --lr-decay-samples --lr-warmup-samples --lr-warmup-init --rampup-batch-size --decoupled-lr
--decoupled-min-lr --overlap-grad-reduce --overlap-param-gather --use-mcore-models --no-masked-softmax-fusion
--no-bias-gelu-fusion --no-bias-swiglu-fusion --no-rope-fusion --cross-entropy-loss-fusion --attention-backend
--use-flash-attn --apply-layernorm-1p --no-position-embedding --tiktoken-pattern --manual-gc --manual-gc-interval
--empty-unused-memory-level --exit-duration-in-mins --recompute-modules --no-mmap-bin-files
--no-create-attention-mask-in-dataloader --train-data-path --valid-data-path --test-data-path --log-params-norm
--log-num-zeros-in-grad --log-memory-to-tensorboard --log-validation-ppl-to-tensorboard --logging-level
--timing-log-level --profile --profile-step-start --profile-step-end --profile-ranks --use-pytorch-profiler
--auto-detect-ckpt-format --dist-ckpt-strictness --non-persistent-save-interval --non-persistent-ckpt-type
--non-persistent-global-ckpt-dir --non-persistent-local-ckpt-dir --non-persistent-local-ckpt-algo
--no-check-for-nan-in-loss-and-grad --check-for-nan-in-loss-and-grad --enable-experimental --fp8-format
--fp8-recipe --fp8-margin --fp8-amax-history-len --fp8-amax-compute-algo --no-fp8-wgrad --fp8-param-gather
--first-last-layers-bf16 --num-layers-at-start-in-bf16 --num-layers-at-end-in-bf16""".split()


def test_help_lists_every_new_flag_with_its_default():
    """``python pretrain_gpt.py --help``'s text (the parser's help): each flag's entry ends with its default."""
    parser = build_parser()
    text = parser.format_help()
    entries = text[text.index("options:"):].split("\n  -")  # one entry per argument, after the usage
    for flag in NEW_FLAGS:
        entry = " ".join(next(e for e in entries if re.match(re.escape(flag[1:]) + r"[ \n,]", e)).split())
        assert re.search(r"\(default: [^)]*\)", entry), (flag, entry)


@pytest.mark.parametrize("argv, pattern", [
    (["--train-samples", "64", "--train-iters", "4"], "both set the training length"),
    (["--lr-decay-samples", "64"], "need --train-samples"),
    (["--train-samples", "64", "--lr-warmup-iters", "2"], "give the schedule in samples"),
    (["--rampup-batch-size", "4", "4", "64"], "--rampup-batch-size needs --train-samples"),
    (["--rampup-batch-size", "2", "4", "64", "--train-samples", "64", "--micro-batch-size", "1",
      "--global-batch-size", "8"], "positive multiple of the increment"),
    (["--rampup-batch-size", "2", "2", "64", "--train-samples", "64", "--micro-batch-size", "2",
      "--global-batch-size", "8"], "must be multiples of --micro-batch-size x data-parallel size = 4"),
    (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--decoupled-lr", "1e-4", "--decoupled-min-lr", "1e-3"], "must be in"),
    (["--no-position-embedding"], "use --position-embedding-type none"),
    (["--recompute-modules", "mlp"], "needs --recompute-granularity selective"),
    (["--overlap-param-gather"], "needs --use-distributed-optimizer"),
    (["--non-persistent-save-interval", "5", "--non-persistent-ckpt-type", "local"], "needs --save DIR"),
    (["--profile", "--profile-step-start", "3", "--profile-step-end", "3"], "below --profile-step-end"),
    (["--profile", "--use-pytorch-profiler"], "set it"),
    (["--data-path", "x", "--train-data-path", "y", "--tokenizer-type", "NullTokenizer"], "exclusive"),
])
def test_megatron_lm_rules_stop_start_up_with_one_line(argv, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(["--mock-data"] + argv), 2)


def test_sample_based_length_and_the_fusion_fields():
    from megatron.fsdp_training.arguments.model_flags import transformer_config_fields
    from megatron.fsdp_training.batch_rampup import ScheduleLengths

    args = validate_args(parse_args(["--mock-data", "--train-samples", "100", "--global-batch-size", "8",
                                     "--lr-warmup-samples", "16", "--no-rope-fusion", "--apply-layernorm-1p",
                                     "--recompute-granularity", "selective", "--recompute-modules", "core_attn",
                                     "mlp"]), 2)
    assert args.train_iters == 12 and ScheduleLengths.from_args(args).in_samples() == dict(lr_warmup_steps=16, lr_decay_steps=100,
                                                                    wd_incr_steps=100)
    fields = transformer_config_fields(args, cpu=True)
    assert fields["layernorm_zero_centered_gamma"] and fields["recompute_modules"] == ["core_attn", "mlp"]
    assert not fields["masked_softmax_fusion"] and not fields["apply_rope_fusion"]
    from megatron.fsdp_training.arguments.substitutions import substitution_line

    line = substitution_line(validate_args(parse_args(["--mock-data", "--use-megatron-fsdp", "--dist-ckpt-strictness",
                                                       "log_all", "--auto-detect-ckpt-format"]), 2))
    assert line.startswith("> substituted on this machine: --auto-detect-ckpt-format -> --ckpt-format fsdp_dtensor")
    assert "--dist-ckpt-strictness log_all -> raise_all" in line
    iters = validate_args(parse_args(["--mock-data", "--train-iters", "5", "--lr-warmup-iters", "1",
                                      "--global-batch-size", "8"]), 2)
    assert ScheduleLengths.from_args(iters).in_samples() == dict(lr_warmup_steps=8, lr_decay_steps=40, wd_incr_steps=40)


def test_everyday_flags_train_as_megatron_lm(tmp_path):
    """--no-create-attention-mask-in-dataloader (causal attention without a mask), --recompute-modules core_attn
    (selective recomputation), --manual-gc with an interval,
    --empty-unused-memory-level, --log-memory-to-tensorboard, --log-validation-ppl-to-tensorboard: the same
    losses (1e-5) as the run with the mask; --exit-duration-in-mins 0 stops after the first iteration."""
    argv = PRETRAIN_MODEL + fsdp("optim_grads_params") + ["--hidden-dropout", "0", "--attention-dropout", "0"]
    masked = pretrain(2, argv + ["--train-iters", "3"])
    flags = ["--no-create-attention-mask-in-dataloader", "--manual-gc", "--manual-gc-interval", "1",
             "--recompute-granularity", "selective", "--recompute-modules", "core_attn",
             "--empty-unused-memory-level", "2", "--tensorboard-dir", str(tmp_path), "--log-memory-to-tensorboard",
             "--log-validation-ppl-to-tensorboard", "--train-iters", "3"]
    got = pretrain(2, argv + flags)
    assert len(got["losses"]) == 3 and all(_close(a, b) for a, b in zip(got["losses"], masked["losses"])), (got, masked)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tmp_path)).Reload()
    assert {"lm loss validation ppl", "mem-allocated-bytes", "mem-max-allocated-bytes"} <= set(board.Tags()["scalars"])
    short = pretrain(2, argv + ["--exit-duration-in-mins", "0"], capture_log=True)
    assert len(short["losses"]) == 1 and "exiting after iteration 1 (--exit-duration-in-mins 0)" in short["log"]


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_apply_layernorm_1p_stores_gamma_minus_one(kind):
    """--apply-layernorm-1p: the CPU norm starts at gamma 0 and computes the norm with 1 + gamma (apex and
    Transformer Engine's zero_centered_gamma), the same function as the plain norm with gamma + 1."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.fsdp.mcore_cpu.layer_spec import CpuNorm

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization=kind,
                               layernorm_zero_centered_gamma=True)
    plain_config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization=kind)
    centred, plain = CpuNorm(config, 8), CpuNorm(plain_config, 8)
    assert torch.equal(centred.weight, torch.zeros(8))
    with torch.no_grad():
        centred.weight.normal_()
        plain.weight.copy_(centred.weight + 1)
    x = torch.randn(3, 8)
    torch.testing.assert_close(centred(x), plain(x), rtol=0, atol=1e-6)


def _small_corpus(directory, name: str, documents: int = 40) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(directory / f"{name}_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in np.random.default_rng(len(name)).integers(0, 256, (documents, 100)).astype(np.uint16):
        builder.add_document(doc, [doc.size])
    builder.finalize(prefix + ".idx")
    return prefix


def test_weighted_data_path_and_a_dataset_per_split(tmp_path):
    """--data-path 0.3 A 0.7 B blends the two by weight; --train-data-path A --valid-data-path B builds each
    split from its own prefix (no --split); --no-mmap-bin-files reads the .bin files without mmap."""
    from megatron.fsdp_training.data import datasets as data
    from megatron.fsdp_training.data.data_config import DataConfig

    a, b = _small_corpus(tmp_path, "a"), _small_corpus(tmp_path, "bb")
    small = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
             "--micro-batch-size", "1", "--train-iters", "2", "--tokenizer-type", "ByteLevelTokenizer",
             "--eval-iters", "1", "--no-mmap-bin-files"]
    args = validate_args(parse_args(small + ["--data-path", "0.3", a, "0.7", b, "--split", "90,10,0"]), 1)
    config = DataConfig.from_args(args)
    train, valid, _ = data.build_datasets(config, data.build_tokenizer(config.tokenizer))
    assert [d.dataset_path for d in train.datasets] == [a, b]
    assert np.allclose(train.weights, [0.3, 0.7]) and not train.datasets[0].dataset.mmap
    args = validate_args(parse_args(small + ["--train-data-path", a, "--valid-data-path", b]), 1)
    config = DataConfig.from_args(args)
    train, valid, test = data.build_datasets(config, data.build_tokenizer(config.tokenizer))
    assert train.dataset_path == a and valid.dataset_path == b and test is None

"""Megatron-LM 0.19/0.20's Megatron-FSDP flags: what --use-megatron-fsdp implies, each flag honoured (the
configuration it builds), substituted (its one start-up line) or refused (its one line); Megatron-LM main's
Llama-3-8B Megatron-FSDP script parses; bf16 main weights and a step batch-size schedule train."""

import re

import pytest
import torch

from megatron.fsdp_training.arguments import ArgumentError, build_parser, parse_args, validate_args
from megatron.fsdp_training.arguments.substitutions import substitution_line
from tests.cases.job_runs import pretrain

FSDP = ["--mock-data", "--use-megatron-fsdp"]


def _args(argv, world=2):
    return validate_args(parse_args(["--mock-data"] + argv), world)


def test_use_megatron_fsdp_implies_megatron_lm_mains_defaults_and_explicit_flags_win():
    """Megatron-LM main: ZeRO-3, the distributed optimizer (version 1, its default) and fsdp_dtensor; the
    baseline keeps no_shard and torch_dist; a flag written on the command line is kept as written."""
    implied = _args(["--use-megatron-fsdp"])
    assert (implied.data_parallel_sharding_strategy, implied.outer_dp_sharding_strategy,
            implied.use_distributed_optimizer, implied.ckpt_format, implied.megatron_fsdp_version,
            implied.megatron_fsdp_main_params_dtype) == ("optim_grads_params", "no_shard", True, "fsdp_dtensor", 1,
                                                        "fp32")
    explicit = _args(["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "no_shard",
                      "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor", "--megatron-fsdp-version", "1"])
    assert (explicit.data_parallel_sharding_strategy, explicit.use_distributed_optimizer,
            explicit.ckpt_format) == ("no_shard", True, "fsdp_dtensor")
    for level in ("optim", "optim_grads"):
        assert _args(["--use-megatron-fsdp", "--data-parallel-sharding-strategy", level]).data_parallel_sharding_strategy \
            == level
    baseline = _args([])
    assert (baseline.data_parallel_sharding_strategy, baseline.use_distributed_optimizer, baseline.ckpt_format,
            baseline.megatron_fsdp_version) == ("no_shard", False, "torch_dist", None)
    v2 = _args(["--use-megatron-fsdp", "--megatron-fsdp-version", "2"])
    assert v2.use_distributed_optimizer is False and v2.data_parallel_sharding_strategy == "optim_grads_params"
    hfsdp = _args(["--use-megatron-fsdp", "--num-distributed-optimizer-instances", "2", "--enable-full-sharding-in-hsdp"],
                  world=4)
    assert hfsdp.outer_dp_sharding_strategy == "optim"
    assert _args(["--use-megatron-fsdp", "--megatron-fsdp-max-pool-double-buffer"]).fsdp_double_buffer is True
    for spelling in ("--muon-nesterov", "--muon-use-nesterov"):
        assert _args(["--use-megatron-fsdp", "--optimizer", "muon", spelling]).muon_use_nesterov is True


@pytest.mark.parametrize("argv, pattern", [
    (["--megatron-fsdp-version", "2"], "--megatron-fsdp-version configure Megatron-FSDP: add --use-megatron-fsdp"),
    (["--enable-full-sharding-in-hsdp", "--fsdp-manual-registration"],
     "--fsdp-manual-registration, --enable-full-sharding-in-hsdp configure Megatron-FSDP"),
    (["--data-parallel-sharding-strategy", "optim"], "need --use-megatron-fsdp"),
    (FSDP[1:] + ["--megatron-fsdp-version", "2", "--use-distributed-optimizer"],
     "--megatron-fsdp-version 2 is not compatible with --use-distributed-optimizer"),
    (FSDP[1:] + ["--fsdp-manual-registration"], "add --use-nccl-ub"),
    (FSDP[1:] + ["--enable-full-sharding-in-hsdp"], "needs --num-distributed-optimizer-instances > 1"),
    (FSDP[1:] + ["--enable-full-sharding-in-hsdp", "--num-distributed-optimizer-instances", "2",
                 "--outer-dp-sharding-strategy", "no_shard"], "contradicts --outer-dp-sharding-strategy no_shard"),
    (FSDP[1:] + ["--megatron-fsdp-max-pool-double-buffer", "--data-parallel-sharding-strategy", "optim"],
     "needs --data-parallel-sharding-strategy optim_grads_params"),
    (FSDP[1:] + ["--megatron-fsdp-main-params-dtype", "fp16"], "fp16: this job trains in bf16 or fp32"),
    (FSDP[1:] + ["--megatron-fsdp-main-params-dtype", "bf16"], "needs --bf16"),
    (FSDP[1:] + ["--bf16", "--megatron-fsdp-main-params-dtype", "auto", "--optimizer", "sgd"], "needs --optimizer adam"),
    (FSDP[1:] + ["--bf16", "--megatron-fsdp-main-params-dtype", "bf16", "--megatron-fsdp-main-grads-dtype", "fp32"],
     "fp32 main gradients with bf16 main weights are not implemented"),
    (["--ddp-bucket-size", "100", "--ddp-num-buckets", "2"], "both size the gradient buckets"),
    (["--ddp-num-buckets", "0"], "--ddp-num-buckets 0 must be at least 1"),
    (["--overlap-param-gather-with-optimizer-step"], "needs the distributed optimizer"),
    (FSDP[1:] + ["--overlap-param-gather-with-optimizer-step"], "needs --overlap-param-gather"),
    (FSDP[1:] + ["--overlap-param-gather", "--overlap-param-gather-with-optimizer-step"],
     "needs virtual pipeline stages"),
    (FSDP[1:] + ["--overlap-param-gather", "--overlap-param-gather-with-optimizer-step", "--num-layers", "4",
                 "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
     r"not supported with distributed checkpointing \(--ckpt-format fsdp_dtensor\) but only with --ckpt-format torch"),
    (FSDP[1:] + ["--optimizer", "muon", "--muon-scalar-optimizer", "lion"], "--muon-scalar-optimizer lion is not"),
    (["--memory-snapshot-path", "x.pickle"], "add --record-memory-history"),
    (["--step-batch-size-schedule", "0:8", "--global-batch-size", "8"], "both set the global batch"),
    (["--step-batch-size-schedule", "0:8", "--rampup-batch-size", "4", "4", "8", "--train-samples", "64"],
     "replaces --rampup-batch-size"),
    (["--step-batch-size-schedule", "1K:8"], "the first entry must start at 0 tokens"),
    (["--step-batch-size-schedule", "0:8 16:12"], "must increase by at least --seq-length"),
    (["--step-batch-size-schedule", "0:8 1K:6"], "the batch 6 .* is not a positive multiple of"),
    (["--step-batch-size-schedule", "0:eight"], "is not THRESHOLD:BATCH_SIZE with numbers"),
])
def test_each_refusal_is_one_line(argv, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        _args(argv)


def test_each_substituted_flag_says_its_one_line_once():
    args = _args(["--use-megatron-fsdp", "--use-nccl-ub", "--fsdp-manual-registration",
                  "--fsdp-db-use-persist-buf-on-alloc-fail", "--megatron-fsdp-enable-fine-grained-param-gather",
                  "--ddp-bucket-size", "1000", "--cuda-graph-impl", "local", "--record-memory-history",
                  "--memory-snapshot-path", "m.pickle", "--num-workers", "2", "--no-gradient-accumulation-fusion"])
    line = substitution_line(args)
    for entry in ("--fsdp-manual-registration -> no effect (gloo has no NCCL user buffers to register)",
                  "--fsdp-db-use-persist-buf-on-alloc-fail -> no effect (gloo has no NCCL user buffers to register)",
                  "--megatron-fsdp-enable-fine-grained-param-gather -> one gather per unit (megatron.fsdp gathers a "
                  "unit's weights together and prefetches the next unit's)",
                  "--ddp-bucket-size 1000 -> one reduction per FSDP unit",
                  "--cuda-graph-impl local -> no CUDA graphs (no CUDA)",
                  "--record-memory-history -> nothing recorded (no CUDA caching allocator on CPU",
                  "--num-workers 2 -> samples read in the training process"):
        assert line.count(entry) == 1, (entry, line)
    assert line.startswith("> substituted on this machine: ") and line.count("\n") == 0
    # honoured ones say nothing: the version, the main-weights dtype, full sharding, the max pool, buckets on the baseline
    quiet = _args(["--use-megatron-fsdp", "--megatron-fsdp-version", "2", "--megatron-fsdp-main-params-dtype", "fp32",
                   "--megatron-fsdp-max-pool-double-buffer", "--no-gradient-accumulation-fusion"])
    assert substitution_line(quiet) == ""
    assert substitution_line(_args(["--ddp-num-buckets", "3", "--no-gradient-accumulation-fusion"])) == ""


def test_honoured_flags_change_the_configs_that_are_built():
    """The Megatron-Core DDP config of the baseline (buckets, gather alignment, the schedule's param sync),
    the engine's precision (main weights), Muon's coefficients, the step batch-size schedule."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.fsdp.mcore.data_parallel import mixed_precision
    from megatron.fsdp.mcore.muon import MegatronMuon, muon_kwargs
    from megatron.fsdp.optim.newton_schulz import COEFFICIENT_SETS
    from megatron.fsdp_training import model as model_lib
    from megatron.fsdp_training.batch_rampup import BatchRampup

    overlap = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    assert model_lib.ddp_config(_args(overlap), 1000).bucket_size is None  # Megatron-Core's own default
    assert model_lib.ddp_config(_args(overlap + ["--ddp-bucket-size", "300"]), 1000).bucket_size == 300
    assert model_lib.ddp_config(_args(overlap + ["--ddp-num-buckets", "4"]), 1000).bucket_size == 250
    vpp = overlap + ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                     "--num-layers-per-virtual-pipeline-stage", "1"]
    aligned, independent = _args(vpp, world=4), _args(vpp + ["--no-align-param-gather"], world=4)
    assert model_lib.ddp_config(aligned, 1).align_param_gather is True
    assert model_lib.ddp_config(independent, 1).align_param_gather is False
    assert _args(overlap).align_param_gather is False  # Megatron-LM: no interleaved schedule, nothing to align

    class Chunk:
        def __init__(self):
            self.start_param_sync = object()
    chunks = [Chunk(), Chunk()]
    assert model_lib.param_sync_func(model_lib.ddp_config(aligned, 1), chunks) == [c.start_param_sync for c in chunks]
    assert model_lib.param_sync_func(model_lib.ddp_config(independent, 1), chunks) is None

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, bf16=True)
    base = ["--use-megatron-fsdp", "--bf16"]
    for dtype, main in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("auto", torch.bfloat16)):
        ddp = model_lib.ddp_config(_args(base + ["--megatron-fsdp-main-params-dtype", dtype]), 1)
        assert ddp.megatron_fsdp_main_params_dtype == main and mixed_precision(config, ddp).main_dtype == main
    auto_fp32 = model_lib.ddp_config(_args(["--use-megatron-fsdp", "--megatron-fsdp-main-params-dtype", "auto"]), 1)
    assert auto_fp32.megatron_fsdp_main_params_dtype == torch.float32

    muon = _args(["--use-megatron-fsdp", "--optimizer", "muon"])
    assert muon.muon_coefficient_type == "quintic" and muon.muon_momentum == 0.9  # Megatron-LM's defaults
    for kind in ("quintic", "simple"):
        opt_config = model_lib.optimizer_config(_args(["--use-megatron-fsdp", "--optimizer", "muon",
                                                      "--muon-coefficient-type", kind]))
        group = MegatronMuon([torch.nn.Parameter(torch.zeros(2, 2))], **muon_kwargs(opt_config)).param_groups[0]
        sets = COEFFICIENT_SETS[kind]
        assert group["ns_coefficients"] == (sets if kind == "quintic" else sets[0])

    # 32-token samples: 0:4 then 8 from 256 tokens (sample 8); 40 samples are 4, 4, 8, 8, 8, 8 (6 iterations)
    steps = _args(["--seq-length", "32", "--micro-batch-size", "2", "--step-batch-size-schedule", "0:4 256:8", "--train-samples", "40"])
    assert steps.step_batch_sizes == [(0, 4), (8, 8)] and steps.global_batch_size == 8 and steps.train_iters == 6
    assert [BatchRampup.from_args(steps).global_batch_at(c) for c in (0, 4, 7, 8, 16)] == [4, 4, 4, 8, 8]
    big = _args(["--seq-length", "32", "--micro-batch-size", "2", "--step-batch-size-schedule", "0:8 1.5K:16 2K:12", "--train-iters", "3"])
    assert big.step_batch_sizes == [(0, 8), (46, 16), (62, 12)] and big.global_batch_size == 12


# examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh (Megatron-LM d98e8a64), its argument arrays in the
# order the script passes them, with its defaults (USE_MEGATRON_FSDP=1, SHARDING_STRATEGY=optim_grads_params,
# MOCK data and tokenizer, 8 ranks), its NSYS_PROFILE=1 flags, and without its FP8 flags (DTYPE_ARGS:
# --fp8-format, --fp8-amax-history-len, --fp8-amax-compute-algo, --fp8-param-gather); the paths of
# --data-cache-path, --save, --load and --tensorboard-dir go to a temporary directory. OPTIONAL: the flags the
# script has commented out (HFSDP, the Megatron-FSDP dtypes, the precision-aware optimizer, CUDA graphs, the
# max-pool double buffer, --fsdp-db-use-persist-buf-on-alloc-fail, --memory-snapshot-path).
LLAMA3_8B_FSDP = """--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
--num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192
--max-position-embeddings 8192 --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0
--attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134
--attention-backend fused --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748
--lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
--cross-entropy-loss-fusion --no-check-for-nan-in-loss-and-grad --manual-gc --empty-unused-memory-level 1
--exit-duration-in-mins 235 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
--no-gradient-accumulation-fusion --calculate-per-token-loss --init-model-with-meta-device
--ckpt-format fsdp_dtensor --use-nccl-ub --fsdp-double-buffer --fsdp-manual-registration
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --profile --profile-step-start 8
--profile-step-end 12 --profile-ranks 0 --record-memory-history --tensor-model-parallel-size 1
--context-parallel-size 1 --sequence-parallel --mock-data --tokenizer-type NullTokenizer --vocab-size 128256
--data-cache-path {out}/cache --tiktoken-pattern v2 --split 99,1,0 --no-create-attention-mask-in-dataloader
--no-mmap-bin-files --num-workers 1 --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000
--log-throughput --logging-level 20 --distributed-timeout-minutes 60 --save {out}/ckpt --load {out}/ckpt
--tensorboard-dir {out}/tensorboard"""
OPTIONAL = """--fsdp-db-use-persist-buf-on-alloc-fail --num-distributed-optimizer-instances 2
--outer-dp-sharding-strategy no_shard --megatron-fsdp-main-params-dtype fp32 --megatron-fsdp-main-grads-dtype auto
--megatron-fsdp-grad-comm-dtype auto --use-precision-aware-optimizer --cuda-graph-impl full_iteration
--megatron-fsdp-max-pool-double-buffer --memory-snapshot-path {out}/torch_memprof.pickle"""


def test_megatron_lm_mains_llama3_8b_fsdp_script_parses_and_validates(tmp_path):
    """Every non-FP8 flag of the script (and its commented options) is known, start-up accepts the command
    line on 8 ranks, and each flag this machine cannot honour is said once in the one start-up line."""
    parser = build_parser()
    for argv in (LLAMA3_8B_FSDP, LLAMA3_8B_FSDP + "\n" + OPTIONAL):
        argv = argv.format(out=tmp_path).split()
        args, unknown = parser.parse_known_args(argv)
        assert unknown == [], unknown
        args = validate_args(args, 8)
        assert (args.data_parallel_sharding_strategy, args.ckpt_format, args.use_distributed_optimizer,
                args.fsdp_double_buffer, args.train_iters) == ("optim_grads_params", "fsdp_dtensor", True, True,
                                                             1953125000 // 128)
        line = substitution_line(args)
        for flag in ("--use-mcore-models", "--attention-backend fused", "--cross-entropy-loss-fusion",
                     "--tiktoken-pattern v2", "--empty-unused-memory-level 1", "--use-nccl-ub",
                     "--fsdp-manual-registration", "--record-memory-history", "--num-workers 1"):
            assert len(re.findall(re.escape(flag) + " ->", line)) == 1, (flag, line)
    assert args.num_distributed_optimizer_instances == 2 and args.use_precision_aware_optimizer
    for flag in ("--cuda-graph-impl full_iteration", "--fsdp-db-use-persist-buf-on-alloc-fail"):
        assert line.count(flag + " ->") == 1, (flag, line)


def test_help_gives_each_new_flag_its_meaning_and_default():
    text = build_parser().format_help()
    entries = text[text.index("options:"):].split("\n  -")
    for flag in ("--megatron-fsdp-version", "--megatron-fsdp-main-params-dtype", "--fsdp-manual-registration",
                 "--fsdp-db-use-persist-buf-on-alloc-fail", "--megatron-fsdp-enable-fine-grained-param-gather",
                 "--megatron-fsdp-max-pool-double-buffer", "--enable-full-sharding-in-hsdp", "--ddp-num-buckets",
                 "--ddp-bucket-size", "--no-align-param-gather", "--overlap-param-gather-with-optimizer-step",
                 "--muon-nesterov", "--muon-coefficient-type", "--muon-scalar-optimizer", "--step-batch-size-schedule",
                 "--cuda-graph-impl", "--record-memory-history", "--memory-snapshot-path"):
        entry = " ".join(next(e for e in entries if re.match(re.escape(flag[1:]) + r"[ \n,]", e)).split())
        assert re.search(r"\(default: [^)]*\)", entry) and len(entry) > len(flag) + 30, (flag, entry)
    use = " ".join(next(e for e in entries if e.startswith("-use-megatron-fsdp")).split())
    assert "implies --data-parallel-sharding-strategy optim_grads_params (ZeRO-3), the distributed optimizer and " \
           "--ckpt-format fsdp_dtensor" in use, use


def test_bf16_main_weights_and_a_step_batch_schedule_train():
    """2 ranks, ZeRO-3 implied by --use-megatron-fsdp, --step-batch-size-schedule '0:4 256:8' over 40 samples
    (batches 4, 4, 8, 8, 8, 8). --megatron-fsdp-main-params-dtype bf16 against fp32 main weights: the first
    loss is bitwise the same (same weights), the rest within bf16's rounding of the updates, and the
    persistent bytes drop by exactly the fp32 main-weight shard (4 bytes x parameters / 2 ranks)."""
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--step-batch-size-schedule", "0:4 256:8", "--train-samples", "40",
            "--lr", "1e-3", "--mock-data", "--eval-iters", "0", "--seed", "7", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--bf16", "--use-megatron-fsdp", "--no-gradient-accumulation-fusion"]
    fp32 = pretrain(2, argv, capture_log=True)
    bf16 = pretrain(2, argv + ["--megatron-fsdp-main-params-dtype", "bf16"], capture_log=True)
    for run in (fp32, bf16):
        assert [int(b) for b in re.findall(r"global batch size: +(\d+)", run["log"])] == [4, 4, 8, 8, 8, 8]
        assert "levels optim_grads_params (dp_shard)" in run["log"]
    assert bf16["losses"][0] == fp32["losses"][0] and bf16["losses"][1:] != fp32["losses"][1:]
    assert max(abs(a - b) / b for a, b in zip(bf16["losses"], fp32["losses"])) < 1e-2
    params = int(re.search(r"parameters per rank \(.*\): (\d+)", fp32["log"]).group(1))

    def persistent(run):
        return [int(n) for n in re.search(r"persistent bytes per rank [^:]*: ([\d ]+)", run["log"]).group(1).split()]
    assert [a - b for a, b in zip(persistent(fp32), persistent(bf16))] == [4 * params // 2] * 2

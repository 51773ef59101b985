"""Command-line arguments with Megatron-LM's names and meanings, and their validation.

Validation runs before any process group exists and reports each inconsistency
in one message that names the arguments and the fix.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import List, Optional

import megatron.fsdp as mfsdp
from megatron.fsdp.optim.newton_schulz import COEFFICIENT_SETS

from ..architecture import add_architecture_args, validate_architecture
from .megatron_lm import add_compat_args, validate_compat
from ..profiling import add_profiling_args, validate_profiling
from ..schedule import add_schedule_args, check_learning_rates, resolve_step_batch_sizes, resolve_train_length
from ..errors import ArgumentError
from .fp8 import add_fp8_args, validate_fp8
from .fsdp_recipe import add_fsdp_recipe_args, validate_fsdp_recipe
from .megatron_fsdp import add_megatron_fsdp_args, apply_megatron_fsdp_defaults, validate_megatron_fsdp
from .help import DefaultsHelpFormatter, show_every_default
from .not_built import parse_error_line
from ..logs.writers import add_writer_args, validate_writers


class JobArgumentParser(argparse.ArgumentParser):
    """A parse error is one ``ArgumentError`` (one line, rank 0), not argparse's usage on every rank."""

    def error(self, message: str):
        raise ArgumentError(parse_error_line(message))


def build_parser() -> argparse.ArgumentParser:
    p = JobArgumentParser(description="Pretrain a GPT with Megatron-Core (--use-megatron-fsdp for megatron.fsdp)",
                                allow_abbrev=False, formatter_class=DefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: seq length")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default="uniform")
    g.add_argument("--recompute-num-layers", type=int, default=1)
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   help="no biases in linear layers (needed with --num-experts)")
    add_architecture_args(p)
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (default: dense MLPs)")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-token-dispatcher-type", choices=["alltoall", "allgather", "flex"], default="allgather",
                   help="flex: DeepEP/HybridEP kernels (--moe-flex-dispatcher-backend), alltoall where missing")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="default: --ffn-hidden-size")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="default: tensor parallel size")
    g.add_argument("--moe-grouped-gemm", action="store_true")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"],
                   default="aux_loss")
    g.add_argument("--expert-data-parallel-sharding-strategy", default=None,
                   help="level of the expert section (default: --data-parallel-sharding-strategy)")
    g.add_argument("--expert-outer-dp-sharding-strategy", default=None,
                   help="expert outer level (default: --outer-dp-sharding-strategy)")
    g.add_argument("--expert-num-distributed-optimizer-instances", type=int, default=None,
                   help="expert outer axis size (default: --num-distributed-optimizer-instances)")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x data parallel size")
    g.add_argument("--train-iters", type=int, default=None, help="default: 20, or --train-samples // global batch")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", choices=["adam", "sgd", "muon"], default="adam",
                   help="muon: Muon for 2-D weights, Adam for the rest (needs --use-megatron-fsdp)")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   default="cosine")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: train iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g = p.add_argument_group("muon (Megatron-LM's flags and defaults; docs/training.md)")
    g.add_argument("--muon-momentum", type=float, default=0.9)
    g.add_argument("--muon-nesterov", "--muon-use-nesterov", dest="muon_use_nesterov", action="store_true")
    g.add_argument("--muon-num-ns-steps", type=int, default=5)
    g.add_argument("--muon-scale-mode", choices=["spectral", "shape_scaling", "unit_rms_norm"], default="spectral")
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0)
    g.add_argument("--muon-tp-mode", choices=["blockwise", "duplicated"], default="blockwise")
    g.add_argument("--muon-coefficient-type", choices=list(COEFFICIENT_SETS), default="quintic")
    g.add_argument("--muon-scalar-optimizer", choices=["adam", "lion"], default="adam")
    g = p.add_argument_group("precision-aware optimizer (Megatron-LM's names; docs/training.md)")
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="allow Adam's moments and the main grads below fp32 (with --use-megatron-fsdp)")
    for flag, what in (("--exp-avg-dtype", "Adam's first moment"), ("--exp-avg-sq-dtype", "Adam's second moment"),
                       ("--main-grads-dtype", "the main gradients (bf16: accumulated and reduced in bf16)")):
        g.add_argument(flag, choices=["fp32", "bf16"], default="fp32", help=f"dtype of {what}")
    g.add_argument("--main-params-dtype", choices=["fp32"], default="fp32",
                   help="dtype of the main weights (fp32 only: fp16 main params need Transformer Engine)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="data parallelism by megatron.fsdp (default: off, Megatron-Core's DDP). As in Megatron-LM "
                        "main, it implies --data-parallel-sharding-strategy optim_grads_params (ZeRO-3), the "
                        "distributed optimizer and --ckpt-format fsdp_dtensor; flags written explicitly win "
                        "(--data-parallel-sharding-strategy no_shard: plain data parallel like DDP)")
    g.add_argument("--data-parallel-sharding-strategy", default=None,
                   help="level of the inner (dp_shard) axis with --use-megatron-fsdp: no_shard (DDP) | optim "
                        "(ZeRO-1) | optim_grads (ZeRO-2) | optim_grads_params (ZeRO-3) (default: "
                        "optim_grads_params with --use-megatron-fsdp, as Megatron-LM)")
    g.add_argument("--outer-dp-sharding-strategy", default=None,
                   help="level of the outer (dp_outer) axis: no_shard = HSDP, optim = HFSDP (needs "
                        "--num-distributed-optimizer-instances > 1) (default: no_shard)")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="size of the outer axis: the data-parallel ranks split into this many domains")
    g.add_argument("--no-grad-reduce-in-fp32", dest="grad_reduce_in_fp32", action="store_false",
                   help="reduce gradients in the compute dtype instead of fp32")
    add_fsdp_recipe_args(p)
    add_megatron_fsdp_args(p)
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-type", default=None,
                   help="GPT2BPETokenizer | HuggingFaceTokenizer | ByteLevelTokenizer | NullTokenizer")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--data-cache-path", default=None, help="where Megatron-Core caches dataset indexes")
    g.add_argument("--num-workers", type=int, default=0)
    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=2)
    g.add_argument("--tensorboard-dir", default=None)
    add_writer_args(p)
    g = p.add_argument_group("initialisation (docs/adapter.md, meta device)")
    g.add_argument("--init-model-with-meta-device", action="store_true",
                   help="build the model on the meta device; megatron.fsdp materialises and initialises it unit "
                        "by unit, keeping only this rank's shards (needs --use-megatron-fsdp)")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="initialise weights on the CPU (always so on CPU runs); GPU runs build on the device")
    g = p.add_argument_group("checkpointing (docs/checkpoints.md)")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between saves (and one at the end)")
    g.add_argument("--load", default=None, help="directory to resume from (its latest checkpoint)")
    g.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    g.add_argument("--ckpt-format", choices=["fsdp_dtensor", "torch_dist", "torch", "torch_dcp"], default=None,
                   help="fsdp_dtensor with --use-megatron-fsdp (the default there), torch_dist (Megatron-Core "
                        "dist_checkpointing) for the Megatron-Core DDP baseline (its default); "
                        "tools/checkpoint/convert.py converts between them")
    g.add_argument("--no-load-optim", action="store_true", help="do not load optimizer and scheduler state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load the RNG states")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="at load, train with this command line's learning-rate and weight-decay schedule, "
                        "not the checkpoint's (Megatron-LM's flag)")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="at load, keep the checkpoint's learning-rate and weight-decay schedule whatever this "
                        "command line says (Megatron-LM's flag); without either flag a different schedule stops "
                        "the load")
    g.add_argument("--finetune", action="store_true",
                   help="load the weights only; iteration, optimizer, scheduler and data start afresh")
    g.add_argument("--exit-interval", type=int, default=None, help="exit after an iteration divisible by N "
                   "(saving first with --save)")
    g.add_argument("--async-save", action="store_true", help="plan, write and publish checkpoints in the "
                   "background: training blocks only to snapshot this rank's pieces into host memory "
                   "(docs/checkpoints.md)")
    g = p.add_argument_group("fault tolerance (docs/training.md)")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="process-group timeout: a collective some rank never joins fails after this long, "
                   "naming the collective (Megatron-LM's flag and default)")
    g.add_argument("--disable-gloo-process-groups", action="store_true",
                   help="do not create Megatron-Core's gloo twin of every process group (Megatron-LM's flag); "
                   "on CPU the groups are gloo already and the twins are never created")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, save a checkpoint at the next iteration boundary (every rank), then exit")
    add_schedule_args(p)
    add_compat_args(p)
    add_fp8_args(p)
    add_profiling_args(p)
    return show_every_default(p)


def _fail(message: str) -> None:
    raise ArgumentError(message)


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Derive defaults and check consistency against ``world_size``; raise ArgumentError on the first problem."""
    apply_megatron_fsdp_defaults(args)
    _validate_muon(args)
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    for name, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--context-parallel-size", cp), ("--micro-batch-size", args.micro_batch_size),
                        ("--num-layers", args.num_layers)):
        if value < 1:
            _fail(f"{name}={value} must be at least 1")
    if world_size % (tp * pp * cp):
        _fail(f"tensor ({tp}) x pipeline ({pp}) x context ({cp}) parallel = {tp * pp * cp} does not divide the "
              f"{world_size} ranks; choose sizes whose product divides the world size")
    args.data_parallel_size = world_size // (tp * pp * cp)
    per_step = args.micro_batch_size * args.data_parallel_size
    resolve_step_batch_sizes(args, per_step)
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step:
        _fail(f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
              f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} = {per_step}")
    args.num_micro_batches = args.global_batch_size // per_step
    resolve_train_length(args)
    if args.train_iters < 1:
        _fail(f"--train-iters={args.train_iters} must be at least 1")
    if args.use_megatron_fsdp:
        try:
            mfsdp.parse_strategy(args.data_parallel_sharding_strategy)
            if args.num_distributed_optimizer_instances > 1:
                mfsdp.parse_mesh_strategy(args.data_parallel_sharding_strategy, args.outer_dp_sharding_strategy, True)
        except ValueError as exc:
            _fail(f"--data-parallel-sharding-strategy / --outer-dp-sharding-strategy: {exc}")
    elif args.data_parallel_sharding_strategy != "no_shard" or args.outer_dp_sharding_strategy != "no_shard":
        _fail("--data-parallel-sharding-strategy and --outer-dp-sharding-strategy need --use-megatron-fsdp")
    if args.outer_dp_sharding_strategy != "no_shard" and args.num_distributed_optimizer_instances < 2:
        _fail("--outer-dp-sharding-strategy needs an outer axis: set --num-distributed-optimizer-instances > 1")
    if args.num_distributed_optimizer_instances > 1 and args.data_parallel_size % args.num_distributed_optimizer_instances:
        _fail(f"--num-distributed-optimizer-instances {args.num_distributed_optimizer_instances} does not divide "
              f"the data-parallel size {args.data_parallel_size}")
    if args.num_layers % pp:
        _fail(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers // pp
        if pp < 2 or per_stage % args.num_layers_per_virtual_pipeline_stage:
            _fail(f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage} needs "
                  f"--pipeline-model-parallel-size > 1 and must divide the {per_stage} layers per stage")
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
    validate_architecture(args)
    if args.num_attention_heads % tp:
        _fail(f"--num-attention-heads {args.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}")
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # Megatron-LM turns it off silently too: nothing to split
    if args.seq_length % (2 * cp) and cp > 1:
        _fail(f"--seq-length {args.seq_length} must be divisible by 2 x --context-parallel-size ({2 * cp})")
    if args.fp16:
        _fail("--fp16 needs loss scaling, which is not implemented here; use --bf16")
    if args.bf16 and not args.use_megatron_fsdp and not args.use_distributed_optimizer:
        pass  # Megatron-Core's Float16 optimizer handles bf16 itself
    if not args.mock_data and not (args.data_path or args.train_data_path):
        _fail("no data: pass --mock-data, or --data-path PREFIX (built by tools/preprocess_data.py) "
              "with --tokenizer-type")
    if args.data_path and not args.tokenizer_type:
        _fail("--data-path needs --tokenizer-type (and its files) to know the vocabulary")
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.max_position_embeddings < args.seq_length:
        _fail(f"--max-position-embeddings {args.max_position_embeddings} is shorter than --seq-length {args.seq_length}")
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    _validate_lr_warmup(args)
    check_learning_rates(args)
    if args.lr_warmup_iters >= args.lr_decay_iters:
        _fail(f"--lr-warmup-iters {args.lr_warmup_iters} must be below --lr-decay-iters (default --train-iters) "
              f"{args.lr_decay_iters}")
    if args.eval_interval is None:
        args.eval_interval = args.train_iters
    _validate_moe(args, world_size)
    _validate_initialisation(args)
    validate_megatron_fsdp(args)
    validate_fsdp_recipe(args)
    _validate_precision_aware_optimizer(args)
    _validate_checkpointing(args)
    _validate_data(args)
    validate_writers(args)
    validate_compat(args)
    validate_profiling(args)
    _validate_async_save(args)
    _validate_fault_tolerance(args, world_size)
    if args.transformer_impl == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
        # Only the layers' implementation differs (the same mathematics): Megatron-Core's own layers run instead,
        # said in the start-up substitution line (megatron_lm.compat_substitutions reads what was asked for).
        args.transformer_impl_requested, args.transformer_impl = args.transformer_impl, "local"
    validate_fp8(args)  # after the layer implementation is known: Transformer Engine's FP8 or the CPU FP8 layers
    return args


def _validate_muon(args: argparse.Namespace) -> None:
    if args.optimizer != "muon":
        return
    if args.fp16:
        _fail("--optimizer muon with --fp16 is not supported (as in Megatron-LM): use --bf16")
    if not args.use_megatron_fsdp:
        _fail("--optimizer muon needs --use-megatron-fsdp: Megatron-Core 0.16.1's own Muon needs the "
              "emerging_optimizers package (not installable here) and refuses --use-distributed-optimizer")
    if args.muon_scalar_optimizer != "adam":
        _fail(f"--muon-scalar-optimizer {args.muon_scalar_optimizer} is not implemented: Adam (the --adam-* flags) "
              "steps the embedding, output layer, norms and biases; use --muon-scalar-optimizer adam")
    if args.muon_num_ns_steps < 1:
        _fail(f"--muon-num-ns-steps {args.muon_num_ns_steps} must be at least 1")
    if not 0.0 <= args.muon_momentum < 1.0:
        _fail(f"--muon-momentum {args.muon_momentum} must be in [0, 1)")


def _validate_lr_warmup(args: argparse.Namespace) -> None:
    """Megatron-LM's --lr-warmup-fraction: warm-up iterations = fraction x --lr-decay-iters."""
    if args.lr_warmup_fraction is None:
        return
    if args.lr_warmup_iters:
        _fail("--lr-warmup-fraction and --lr-warmup-iters both set the warm-up; give one of them")
    if not 0.0 <= args.lr_warmup_fraction < 1.0:
        _fail(f"--lr-warmup-fraction={args.lr_warmup_fraction} must be in [0, 1)")


def _validate_initialisation(args: argparse.Namespace) -> None:
    if args.init_model_with_meta_device and not args.use_megatron_fsdp:
        _fail("--init-model-with-meta-device needs --use-megatron-fsdp (Megatron-Core's own DDP cannot "
              "materialise a meta-device model)")


def _validate_moe(args: argparse.Namespace, world_size: int) -> None:
    """Expert parallelism and the expert section's levels (Megatron-LM's rules, checked up front)."""
    expert_flags = ("expert_data_parallel_sharding_strategy", "expert_outer_dp_sharding_strategy",
                    "expert_num_distributed_optimizer_instances")
    if args.num_experts is None:
        if args.expert_model_parallel_size != 1:
            _fail("--expert-model-parallel-size needs --num-experts")
        return
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size = args.expert_tensor_parallel_size or tp
    if args.add_bias_linear:
        _fail("--num-experts needs --disable-bias-linear (Megatron-Core 0.16.1's expert layers have no biases)")
    if args.num_experts % ep:
        _fail(f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}")
    if not 1 <= args.moe_router_topk <= args.num_experts:
        _fail(f"--moe-router-topk {args.moe_router_topk} must be between 1 and --num-experts {args.num_experts}")
    if world_size % (etp * ep * pp):
        _fail(f"expert tensor ({etp}) x expert model ({ep}) x pipeline ({pp}) parallel = {etp * ep * pp} does not "
              f"divide the {world_size} ranks")
    if tp > 1 and not args.sequence_parallel:
        _fail("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (Megatron-Core's rule)")
    import torch

    if tp > 1 and args.moe_token_dispatcher_type == "alltoall" and not torch.cuda.is_available():
        _fail(f"--moe-token-dispatcher-type alltoall with --tensor-model-parallel-size {tp} does not run on gloo "
              "(CPU): it gathers uneven token counts over the TP group, which gloo's all_gather cannot "
              "(docs/moe.md, Limits); use --moe-token-dispatcher-type allgather, or NCCL on GPUs")
    args.moe_ffn_hidden_size = args.moe_ffn_hidden_size or args.ffn_hidden_size
    args.expert_data_parallel_size = world_size // (etp * ep * pp)
    if any(getattr(args, f) is not None for f in expert_flags) and not args.use_megatron_fsdp:
        _fail("--expert-data-parallel-sharding-strategy and the other expert levels need --use-megatron-fsdp")
    instances = args.expert_num_distributed_optimizer_instances or args.num_distributed_optimizer_instances
    if args.expert_data_parallel_size % instances:
        _fail(f"expert optimizer instances ({instances}) do not divide the expert data-parallel size "
              f"{args.expert_data_parallel_size}; set --expert-num-distributed-optimizer-instances to a divisor")
    if args.use_megatron_fsdp:
        inner = args.expert_data_parallel_sharding_strategy or args.data_parallel_sharding_strategy
        outer = args.expert_outer_dp_sharding_strategy or (
            args.outer_dp_sharding_strategy if instances > 1 else "no_shard")
        try:
            mfsdp.parse_strategy(inner)
            mfsdp.parse_mesh_strategy(inner, outer, instances > 1)
        except ValueError as exc:
            _fail(f"--expert-data-parallel-sharding-strategy / --expert-outer-dp-sharding-strategy: {exc}")


def _validate_data(args: argparse.Namespace) -> None:
    """Blend weights Megatron-Core accepts, every split the run reads has documents (an empty one would make
    Megatron-Core loop forever), and a dataset index cache it can write (``data/checks.py``)."""
    from megatron.core.datasets.utils import get_blend_from_list

    from ..data.checks import blend_problem, cache_dir_problem, cache_directories
    from ..data.splits import DataSplitError, check_splits

    blends = {f"--{name.replace('_', '-')}": getattr(args, name, None)
              for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path")}
    for flag, values in blends.items():
        problem = blend_problem(flag, values)
        if problem:
            _fail(problem)
    try:
        check_splits(args)
    except DataSplitError as exc:
        _fail(str(exc))
    prefixes = [] if args.mock_data else [p for v in blends.values() if v for p in get_blend_from_list(v)[0]]
    if args.data_cache_path or prefixes:
        for directory in cache_directories(args.data_cache_path, prefixes):
            problem = cache_dir_problem(directory, given=bool(args.data_cache_path))
            if problem:
                _fail(problem)


def _validate_precision_aware_optimizer(args: argparse.Namespace) -> None:
    """Megatron-LM's rules for ``--use-precision-aware-optimizer`` and the dtype flags.

    The dtypes below fp32 need the flag and Adam; the engine's optimizer implements them
    (Megatron-Core's needs Transformer Engine). bf16 main grads imply gradients accumulated
    and reduced in bf16, as Megatron-LM does not turn on fp32 accumulation for them.
    """
    flags = {"--exp-avg-dtype": args.exp_avg_dtype, "--exp-avg-sq-dtype": args.exp_avg_sq_dtype,
             "--main-grads-dtype": args.main_grads_dtype}
    lowered = [f"{flag} {value}" for flag, value in flags.items() if value != "fp32"]
    if not args.use_precision_aware_optimizer:
        if lowered:
            _fail(f"{', '.join(lowered)} needs --use-precision-aware-optimizer (Megatron-LM's rule: the dtypes "
                  "can only be fp32 without it)")
        return
    if not args.use_megatron_fsdp:
        _fail("--use-precision-aware-optimizer is implemented by the megatron.fsdp optimizer: add --use-megatron-fsdp "
              "(Megatron-Core's own needs Transformer Engine's FusedAdam)")
    if args.optimizer != "adam":
        _fail(f"--use-precision-aware-optimizer only supports --optimizer adam, not {args.optimizer}")
    if args.main_grads_dtype == "bf16":
        if not args.bf16:
            _fail("--main-grads-dtype bf16 needs --bf16 (an fp32 model's gradients are fp32)")
        args.grad_reduce_in_fp32 = False


def _validate_checkpointing(args: argparse.Namespace) -> None:
    for name in ("save_interval", "exit_interval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            _fail(f"--{name.replace('_', '-')}={value} must be at least 1")
    if args.save_interval is not None and not args.save:
        _fail("--save-interval needs --save DIR")
    for flag, value in (("--finetune", args.finetune), ("--ckpt-step", args.ckpt_step is not None)):
        if value and not args.load:
            _fail(f"{flag} needs --load DIR")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        _fail("--override-opt_param-scheduler (this command line's schedule) and "
              "--use-checkpoint-opt_param-scheduler (the checkpoint's) exclude each other; pass one")
    _validate_ckpt_format(args)


def _validate_ckpt_format(args: argparse.Namespace) -> None:
    """Each data-parallel implementation has its format (fsdp_dtensor / torch_dist); the converter moves between them."""
    native = "fsdp_dtensor" if args.use_megatron_fsdp else "torch_dist"
    if args.ckpt_format is None:
        args.ckpt_format = native
    if args.ckpt_format in ("torch", "torch_dcp"):
        _fail(f"--ckpt-format {args.ckpt_format} is not implemented: use --ckpt-format {native}")
    if args.ckpt_format == native:
        return
    if args.use_megatron_fsdp:
        _fail("--ckpt-format torch_dist is Megatron-Core's dist_checkpointing format of its DDP / "
              "DistributedOptimizer: --use-megatron-fsdp saves and loads --ckpt-format fsdp_dtensor; convert a "
              "torch_dist checkpoint with: python tools/checkpoint/convert.py from-torch-dist TORCH_DIST_DIR "
              "FSDP_DIR (and to-torch-dist back)")
    _fail("--ckpt-format fsdp_dtensor needs --use-megatron-fsdp: the Megatron-Core DDP baseline saves and loads "
          "--ckpt-format torch_dist; convert an fsdp_dtensor checkpoint with: python tools/checkpoint/convert.py "
          "to-torch-dist FSDP_DIR TORCH_DIST_DIR (and from-torch-dist back)")


def _validate_async_save(args: argparse.Namespace) -> None:
    if args.async_save and not args.save:
        _fail("--async-save needs --save DIR")
    if args.async_save and args.ckpt_format == "torch_dist":
        _fail("--async-save is implemented for --ckpt-format fsdp_dtensor (--use-megatron-fsdp); "
              "the baseline's torch_dist saves are synchronous")


def _validate_fault_tolerance(args: argparse.Namespace, world_size: int) -> None:
    """Timeout, signal handler, fault injection and the --save/--load paths: all before any process group."""
    from ..checkpointing import files as checkpoint_files, paths as checkpoint_paths

    if args.distributed_timeout_minutes < 1:
        _fail(f"--distributed-timeout-minutes={args.distributed_timeout_minutes} must be at least 1")
    if args.exit_signal_handler and not args.save:
        _fail("--exit-signal-handler saves a checkpoint on SIGTERM: it needs --save DIR")
    try:
        checkpoint_files.check_fault_spec(world_size)
    except ValueError as exc:
        _fail(str(exc))
    if args.save:
        problem = checkpoint_paths.save_dir_problem(args.save)
        if problem:
            _fail(problem)
        if int(os.environ.get("RANK", "0")) == 0:  # a failed save's leftovers would fill the disk again
            removed = checkpoint_paths.remove_stale_temporaries(args.save)
            if removed:
                print(f" removed {len(removed)} unfinished save(s) of a dead job from {args.save}: "
                      f"{', '.join(removed)}", flush=True)
            aside = checkpoint_paths.set_aside_copies(args.save)
            if aside:
                print(f" {args.save} holds {len(aside)} copies set aside by an interrupted re-save of an "
                      f"iteration ({', '.join(aside)}): the next save that completes removes them", flush=True)
    if args.load:
        problem = checkpoint_paths.load_dir_problem(args.load)
        if problem:
            _fail(problem)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)

"""The training loop's flags: batch sizes (with Megatron-LM's ramp-up and step schedules), the training length
in iterations or samples, evaluation, activation recompute, and memory and time.

Megatron-LM's names, defaults and meanings. ``--train-iters`` and ``--train-samples`` exclude each
other (Megatron-LM's iteration and sample modes; the learning-rate schedule then counts in the same
unit, ``optimizer_flags.py``); in sample mode ``--train-iters`` becomes ``train_samples // global batch``
(its ``update_train_iters``). ``--rampup-batch-size`` grows the global batch as Megatron-Core 0.16.1's
``RampupBatchsizeNumMicroBatchesCalculator``; Megatron-Core 0.19 replaces it with
``--step-batch-size-schedule`` (``StepBatchsizeNumMicroBatchesCalculator``): an iteration's global
batch is the schedule's entry reached by the tokens consumed before it (``batch_rampup.BatchRampup``,
outside this package, which the loop reads too). docs/arguments.md ("Arguments", "Coming from
Megatron-LM") says what each flag does here.
"""

from __future__ import annotations

import argparse
from typing import List

import torch

from ..errors import refuse
from ..batch_rampup import BatchRampup
from .substitutions import Substitution

DEFAULT_TRAIN_ITERS = 20  # this job's default when neither --train-iters nor --train-samples is given
# Megatron-Core 0.16.1's TransformerConfig accepts these in recompute_modules.
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine", "full_iteration")


def add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4, help="samples per micro-batch per data-parallel rank")
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x data parallel size")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="with --train-samples: start at global batch START, add INCREMENT in equal steps over "
                        "SAMPLES samples until --global-batch-size")
    g.add_argument("--step-batch-size-schedule", default=None, metavar="'TOKENS:BATCH ...'",
                   help="global batch by tokens consumed: space-separated TOKENS:BATCH pairs, the first at 0 "
                        "tokens, K/M/B/T suffixes (e.g. '0:768 250B:1536'); each iteration uses the entry reached by "
                        "the tokens consumed before it (Megatron-LM's replacement of --rampup-batch-size; excludes "
                        "--global-batch-size, which becomes the last entry's batch)")
    g.add_argument("--train-iters", type=int, default=None, help="default: 20, or --train-samples // global batch")
    g.add_argument("--train-samples", type=int, default=None,
                   help="samples to train on (instead of --train-iters): iterations = samples // global batch")
    g.add_argument("--seed", type=int, default=1234, help="random seed (+100 x pipeline rank)")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="iterations between validations (default: --train-iters, i.e. once at the end)")
    g.add_argument("--eval-iters", type=int, default=2,
                   help="validation batches per validation (0: no validation, no validation split built)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="activation recompute: full (whole layers) or selective (core attention)")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default="uniform",
                   help="with --recompute-granularity full: uniform (every N layers) or block (the first N)")
    g.add_argument("--recompute-num-layers", type=int, default=1, help="N for --recompute-method")
    g.add_argument("--recompute-modules", nargs="+", choices=RECOMPUTE_MODULES, default=None,
                   help="submodules recomputed with --recompute-granularity selective, as Megatron-Core "
                        "(default: core_attn)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="do not stop on a NaN gradient")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_true",
                   help="stop on a NaN gradient (default: on)")
    g.add_argument("--manual-gc", action="store_true",
                   help="disable Python's threshold garbage collector; collect at start, around evaluation and every "
                        "--manual-gc-interval iterations, the same step on every rank")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="iterations between manual collections with --manual-gc (0: only around evaluation)")
    g.add_argument("--empty-unused-memory-level", type=int, choices=(0, 1, 2), default=0,
                   help="torch.cuda.empty_cache() after forward-backward (1) and also after the optimizer step (2); "
                        "nothing to release on CPU")
    g.add_argument("--record-memory-history", action="store_true",
                   help="record the CUDA caching allocator's history and dump snapshots (--memory-snapshot-path); "
                        "nothing to record on CPU (said at start-up), refused on CUDA (not implemented)")
    g.add_argument("--memory-snapshot-path", default=None,
                   help="where --record-memory-history writes its snapshots (default: snapshot.pickle)")
    g.add_argument("--cuda-graph-impl", choices=CUDA_GRAPH_IMPLS, default="none",
                   help="CUDA graph capture of the layers or the whole iteration; on CPU there is nothing to capture "
                        "(said at start-up), on CUDA anything but none is refused (not implemented)")
    g.add_argument("--exit-duration-in-mins", type=int, default=None,
                   help="stop (saving first with --save) after the iteration at which this many minutes have "
                        "passed since start-up on any rank")



# ----------------------------------------------------------------------------- rules (parser.validate_args's order)

def resolve_batch_size(args: argparse.Namespace) -> None:
    """The global batch (given, the step schedule's last, or one micro-batch per data-parallel rank) in whole
    micro-batches of every data-parallel rank."""
    per_step = args.micro_batch_size * args.data_parallel_size
    resolve_step_batch_sizes(args, per_step)
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step:
        refuse(f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
              f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} = {per_step}")
    args.num_micro_batches = args.global_batch_size // per_step


_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def _count(text: str, entry: str) -> int:
    """Megatron-Core's ``_parse_numeric_value``: a number with an optional K, M, B or T suffix."""
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        refuse(f"--step-batch-size-schedule: {entry!r} is not THRESHOLD:BATCH_SIZE with numbers (K, M, B, T "
              "suffixes allowed)")


def resolve_step_batch_sizes(args: argparse.Namespace, per_step: int) -> None:
    """``--step-batch-size-schedule`` as ``args.step_batch_sizes`` ``[(threshold in samples, global batch), ...]``
    (Megatron-Core 0.19's ``StepBatchsizeNumMicroBatchesCalculator``: thresholds in tokens, divided by
    ``--seq-length``), and ``--global-batch-size`` as the last entry's batch. Every batch must be whole
    micro-batches of every data-parallel rank: checked here for all entries, before any process group
    (Megatron-Core checks each when it is reached)."""
    args.step_batch_sizes = None
    if args.step_batch_size_schedule is None:
        return
    if args.global_batch_size is not None:
        refuse("--step-batch-size-schedule and --global-batch-size both set the global batch (Megatron-LM's rule): "
              "give one of them")
    if args.rampup_batch_size is not None:
        refuse("--step-batch-size-schedule replaces --rampup-batch-size: give one of them")
    entries = args.step_batch_size_schedule.replace(",", " ").split()
    schedule = []
    for entry in entries:
        if ":" not in entry:
            refuse(f"--step-batch-size-schedule: {entry!r} is not THRESHOLD:BATCH_SIZE (e.g. '0:768 250B:1536')")
        threshold, batch = entry.split(":", 1)
        schedule.append((_count(threshold, entry) // args.seq_length, _count(batch, entry)))
    schedule.sort()
    if not schedule or schedule[0][0] != 0:
        refuse("--step-batch-size-schedule: the first entry must start at 0 tokens (e.g. '0:768 250B:1536')")
    for (before, _), (after, _) in zip(schedule, schedule[1:]):
        if after <= before:
            refuse(f"--step-batch-size-schedule: thresholds must increase by at least --seq-length {args.seq_length} "
                  f"tokens (two entries start at sample {before})")
    for threshold, batch in schedule:
        if batch < 1 or batch % per_step:
            refuse(f"--step-batch-size-schedule: the batch {batch} (from {threshold * args.seq_length} tokens) is not a "
                  f"positive multiple of --micro-batch-size x data-parallel size = {per_step}")
    args.step_batch_sizes = schedule
    args.global_batch_size = schedule[-1][1]


def resolve_train_length(args: argparse.Namespace) -> None:
    """The training length once the global batch is known, then at least one iteration."""
    _train_length(args)
    if args.train_iters < 1:
        refuse(f"--train-iters={args.train_iters} must be at least 1")


def _train_length(args: argparse.Namespace) -> None:
    """Megatron-LM's exclusive iteration / sample modes; ``--train-iters`` from samples."""
    if args.train_samples is None:
        if args.rampup_batch_size is not None:
            refuse("--rampup-batch-size needs --train-samples (Megatron-LM's rule: no ramp-up for iteration-based "
                  "training)")
        if args.lr_decay_samples is not None or args.lr_warmup_samples:
            refuse("--lr-decay-samples / --lr-warmup-samples need --train-samples (Megatron-LM's rule: "
                  "iteration-based training uses --lr-decay-iters / --lr-warmup-iters)")
        if args.train_iters is None:
            args.train_iters = DEFAULT_TRAIN_ITERS
        return
    if args.train_iters is not None:
        refuse("--train-iters and --train-samples both set the training length: give one of them")
    if args.lr_decay_iters is not None or args.lr_warmup_iters:
        refuse("--lr-decay-iters / --lr-warmup-iters with --train-samples: give the schedule in samples "
              "(--lr-decay-samples / --lr-warmup-samples), as Megatron-LM requires")
    if args.lr_warmup_fraction is not None and args.lr_warmup_samples:
        refuse("--lr-warmup-fraction and --lr-warmup-samples both set the warm-up; give one of them")
    if args.train_samples < args.global_batch_size:
        refuse(f"--train-samples {args.train_samples} is less than one global batch ({args.global_batch_size})")
    if args.step_batch_sizes:
        args.train_iters = _step_schedule_iterations(args)
    else:
        args.train_iters = _rampup_iterations(args) if args.rampup_batch_size else \
            args.train_samples // args.global_batch_size
    args.lr_decay_samples = args.lr_decay_samples or args.train_samples
    if args.lr_warmup_samples >= args.lr_decay_samples:
        refuse(f"--lr-warmup-samples {args.lr_warmup_samples} must be below --lr-decay-samples (default "
              f"--train-samples) {args.lr_decay_samples}")


def _rampup_iterations(args) -> int:
    """Megatron-LM 0.16.1's ``update_train_iters`` under ramp-up: the ramp's iterations, then whole batches."""
    start, increment, samples = args.rampup_batch_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if start < 1 or increment < 1 or samples < 0:
        refuse(f"--rampup-batch-size {start} {increment} {samples}: start and increment must be positive, samples "
              "at least 0")
    if start >= args.global_batch_size or (args.global_batch_size - start) % increment:
        refuse(f"--rampup-batch-size: --global-batch-size {args.global_batch_size} minus the start {start} must be a "
              f"positive multiple of the increment {increment}")
    if start % per_step or increment % per_step:
        refuse(f"--rampup-batch-size: the start {start} and the increment {increment} must be multiples of "
              f"--micro-batch-size x data-parallel size = {per_step} (every ramped batch is whole micro-batches)")
    iterations, consumed, ramp = 0, 0, BatchRampup.from_args(args)
    while consumed <= samples and consumed <= args.train_samples:
        consumed += ramp.global_batch_at(consumed)
        iterations += 1
    if args.train_samples > consumed:  # the constant phase; a partial last batch is dropped
        iterations += (args.train_samples - consumed) // args.global_batch_size
    return iterations


def _step_schedule_iterations(args) -> int:
    """Megatron-LM's ``update_train_iters`` under a step schedule: iterations until ``--train-samples`` are
    consumed (the last one may pass it)."""
    iterations, consumed, steps = 0, 0, BatchRampup.from_args(args)
    while consumed < args.train_samples:
        consumed += steps.global_batch_at(consumed)
        iterations += 1
    return iterations


def default_eval_interval(args: argparse.Namespace) -> None:
    if args.eval_interval is None:
        args.eval_interval = args.train_iters


def validate_cuda_only(args: argparse.Namespace) -> None:
    """CUDA features not implemented here: on CPU said in the substitution line, on CUDA refused."""
    if args.memory_snapshot_path is not None and not args.record_memory_history:
        refuse("--memory-snapshot-path is where --record-memory-history writes: add --record-memory-history or drop it")
    if not torch.cuda.is_available():
        return
    if args.cuda_graph_impl != "none":
        refuse(f"--cuda-graph-impl {args.cuda_graph_impl}: CUDA graphs are not implemented by this job; drop it "
              "(--cuda-graph-impl none)")
    if args.record_memory_history:
        refuse("--record-memory-history (torch.cuda.memory snapshots) is not implemented by this job; drop it")


def validate_recompute_and_memory(args: argparse.Namespace) -> None:
    if args.recompute_modules is not None and args.recompute_granularity != "selective":
        refuse("--recompute-modules needs --recompute-granularity selective")
    if args.recompute_modules and "moe_act" in args.recompute_modules and not args.moe_grouped_gemm:
        refuse("--recompute-modules moe_act needs --moe-grouped-gemm (Megatron-Core's rule)")
    if args.recompute_modules and "mla_up_proj" in args.recompute_modules and not args.multi_latent_attention:
        refuse("--recompute-modules mla_up_proj needs --multi-latent-attention")
    if args.manual_gc_interval < 0:
        refuse(f"--manual-gc-interval={args.manual_gc_interval} must be at least 0")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins < 0:
        refuse(f"--exit-duration-in-mins={args.exit_duration_in_mins} must be at least 0")


# ----------------------------------------------------------------------------- substitutions (substitutions.py)

def memory_substitutions(args: argparse.Namespace) -> List[Substitution]:
    if args.empty_unused_memory_level and not torch.cuda.is_available():
        return [Substitution(f"--empty-unused-memory-level {args.empty_unused_memory_level}", "nothing",
                             "no CUDA caching allocator on CPU")]
    return []


def cuda_substitutions(args: argparse.Namespace) -> List[Substitution]:
    cpu = not torch.cuda.is_available()
    out = []
    if args.cuda_graph_impl != "none" and cpu:
        out.append(Substitution(f"--cuda-graph-impl {args.cuda_graph_impl}", "no CUDA graphs", "no CUDA"))
    if args.record_memory_history and cpu:
        out.append(Substitution("--record-memory-history", "nothing recorded",
                                "no CUDA caching allocator on CPU; the log's peak memory per rank is the resident set"))
    return out

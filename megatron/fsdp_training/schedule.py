"""The training length and the learning-rate schedule in iterations or in samples, as Megatron-LM has them.

Megatron-LM's ``OptimizerParamScheduler`` counts samples: each iteration advances it by the
global batch size. ``--train-iters`` / ``--lr-decay-iters`` / ``--lr-warmup-iters`` are
multiplied by the global batch size; ``--train-samples`` / ``--lr-decay-samples`` /
``--lr-warmup-samples`` are used as they are, and ``--train-iters`` becomes
``train_samples // global_batch_size`` (Megatron-LM's ``update_train_iters``). Every group
warms up from ``--lr-warmup-init`` to its own maximum: ``--lr``, or ``--decoupled-lr`` for the
input embedding and output layer, which decay to ``--min-lr`` / ``--decoupled-min-lr``.
``--rampup-batch-size`` (with ``--train-samples``) grows the global batch over the first samples
as Megatron-Core 0.16.1's ``RampupBatchsizeNumMicroBatchesCalculator`` does (``global_batch_at``);
Megatron-Core 0.19 ignores it (deprecated) for ``--step-batch-size-schedule``, its
``StepBatchsizeNumMicroBatchesCalculator``: the global batch of an iteration is the schedule's entry
reached by the tokens consumed before it (``resolve_step_batch_sizes``).
"""

from __future__ import annotations

import argparse

from .errors import ArgumentError

DEFAULT_TRAIN_ITERS = 20  # this job's default when neither --train-iters nor --train-samples is given


def add_schedule_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("schedules in samples and the decoupled learning rate (Megatron-LM's flags)")
    g.add_argument("--train-samples", type=int, default=None,
                   help="samples to train on (instead of --train-iters): iterations = samples // global batch")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="samples over which the learning rate decays (default: --train-samples)")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="samples of linear warm-up")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="learning rate the warm-up starts from (every group warms up to its own maximum)")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="with --train-samples: start at global batch START, add INCREMENT in equal steps over "
                        "SAMPLES samples until --global-batch-size")
    g.add_argument("--step-batch-size-schedule", default=None, metavar="'TOKENS:BATCH ...'",
                   help="global batch by tokens consumed: space-separated TOKENS:BATCH pairs, the first at 0 "
                        "tokens, K/M/B/T suffixes (e.g. '0:768 250B:1536'); each iteration uses the entry reached by "
                        "the tokens consumed before it (Megatron-LM's replacement of --rampup-batch-size; excludes "
                        "--global-batch-size, which becomes the last entry's batch)")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="learning rate of the input embedding and output layer (their own parameter groups)")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="minimum learning rate of the input embedding and output layer (default: --min-lr)")


def _fail(message: str) -> None:
    raise ArgumentError(message)


_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def _count(text: str, entry: str) -> int:
    """Megatron-Core's ``_parse_numeric_value``: a number with an optional K, M, B or T suffix."""
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        _fail(f"--step-batch-size-schedule: {entry!r} is not THRESHOLD:BATCH_SIZE with numbers (K, M, B, T "
              "suffixes allowed)")


def resolve_step_batch_sizes(args: argparse.Namespace, per_step: int) -> None:
    """``--step-batch-size-schedule`` as ``args.step_batch_sizes`` ``[(threshold in samples, global batch), ...]``
    (Megatron-Core 0.19's ``StepBatchsizeNumMicroBatchesCalculator``: thresholds in tokens, divided by
    ``--seq-length``), and ``--global-batch-size`` as the last entry's batch. Every batch must be whole
    micro-batches of every data-parallel rank: checked here for all entries, before any process group
    (Megatron-Core checks each when it is reached). Called by ``validate_args`` before the batch sizes."""
    args.step_batch_sizes = None
    if args.step_batch_size_schedule is None:
        return
    if args.global_batch_size is not None:
        _fail("--step-batch-size-schedule and --global-batch-size both set the global batch (Megatron-LM's rule): "
              "give one of them")
    if args.rampup_batch_size is not None:
        _fail("--step-batch-size-schedule replaces --rampup-batch-size: give one of them")
    entries = args.step_batch_size_schedule.replace(",", " ").split()
    schedule = []
    for entry in entries:
        if ":" not in entry:
            _fail(f"--step-batch-size-schedule: {entry!r} is not THRESHOLD:BATCH_SIZE (e.g. '0:768 250B:1536')")
        threshold, batch = entry.split(":", 1)
        schedule.append((_count(threshold, entry) // args.seq_length, _count(batch, entry)))
    schedule.sort()
    if not schedule or schedule[0][0] != 0:
        _fail("--step-batch-size-schedule: the first entry must start at 0 tokens (e.g. '0:768 250B:1536')")
    for (before, _), (after, _) in zip(schedule, schedule[1:]):
        if after <= before:
            _fail(f"--step-batch-size-schedule: thresholds must increase by at least --seq-length {args.seq_length} "
                  f"tokens (two entries start at sample {before})")
    for threshold, batch in schedule:
        if batch < 1 or batch % per_step:
            _fail(f"--step-batch-size-schedule: the batch {batch} (from {threshold * args.seq_length} tokens) is not a "
                  f"positive multiple of --micro-batch-size x data-parallel size = {per_step}")
    args.step_batch_sizes = schedule
    args.global_batch_size = schedule[-1][1]


def resolve_train_length(args: argparse.Namespace) -> None:
    """Megatron-LM's exclusive iteration / sample modes; ``--train-iters`` from samples once the global
    batch is known. Called by ``validate_args`` after the batch sizes are derived."""
    if args.train_samples is None:
        if args.rampup_batch_size is not None:
            _fail("--rampup-batch-size needs --train-samples (Megatron-LM's rule: no ramp-up for iteration-based "
                  "training)")
        if args.lr_decay_samples is not None or args.lr_warmup_samples:
            _fail("--lr-decay-samples / --lr-warmup-samples need --train-samples (Megatron-LM's rule: "
                  "iteration-based training uses --lr-decay-iters / --lr-warmup-iters)")
        if args.train_iters is None:
            args.train_iters = DEFAULT_TRAIN_ITERS
        return
    if args.train_iters is not None:
        _fail("--train-iters and --train-samples both set the training length: give one of them")
    if args.lr_decay_iters is not None or args.lr_warmup_iters:
        _fail("--lr-decay-iters / --lr-warmup-iters with --train-samples: give the schedule in samples "
              "(--lr-decay-samples / --lr-warmup-samples), as Megatron-LM requires")
    if args.lr_warmup_fraction is not None and args.lr_warmup_samples:
        _fail("--lr-warmup-fraction and --lr-warmup-samples both set the warm-up; give one of them")
    if args.train_samples < args.global_batch_size:
        _fail(f"--train-samples {args.train_samples} is less than one global batch ({args.global_batch_size})")
    if args.step_batch_sizes:
        args.train_iters = _step_schedule_iterations(args)
    else:
        args.train_iters = _rampup_iterations(args) if args.rampup_batch_size else \
            args.train_samples // args.global_batch_size
    args.lr_decay_samples = args.lr_decay_samples or args.train_samples
    if args.lr_warmup_samples >= args.lr_decay_samples:
        _fail(f"--lr-warmup-samples {args.lr_warmup_samples} must be below --lr-decay-samples (default "
              f"--train-samples) {args.lr_decay_samples}")


def _rampup_iterations(args) -> int:
    """Megatron-LM 0.16.1's ``update_train_iters`` under ramp-up: the ramp's iterations, then whole batches."""
    start, increment, samples = args.rampup_batch_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if start < 1 or increment < 1 or samples < 0:
        _fail(f"--rampup-batch-size {start} {increment} {samples}: start and increment must be positive, samples "
              "at least 0")
    if start >= args.global_batch_size or (args.global_batch_size - start) % increment:
        _fail(f"--rampup-batch-size: --global-batch-size {args.global_batch_size} minus the start {start} must be a "
              f"positive multiple of the increment {increment}")
    if start % per_step or increment % per_step:
        _fail(f"--rampup-batch-size: the start {start} and the increment {increment} must be multiples of "
              f"--micro-batch-size x data-parallel size = {per_step} (every ramped batch is whole micro-batches)")
    iterations, consumed = 0, 0
    while consumed <= samples and consumed <= args.train_samples:
        consumed += global_batch_at(args, consumed)
        iterations += 1
    if args.train_samples > consumed:  # the constant phase; a partial last batch is dropped
        iterations += (args.train_samples - consumed) // args.global_batch_size
    return iterations


def _step_schedule_iterations(args) -> int:
    """Megatron-LM's ``update_train_iters`` under a step schedule: iterations until ``--train-samples`` are
    consumed (the last one may pass it)."""
    iterations, consumed = 0, 0
    while consumed < args.train_samples:
        consumed += global_batch_at(args, consumed)
        iterations += 1
    return iterations


def global_batch_at(args, consumed_samples: int) -> int:
    """The global batch of the iteration that starts after ``consumed_samples``: the step schedule's entry
    reached (Megatron-Core 0.19's ``StepBatchsizeNumMicroBatchesCalculator``), or the ramp's (0.16.1's
    ``RampupBatchsizeNumMicroBatchesCalculator.update``); else ``--global-batch-size``."""
    steps = getattr(args, "step_batch_sizes", None)
    if steps:
        return [batch for threshold, batch in steps if consumed_samples >= threshold][-1]
    if not args.rampup_batch_size or consumed_samples > args.rampup_batch_size[2]:
        return args.global_batch_size
    start, increment, samples = args.rampup_batch_size
    per_increment = samples / ((args.global_batch_size - start) // increment)
    return start + int(consumed_samples / per_increment) * increment


def check_learning_rates(args: argparse.Namespace) -> None:
    """The scheduler's own assertions, said before start-up (for the decoupled group too)."""
    if args.lr_warmup_init > args.lr:
        _fail(f"--lr-warmup-init {args.lr_warmup_init} is above --lr {args.lr}")
    if args.decoupled_lr is None:
        if args.decoupled_min_lr is not None:
            _fail("--decoupled-min-lr needs --decoupled-lr (Megatron-LM ignores it alone)")
        return
    low = args.decoupled_min_lr if args.decoupled_min_lr is not None else args.min_lr
    if not 0.0 <= low <= args.decoupled_lr:
        _fail(f"--decoupled-min-lr (default --min-lr) {low} must be in [0, --decoupled-lr {args.decoupled_lr}]")
    if args.lr_warmup_init > args.decoupled_lr:
        _fail(f"--lr-warmup-init {args.lr_warmup_init} is above --decoupled-lr {args.decoupled_lr}")


def scheduler_steps(args) -> dict:
    """Warm-up, decay and weight-decay lengths in samples (Megatron-LM's get_optimizer_param_scheduler)."""
    if args.train_samples is None:
        decay = args.lr_decay_iters * args.global_batch_size
        warmup = args.lr_warmup_iters * args.global_batch_size
        total = args.train_iters * args.global_batch_size
    else:
        decay, warmup, total = args.lr_decay_samples, args.lr_warmup_samples, args.train_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return dict(lr_warmup_steps=warmup, lr_decay_steps=decay, wd_incr_steps=total)


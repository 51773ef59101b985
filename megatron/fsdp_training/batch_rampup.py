"""The global batch of each iteration and the learning-rate schedule's lengths in samples, as Megatron-LM has them.

Megatron-LM's ``OptimizerParamScheduler`` counts samples: each iteration advances it by the
global batch size, so lengths in iterations are multiplied by it (``scheduler_steps``). The global
batch grows under ``--rampup-batch-size`` or ``--step-batch-size-schedule`` (``global_batch_at``,
which the loop and the start-up checks both read). The flags and their rules are
``arguments/training_flags.py``'s and ``arguments/optimizer_flags.py``'s (docs/arguments.md, "Arguments").
"""

from __future__ import annotations


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


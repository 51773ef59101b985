"""The global batch of each iteration and the learning-rate schedule's lengths in samples, as Megatron-LM has them.

Megatron-LM's ``OptimizerParamScheduler`` counts samples: each iteration advances it by the
global batch size, so lengths in iterations are multiplied by it (``ScheduleLengths``). The global
batch grows under ``--rampup-batch-size`` or ``--step-batch-size-schedule`` (``BatchRampup.global_batch_at``,
which the loop and the start-up checks both read). The flags and their rules are
``arguments/training_flags.py``'s and ``arguments/optimizer_flags.py``'s (docs/arguments.md, "Arguments").
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple


@dataclasses.dataclass(frozen=True)
class BatchRampup:
    """The global batch schedule: ``--global-batch-size``, grown to by ``--rampup-batch-size`` (start, increment,
    samples) or by the step schedule's ``(threshold in samples, global batch)`` entries."""

    global_batch_size: int
    rampup_batch_size: Optional[Tuple[int, int, int]] = None
    step_batch_sizes: Tuple[Tuple[int, int], ...] = ()

    @classmethod
    def from_args(cls, args) -> "BatchRampup":
        """Also during the start-up checks: only the three batch flags are read (``step_batch_sizes`` resolved)."""
        ramp = args.rampup_batch_size
        steps = getattr(args, "step_batch_sizes", None) or ()
        return cls(args.global_batch_size, None if not ramp else tuple(ramp),
                   tuple((threshold, batch) for threshold, batch in steps))

    def global_batch_at(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after ``consumed_samples``: the step schedule's entry
        reached (Megatron-Core 0.19's ``StepBatchsizeNumMicroBatchesCalculator``), or the ramp's (0.16.1's
        ``RampupBatchsizeNumMicroBatchesCalculator.update``); else ``--global-batch-size``."""
        if self.step_batch_sizes:
            return [batch for threshold, batch in self.step_batch_sizes if consumed_samples >= threshold][-1]
        if not self.rampup_batch_size or consumed_samples > self.rampup_batch_size[2]:
            return self.global_batch_size
        start, increment, samples = self.rampup_batch_size
        per_increment = samples / ((self.global_batch_size - start) // increment)
        return start + int(consumed_samples / per_increment) * increment


@dataclasses.dataclass(frozen=True)
class ScheduleLengths:
    """The learning-rate schedule's lengths as given: in iterations (x the global batch) or in samples."""

    global_batch_size: int
    train_iters: Optional[int]
    train_samples: Optional[int]
    lr_decay_iters: Optional[int]
    lr_warmup_iters: int
    lr_decay_samples: Optional[int]
    lr_warmup_samples: int
    lr_warmup_fraction: Optional[float]

    @classmethod
    def from_args(cls, args) -> "ScheduleLengths":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def in_samples(self) -> dict:
        """Warm-up, decay and weight-decay lengths in samples (Megatron-LM's get_optimizer_param_scheduler)."""
        if self.train_samples is None:
            decay = self.lr_decay_iters * self.global_batch_size
            warmup = self.lr_warmup_iters * self.global_batch_size
            total = self.train_iters * self.global_batch_size
        else:
            decay, warmup, total = self.lr_decay_samples, self.lr_warmup_samples, self.train_samples
        if self.lr_warmup_fraction is not None:
            warmup = self.lr_warmup_fraction * decay
        return dict(lr_warmup_steps=warmup, lr_decay_steps=decay, wd_incr_steps=total)

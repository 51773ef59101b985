"""The training loop as an object: Megatron-LM's ``pretrain`` and ``train`` over ``get_forward_backward_func``.

``Trainer`` holds what a run needs (model chunks, optimizer, schedule, datasets, saver, timers, loop controls,
profiler, scalar writers) and reads the loop's settings as one typed view (``LoopConfig``); each component gets
its own view, built once in ``setup`` (``DataConfig``, ``LoggingConfig``, ``BatchRampup``, ...). ``setup`` builds the
parts, ``load`` restores a checkpoint, ``train_step`` runs one iteration, ``evaluate`` one validation and ``run``
the loop with its logs and saves. What happens is reported to ``TrainingObserver``s (tests record through one);
the log lines are Megatron-LM's (docs/training.md).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Mapping, Optional, Sequence, Tuple

import torch.distributed as dist

from . import forward_step as gpt_step, model as model_lib
from .batch_rampup import BatchRampup
from .checkpointing import non_persistent, save_load as checkpointing
from .checkpointing.async_save import CheckpointSaver
from .checkpointing.checkpoint_config import CheckpointConfig
from .data import datasets as data
from .data.data_config import DataConfig
from .job_setup import setup
from .logs.lines import (IntervalLog, end_of_run_line, format_fields, gather_per_rank, insert_field, memory_line,
                         memory_mib, persistent_line, print_rank_0, reset_peak_memory, summary)
from .logs.aux_loss_config import AuxLossConfig
from .logs.logging_config import LoggingConfig
from .logs.model_size import ModelSize
from .logs.moe_losses import moe_aux_losses, mtp_losses
from .logs.throughput import throughput
from .logs.timers import IterationTimers
from .logs.writers import ScalarWriters
from .loop_controls import LoopControls, extra_fields, extra_scalars, validation_scalars
from .profiler import Profiler
from .signal_handler import ExitSignalHandler


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The loop's settings, read once from the arguments (Megatron-LM's flags of the same names)."""

    train_iters: int
    log_interval: int
    eval_interval: Optional[int]
    eval_iters: int
    save: Optional[str]
    save_interval: Optional[int]
    exit_interval: Optional[int]
    exit_duration_in_mins: Optional[float]
    exit_signal_handler: bool
    global_batch_size: int
    micro_batch_size: int
    num_micro_batches: int  # of a --global-batch-size step (validation's; a ramped step has fewer)
    data_parallel_size: int
    seq_length: int
    manual_gc: bool
    manual_gc_interval: int
    empty_unused_memory_level: int

    @classmethod
    def from_args(cls, args) -> "LoopConfig":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One training iteration, as the log line and the observers see it."""

    iteration: int
    losses: Mapping[str, float]  # "lm loss" and any MoE / MTP auxiliary losses
    grad_norm: Optional[float]
    skipped: bool
    learning_rate: float
    batch: int  # the global batch of this iteration (--rampup-batch-size)
    seconds: float


class TrainingObserver:
    """What a run reports as it goes; each method does nothing here (subclass what you need)."""

    def loaded(self, trainer: "Trainer", iteration: int, valid_loss: Optional[float]) -> None:
        """After ``--load`` restored ``iteration`` (0: nothing loaded); ``valid_loss`` the validation right after."""

    def stepped(self, trainer: "Trainer", step: StepResult) -> None:
        """After each training iteration."""

    def validated(self, trainer: "Trainer", iteration: int, loss: float) -> None:
        """After each ``--eval-interval`` validation of the loop."""

    def finished(self, trainer: "Trainer", iterations: int, max_peak_mib: float) -> None:
        """At the end of the loop: the iterations trained and the highest peak memory over ranks."""


class Trainer:
    """One training run: ``setup()``, then ``run()``; ``close()`` however it ends (the ``--save`` lock)."""

    def __init__(self, args, observers: Sequence[TrainingObserver] = ()):
        self.args = args
        self.config: Optional[LoopConfig] = None  # read once the arguments are validated (setup)
        self.checkpoint_config: Optional[CheckpointConfig] = None  # the same (setup)
        self.observers = tuple(observers)
        self.job_start = time.perf_counter()  # --exit-duration-in-mins counts from here, as Megatron-LM's pretrain
        self.model = self.optimizer = self.scheduler = None

    # ------------------------------------------------------------------ parts
    def setup(self, hold_save: bool = True) -> None:
        """Process groups, model, optimizer, schedule (``job_setup.setup``), datasets, logs, saver, controls.

        ``hold_save``: take ``--save``'s locks (the training job); the estimate, which writes nothing, does not."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        args = self.args
        self.device, self.tokenizer, self.model, self.optimizer, self.scheduler = setup(args, hold_save=hold_save)
        self.checkpoint_config = CheckpointConfig.from_args(args)
        self.config = LoopConfig.from_args(args)
        # the components' views, read after set-up (it sets the padded vocabulary that ModelSize and wandb read)
        self.rampup = BatchRampup.from_args(args)
        self.logging = LoggingConfig.from_args(args)
        self.model_size = ModelSize.from_args(args)
        self.aux_losses = AuxLossConfig.from_args(args)
        self.train_ds, self.valid_ds, _test_ds = data.build_datasets(DataConfig.from_args(args), self.tokenizer)
        summary(args, self.model, self.optimizer)
        self.board = ScalarWriters(self.logging)
        self.timers = IterationTimers(self.logging.log_timers_to_tensorboard)
        time_grad_sync(self.model, self.timers)
        self.forward_backward = get_forward_backward_func()
        self.forward_step = gpt_step.make_forward_step(self.device)
        self.saver = CheckpointSaver(self.checkpoint_config)
        self.controls = LoopControls(self.config, self.job_start)

    def close(self) -> None:
        """Release ``--save``'s lock and the non-persistent directories (``checkpointing/ownership.py``)."""
        checkpointing.release_save_directory()  # also after a build that failed once the locks were taken
        non_persistent.release()

    # ------------------------------------------------------------------ pieces of the loop
    def evaluate(self, iteration: int, note: str = "") -> Optional[float]:
        """The validation loss at ``iteration`` (None without a validation set), logged and on the board."""
        c = self.config
        valid = gpt_step.evaluate(self.forward_backward, self.forward_step, self.model, self.valid_ds, c,
                         (iteration // c.eval_interval - 1) * c.eval_iters * c.global_batch_size)
        if valid is not None:
            self.board.scalars(iteration, validation_scalars(self.logging, valid))
            print_rank_0(f" validation loss at iteration {iteration}{note} | lm loss value: {valid:.6E} |")
        return valid

    def load(self) -> Tuple[int, int]:
        """``--load`` (the newer of it and the non-persistent checkpoint); then no save may overwrite a newer
        checkpoint. Returns ``(iteration, consumed samples)``."""
        c, checkpoint = self.config, self.checkpoint_config
        start, consumed = non_persistent.load_checkpoint(checkpoint, self.model, self.optimizer, self.scheduler) \
            if checkpoint.load else (0, 0)
        checkpointing.check_save_directory(checkpoint, start)
        non_persistent.check_newer(checkpoint, start)
        valid = None
        if checkpoint.load and start and c.eval_interval and start % c.eval_interval == 0:
            # The saved run logged this validation loss too: equal values show the load is complete.
            valid = self.evaluate(start, " (loaded checkpoint)")
        self._report("loaded", start, valid)
        return start, consumed

    def train_step(self, iteration: int, consumed: int) -> Tuple[StepResult, Optional[int], Optional[float]]:
        """One iteration from ``consumed`` samples: forward-backward over the global batch's micro-batches, the
        optimizer step and the schedule. Returns the step, the zeros counted in the gradients and the params norm."""
        c = self.config
        start = time.perf_counter()
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        batch = self.rampup.global_batch_at(consumed)  # --rampup-batch-size: this iteration's global batch
        model = self.model if len(self.model) > 1 else self.model[0]
        reduced = self.timers.wrap("forward-backward", self.forward_backward)(
            forward_step_func=self.forward_step,
            data_iterator=gpt_step.micro_batches(self.model, self.train_ds, c.micro_batch_size, consumed),
            model=model, num_microbatches=batch // (c.micro_batch_size * c.data_parallel_size),
            seq_length=c.seq_length, micro_batch_size=c.micro_batch_size, decoder_seq_length=c.seq_length,
            forward_only=False)
        self.controls.after_forward_backward()
        self.saver.before_optimizer_step()  # a save in flight may still be copying what the step changes
        ok, grad_norm, num_zeros = self.timers.wrap("optimizer", self.optimizer.step)()
        self.controls.after_step(iteration)
        self.profiler.step()
        params_norm = model_lib.params_norm(self.model, self.optimizer) if self.logging.log_params_norm else None
        self.scheduler.step(increment=batch)
        losses = {"lm loss": gpt_step.mean_loss(reduced), **mtp_losses(self.aux_losses, self.device),
                  **moe_aux_losses(self.aux_losses, self.device)}
        step = StepResult(iteration, losses, None if grad_norm is None else float(grad_norm), not ok,
                          self.optimizer.param_groups[0]["lr"], batch, time.perf_counter() - start)
        return step, num_zeros, params_norm

    def _log_step(self, step: StepResult, num_zeros, params_norm, interval: IntervalLog, consumed: int) -> Optional[float]:
        """The board's scalars every iteration and Megatron-LM's iteration line every ``--log-interval``; returns
        the highest peak memory over ranks when a line was printed."""
        c = self.config
        rates = throughput(self.model_size, step.seconds, dist.get_world_size(), step.batch) \
            if self.logging.log_throughput else None
        peak_mib = memory_mib()["peak"]  # one reading for the board and the log line
        self.board.scalars(step.iteration, iteration_scalars(step, rates, peak_mib))
        self.board.scalars(step.iteration, self.timers.take())
        self.board.scalars(step.iteration, extra_scalars(self.logging, num_zeros, params_norm, memory_mib()))
        if step.iteration % c.log_interval:
            return None
        fields = interval.fields(step.iteration, c.train_iters, consumed, step.learning_rate, step.batch,
                                 step.grad_norm)
        for name, value in reversed(extra_fields(self.logging, num_zeros, params_norm)):
            insert_field(fields, name, value, after="grad norm")
        if self.logging.log_throughput:  # over the interval, after the elapsed time, where Megatron-LM prints it
            rates = throughput(self.model_size, interval.seconds / max(1, interval.iterations), dist.get_world_size(),
                               step.batch)
            for name, value in reversed(rates.log_fields()):
                insert_field(fields, name, value, after="elapsed time per iteration (ms)")
        print_rank_0(format_fields(fields))
        interval.reset()
        peaks = [row[0] for row in gather_per_rank([peak_mib])]
        print_rank_0(" " + memory_line(peaks))
        reset_peak_memory()
        return max(peaks)

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Load, then train from the loaded iteration to ``--train-iters`` (or an exit condition); returns the last
        iteration. The saver is abandoned (no collective) if the loop raises; the profiler and controls stop."""
        start, consumed = self.load()
        self.saver.prepare(self.model, self.optimizer)  # --async-save: its host staging buffers, once
        self.profiler = Profiler(self.logging, dist.get_rank(), start)
        try:
            return self._loop(start, consumed)
        except BaseException:
            self.saver.abandon()  # no collective: another rank may be elsewhere
            raise
        finally:  # the process lives on after a failed run (a test pool's worker): its collector back on
            self.profiler.stop()
            self.controls.close()
            self.board.close()

    def _loop(self, start: int, consumed: int) -> int:
        c = self.config
        saved_at, consumed_at_start = start, consumed
        exit_signal = ExitSignalHandler() if c.exit_signal_handler else None
        for chunk in self.model:
            chunk.train()
        iteration = start
        interval, highest_peak, trained_seconds, loop_start = IntervalLog(), 0.0, 0.0, time.perf_counter()
        reset_peak_memory()
        for iteration in range(start + 1, c.train_iters + 1):
            step, num_zeros, params_norm = self.train_step(iteration, consumed)
            consumed += step.batch
            trained_seconds += step.seconds
            interval.add(step.seconds, dict(step.losses), skipped=step.skipped)
            self._report("stepped", step)
            if iteration == start + 1:  # the optimizer state exists only now
                line = persistent_line(self.model, self.optimizer)
                if line is not None:
                    print_rank_0(" " + line)
            peak = self._log_step(step, num_zeros, params_norm, interval, consumed)
            highest_peak = max(highest_peak, peak or 0.0)
            if c.eval_interval and iteration % c.eval_interval == 0:
                self.controls.around_evaluation()
                valid = self.evaluate(iteration)
                self.controls.around_evaluation()
                if valid is not None:
                    self._report("validated", iteration, valid)
            out_of_time = self.controls.out_of_time()
            exiting = (bool(c.exit_interval) and iteration % c.exit_interval == 0) or out_of_time
            if c.save and ((c.save_interval and iteration % c.save_interval == 0) or exiting):
                self.saver.save(iteration, consumed, self.model, self.optimizer, self.scheduler)
                saved_at = iteration
            elif non_persistent.due(self.checkpoint_config, iteration):  # as Megatron-LM: where no persistent save runs
                self.saver.wait(iteration)  # --async-save: a persistent save in flight first
                non_persistent.save(self.checkpoint_config, iteration, consumed, self.model, self.optimizer,
                                    self.scheduler)
            else:
                self.saver.poll(iteration)
            if exiting:
                why = f"--exit-duration-in-mins {c.exit_duration_in_mins}" if out_of_time else \
                    f"--exit-interval {c.exit_interval}"
                print_rank_0(f" exiting after iteration {iteration} ({why})")
                break
            if exit_signal is not None and exit_signal.any_rank_received():
                if saved_at < iteration:
                    self.saver.save(iteration, consumed, self.model, self.optimizer, self.scheduler)
                    saved_at = iteration
                print_rank_0(f" exiting after iteration {iteration}: SIGTERM received (--exit-signal-handler), "
                             "checkpoint saved")
                break
        if c.save and iteration > saved_at:
            self.saver.save(iteration, consumed, self.model, self.optimizer, self.scheduler)
        self.saver.wait(iteration)  # the end of training (or --exit-interval) waits for the write in flight
        if exit_signal is not None:
            exit_signal.close()
        highest_peak = max([highest_peak] + [row[0] for row in gather_per_rank([memory_mib()["peak"]])])
        done = iteration - start
        print_rank_0(end_of_run_line(done, time.perf_counter() - loop_start, trained_seconds,
                                     (consumed - consumed_at_start) * c.seq_length, highest_peak))
        self._report("finished", done, highest_peak)
        return iteration

    def _report(self, event: str, *values) -> None:
        for observer in self.observers:
            getattr(observer, event)(self, *values)


def time_grad_sync(model, timers: IterationTimers) -> None:
    """``all-grads-sync``: the schedule's finalize_model_grads (data-parallel and model-parallel grad reductions)."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    config.finalize_model_grads_func = timers.wrap("all-grads-sync", config.finalize_model_grads_func)


def iteration_scalars(step, rates, peak_mib) -> dict:
    """The iteration line's values under Megatron-LM's TensorBoard names (every loss under its own name)."""
    values = {**step.losses, "learning-rate": step.learning_rate, "grad-norm": step.grad_norm, "batch-size": step.batch,
              "iteration-time": step.seconds, "mem-max-allocated-bytes": peak_mib * 2**20}
    if rates is not None:
        values.update({"throughput": rates.tflops_per_gpu, "tokens-per-second-per-rank": rates.tokens_per_second_per_rank})
    return values

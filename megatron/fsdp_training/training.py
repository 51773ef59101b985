"""The training loop: Megatron-LM's ``train`` over ``get_forward_backward_func``, with evaluation and logs."""

from __future__ import annotations

if __name__ == "__main__":  # `python -m megatron.fsdp_training.training`: the job, as `-m megatron.fsdp_training`
    from megatron.fsdp.commands import set_command_defaults  # before this file imports Megatron-Core

    set_command_defaults()
    from megatron.fsdp_training.training import main

    raise SystemExit(main())

import functools
import time
from typing import List, Optional

import torch
import torch.distributed as dist

from .checkpointing import non_persistent, save_load as checkpointing
from .data import datasets as data
from . import model as model_lib
from .checkpointing.async_save import CheckpointSaver
from .checkpointing.files import CheckpointError
from .arguments.precision import fp8_start_up_line
from .initialize import announce_substitutions, initialize, shutdown
from .logs.lines import IntervalLog, end_of_run_line, format_fields, gather_per_rank, insert_field, memory_line, memory_mib, persistent_line, print_rank_0, reset_peak_memory, summary
from .logs.moe_losses import moe_aux_losses, mtp_losses
from .signal_handler import ExitSignalHandler
from .logs.throughput import throughput
from .logs.timers import IterationTimers
from .logs.writers import ScalarWriters
from .loop_controls import LoopControls, extra_fields, extra_scalars, validation_scalars
from .profiling import Profiler
from .schedule import global_batch_at


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked token loss ``(loss sum x cp, token count, report)``, correct under context parallelism."""
    from megatron.core import parallel_state as ps

    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    local = torch.sum(losses * mask)
    report = torch.stack([local.detach(), mask.sum()])
    cp = ps.get_context_parallel_world_size()
    if cp > 1:
        dist.all_reduce(report, group=ps.get_context_parallel_group())
    return local * cp, report[1].clone().to(torch.int), {"lm loss": report}


def make_forward_step(device):
    def forward_step(data_iterator, model):
        batch = data.get_batch(data_iterator, device)
        output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
        return output, functools.partial(loss_func, batch["loss_mask"])
    return forward_step


def _mean_loss(losses_reduced: List[dict]) -> float:
    """Mean token loss of the global batch, the same on every rank."""
    from megatron.core import parallel_state as ps

    value = torch.zeros(2, dtype=torch.float64)
    if ps.is_pipeline_last_stage(ignore_virtual=True) and losses_reduced:
        reports = torch.stack([r["lm loss"].double().cpu() for r in losses_reduced])
        value[0] = (reports[:, 0] / reports[:, 1].clamp(min=1)).sum()
        value[1] = len(losses_reduced)
        dist.all_reduce(value, group=ps.get_data_parallel_group())
    dist.broadcast(value, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return float(value[0] / max(value[1], 1))


def _iterators(model, dataset, args, consumed: int):
    its = [data.MicroBatches(dataset, args, consumed) for _ in model]
    return its if len(its) > 1 else its[0]


def evaluate(forward_backward, forward_step, model, dataset, args, consumed: int) -> Optional[float]:
    if dataset is None or args.eval_iters == 0:
        return None
    for chunk in model:
        chunk.eval()
    losses = []
    with torch.no_grad():
        for k in range(args.eval_iters):
            reduced = forward_backward(
                forward_step_func=forward_step, data_iterator=_iterators(model, dataset, args,
                                                                         consumed + k * args.global_batch_size),
                model=model if len(model) > 1 else model[0], num_microbatches=args.num_micro_batches,
                seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                decoder_seq_length=args.seq_length, forward_only=True)
            losses.append(_mean_loss(reduced))
    for chunk in model:
        chunk.train()
    return sum(losses) / len(losses)


def setup(args, hold_save: bool = False):
    """Process groups, tokenizer, model chunks, optimizer and LR schedule: everything a checkpoint restores.

    ``hold_save``: take ``--save``'s lock first (the training job; tests that build the pieces do not).
    Returns ``(device, tokenizer, model chunks, optimizer, scheduler)``.
    """
    device = initialize(args)
    if hold_save:
        checkpointing.hold_save_directory(args)  # a second job with this --save stops here, naming the first
        non_persistent.hold(args)  # and one with these non-persistent directories
    announce_substitutions(args)
    fp8_line = fp8_start_up_line(args)
    if fp8_line:
        print_rank_0(fp8_line)
    cpu = device.type == "cpu"
    tokenizer = data.build_tokenizer(args)
    try:
        data.check_vocabulary(args, tokenizer.vocab_size)
    except ValueError as exc:  # the same on every rank: one line, as the start-up checks give
        from .errors import ArgumentError

        raise ArgumentError(str(exc)) from None
    args.true_vocab_size = tokenizer.vocab_size  # checkpoints cut or add padding rows against it
    vocab = args.padded_vocab_size = data.padded_vocab_size(tokenizer.vocab_size, args)
    config = model_lib.transformer_config(args, cpu)
    chunks = model_lib.build_model_chunks(args, config, vocab, cpu)
    model, optimizer, wire = model_lib.wrap_and_optimize(args, config, chunks)
    print_rank_0(f" > model built{' on the meta device, materialised unit by unit' if args.init_model_with_meta_device else ''}"
                 f" | build {memory_line()}")
    scheduler = model_lib.scheduler(args, optimizer)
    wire()
    return device, tokenizer, model, optimizer, scheduler


def pretrain(args) -> dict:
    """Train a GPT as Megatron-LM does; returns the per-iteration losses and grad norms (for tests).

    ``--save``'s lock (``checkpointing/ownership.py``) is held from ``setup`` to the end, however it ends.
    """
    try:
        return _pretrain(args)
    finally:
        checkpointing.release_save_directory(args)
        non_persistent.release(args)


def _pretrain(args) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    job_start = time.perf_counter()  # --exit-duration-in-mins counts from here, as Megatron-LM's pretrain
    device, tokenizer, model, optimizer, scheduler = setup(args, hold_save=True)
    train_ds, valid_ds, _test_ds = data.build_datasets(args, tokenizer)
    summary(args, model, optimizer)
    board = ScalarWriters(args)
    timers = IterationTimers(args.log_timers_to_tensorboard)
    _time_grad_sync(model, timers)
    forward_backward = get_forward_backward_func()
    forward_step = make_forward_step(device)
    history = {"losses": [], "grad_norms": [], "valid": [], "start_iteration": 0, "valid_at_load": None}

    def validate(iteration: int, note: str = "") -> Optional[float]:
        valid = evaluate(forward_backward, forward_step, model, valid_ds, args,
                         (iteration // args.eval_interval - 1) * args.eval_iters * args.global_batch_size)
        if valid is not None:
            board.scalars(iteration, validation_scalars(args, valid))
            print_rank_0(f" validation loss at iteration {iteration}{note} | lm loss value: {valid:.6E} |")
        return valid

    start_iteration, consumed = 0, 0
    if args.load:
        # the newer of --load's and the non-persistent checkpoint
        start_iteration, consumed = non_persistent.load_checkpoint(args, model, optimizer, scheduler)
        history["start_iteration"] = start_iteration
    checkpointing.check_save_directory(args, start_iteration)  # no save may overwrite a newer checkpoint
    non_persistent.check_newer(args, start_iteration)
    if args.load and start_iteration and args.eval_interval and start_iteration % args.eval_interval == 0:
        # The saved run logged this validation loss too: equal values show the load is complete.
        history["valid_at_load"] = validate(start_iteration, " (loaded checkpoint)")
    saver = CheckpointSaver(args)
    saver.prepare(model, optimizer)  # --async-save: its host staging buffers, once
    controls, profiler = LoopControls(args, job_start), Profiler(args, dist.get_rank(), start_iteration)
    try:
        _train(args, device, model, optimizer, scheduler, forward_backward, forward_step, train_ds, board, timers,
               history, validate, saver, start_iteration, consumed, controls, profiler)
    except BaseException:
        saver.abandon()  # no collective: another rank may be elsewhere
        raise
    finally:  # the process lives on after a failed run (a test pool's worker): its collector back on
        profiler.stop()
        controls.close()
    board.close()
    history["expert_bias"] = model_lib.expert_biases(model)
    history["fp8_scales"] = model_lib.fp8_scales(model)
    return history


def _train(args, device, model, optimizer, scheduler, forward_backward, forward_step, train_ds, board,
           timers: IterationTimers, history, validate, saver: CheckpointSaver, start_iteration: int,
           consumed: int, controls: LoopControls, profiler: Profiler) -> int:
    """The iterations from ``start_iteration``; returns the last one (saves through ``saver``)."""
    saved_at = start_iteration
    exit_signal = ExitSignalHandler() if args.exit_signal_handler else None
    for chunk in model:
        chunk.train()
    iteration, consumed_at_start = start_iteration, consumed
    interval, highest_peak, trained_seconds, loop_start = IntervalLog(), 0.0, 0.0, time.perf_counter()
    reset_peak_memory()
    for iteration in range(start_iteration + 1, args.train_iters + 1):
        start = time.perf_counter()
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        batch = global_batch_at(args, consumed)  # --rampup-batch-size: this iteration's global batch
        reduced = timers.wrap("forward-backward", forward_backward)(
            forward_step_func=forward_step, data_iterator=_iterators(model, train_ds, args, consumed),
            model=model if len(model) > 1 else model[0],
            num_microbatches=batch // (args.micro_batch_size * args.data_parallel_size),
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            decoder_seq_length=args.seq_length, forward_only=False)
        controls.after_forward_backward()
        saver.before_optimizer_step()  # a save in flight may still be copying what the step changes
        ok, grad_norm, num_zeros = timers.wrap("optimizer", optimizer.step)()
        controls.after_step(iteration)
        profiler.step()
        norm_of_params = model_lib.params_norm(model, optimizer) if args.log_params_norm else None
        consumed += batch
        scheduler.step(increment=batch)
        losses = {"lm loss": _mean_loss(reduced), **mtp_losses(args, device), **moe_aux_losses(args, device)}
        elapsed = time.perf_counter() - start
        trained_seconds += elapsed
        interval.add(elapsed, losses, skipped=not ok)
        lr = optimizer.param_groups[0]["lr"]
        history["losses"].append(losses["lm loss"])
        history["grad_norms"].append(None if grad_norm is None else float(grad_norm))
        for name, value in losses.items():
            if name != "lm loss":
                history.setdefault(name, []).append(value)
        rates = throughput(args, elapsed, dist.get_world_size(), batch) if args.log_throughput else None
        peak_mib = memory_mib()["peak"]  # one reading for the board and the log line
        board.scalars(iteration, _iteration_scalars(args, losses, grad_norm, lr, elapsed, rates, peak_mib, batch))
        board.scalars(iteration, timers.take())
        board.scalars(iteration, extra_scalars(args, num_zeros, norm_of_params, memory_mib()))
        if iteration == start_iteration + 1:  # the optimizer state exists only now
            line = persistent_line(args, model, optimizer)
            if line is not None:
                print_rank_0(" " + line)
        if iteration % args.log_interval == 0:
            fields = interval.fields(iteration, args.train_iters, consumed, lr, batch, grad_norm)
            for name, value in reversed(extra_fields(args, num_zeros, norm_of_params)):
                insert_field(fields, name, value, after="grad norm")
            if args.log_throughput:  # over the interval, after the elapsed time, where Megatron-LM prints it
                rates = throughput(args, interval.seconds / max(1, interval.iterations), dist.get_world_size(), batch)
                for name, value in reversed(rates.log_fields()):
                    insert_field(fields, name, value, after="elapsed time per iteration (ms)")
            print_rank_0(format_fields(fields))
            interval.reset()
            peaks = [row[0] for row in gather_per_rank([peak_mib])]
            highest_peak = max([highest_peak] + peaks)
            print_rank_0(" " + memory_line(peaks))
            reset_peak_memory()
        if args.eval_interval and iteration % args.eval_interval == 0:
            controls.around_evaluation()
            valid = validate(iteration)
            controls.around_evaluation()
            if valid is not None:
                history["valid"].append(valid)
        out_of_time = controls.out_of_time()
        exiting = (bool(args.exit_interval) and iteration % args.exit_interval == 0) or out_of_time
        if args.save and ((args.save_interval and iteration % args.save_interval == 0) or exiting):
            saver.save(iteration, consumed, model, optimizer, scheduler)
            saved_at = iteration
        elif non_persistent.due(args, iteration):  # as Megatron-LM: where no persistent save runs
            saver.wait(iteration)  # --async-save: a persistent save in flight first (non-persistent ones are sync)
            non_persistent.save(args, iteration, consumed, model, optimizer, scheduler)
        else:
            saver.poll(iteration)
        if exiting:
            why = f"--exit-duration-in-mins {args.exit_duration_in_mins}" if out_of_time else \
                f"--exit-interval {args.exit_interval}"
            print_rank_0(f" exiting after iteration {iteration} ({why})")
            break
        if exit_signal is not None and exit_signal.any_rank_received():
            if saved_at < iteration:
                saver.save(iteration, consumed, model, optimizer, scheduler)
                saved_at = iteration
            print_rank_0(f" exiting after iteration {iteration}: SIGTERM received (--exit-signal-handler), "
                         "checkpoint saved")
            break
    if args.save and iteration > saved_at:
        saver.save(iteration, consumed, model, optimizer, scheduler)
    saver.wait(iteration)  # the end of training (or --exit-interval) waits for the write in flight
    if exit_signal is not None:
        exit_signal.close()
    highest_peak = max([highest_peak] + [row[0] for row in gather_per_rank([memory_mib()["peak"]])])
    done = iteration - start_iteration
    history.update(max_peak_mib=highest_peak, iterations=done)
    print_rank_0(end_of_run_line(done, time.perf_counter() - loop_start, trained_seconds,
                                 (consumed - consumed_at_start) * args.seq_length, highest_peak))
    return iteration


def _time_grad_sync(model, timers: IterationTimers) -> None:
    """``all-grads-sync``: the schedule's finalize_model_grads (data-parallel and model-parallel grad reductions)."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    config.finalize_model_grads_func = timers.wrap("all-grads-sync", config.finalize_model_grads_func)


def _iteration_scalars(args, losses, grad_norm, lr, elapsed_seconds, rates, peak_mib, batch: int) -> dict:
    """The iteration line's values under Megatron-LM's TensorBoard names (every loss under its own name)."""
    values = {**losses, "learning-rate": lr, "grad-norm": grad_norm, "batch-size": batch,
              "iteration-time": elapsed_seconds, "mem-max-allocated-bytes": peak_mib * 2**20}
    if rates is not None:
        values.update({"throughput": rates.tflops_per_gpu, "tokens-per-second-per-rank": rates.tokens_per_second_per_rank})
    return values


def main(argv=None) -> None:
    from .arguments import parse_args

    run_entry_point(lambda command_line: pretrain(parse_args(command_line)), argv)


def run_entry_point(body, args):
    """``body(args)`` as a command runs it: a user error is one line (rank 0) and exit code 2, and the
    process groups are shut down however it ends (the training job, the generation tool)."""
    from .errors import ArgumentError

    try:
        return body(args)
    except (ArgumentError, CheckpointError) as exc:
        print_rank_0(f"error: {exc}")
        raise SystemExit(2)
    finally:
        if dist.is_initialized():
            shutdown()

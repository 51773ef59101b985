"""The training loop: Megatron-LM's ``train`` over ``get_forward_backward_func``, with evaluation and logs."""

from __future__ import annotations

import functools
import time
from typing import List, Optional

import torch
import torch.distributed as dist

from . import checkpointing, data, model as model_lib
from .checkpoint_files import CheckpointError
from .initialize import initialize, shutdown
from .logging_utils import TensorBoard, iteration_line, memory_line, print_rank_0, summary
from .signal_handler import ExitSignalHandler


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


def setup(args):
    """Process groups, tokenizer, model chunks, optimizer and LR schedule: everything a checkpoint restores.

    Returns ``(device, tokenizer, model chunks, optimizer, scheduler)``.
    """
    device = initialize(args)
    cpu = device.type == "cpu"
    tokenizer = data.build_tokenizer(args)
    vocab = args.padded_vocab_size = data.padded_vocab_size(tokenizer.vocab_size, args)
    config = model_lib.transformer_config(args, cpu)
    chunks = model_lib.build_model_chunks(args, config, vocab, cpu)
    model, optimizer, wire = model_lib.wrap_and_optimize(args, config, chunks)
    scheduler = model_lib.scheduler(args, optimizer)
    wire()
    return device, tokenizer, model, optimizer, scheduler


def pretrain(args) -> dict:
    """Train a GPT as Megatron-LM does; returns the per-iteration losses and grad norms (for tests)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device, tokenizer, model, optimizer, scheduler = setup(args)
    train_ds, valid_ds, _test_ds = data.build_datasets(args, tokenizer)
    summary(args, model, optimizer)
    board = TensorBoard(args.tensorboard_dir)
    forward_backward = get_forward_backward_func()
    forward_step = make_forward_step(device)
    history = {"losses": [], "grad_norms": [], "valid": [], "start_iteration": 0, "valid_at_load": None}

    def validate(iteration: int, note: str = "") -> Optional[float]:
        valid = evaluate(forward_backward, forward_step, model, valid_ds, args,
                         (iteration // args.eval_interval - 1) * args.eval_iters * args.global_batch_size)
        if valid is not None:
            board.scalars(iteration, {"lm loss validation": valid})
            print_rank_0(f" validation loss at iteration {iteration}{note} | lm loss value: {valid:.6E} |")
        return valid

    start_iteration, consumed, skipped = 0, 0, 0
    if args.load:
        start_iteration, consumed = checkpointing.load_checkpoint(args, model, optimizer, scheduler)
        history["start_iteration"] = start_iteration
        if start_iteration and args.eval_interval and start_iteration % args.eval_interval == 0:
            # The saved run logged this validation loss too: equal values show the load is complete.
            history["valid_at_load"] = validate(start_iteration, " (loaded checkpoint)")
    saved_at = start_iteration
    exit_signal = ExitSignalHandler() if args.exit_signal_handler else None
    for chunk in model:
        chunk.train()
    iteration = start_iteration
    for iteration in range(start_iteration + 1, args.train_iters + 1):
        start = time.perf_counter()
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = forward_backward(
            forward_step_func=forward_step, data_iterator=_iterators(model, train_ds, args, consumed),
            model=model if len(model) > 1 else model[0], num_microbatches=args.num_micro_batches,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            decoder_seq_length=args.seq_length, forward_only=False)
        ok, grad_norm, _zeros = optimizer.step()
        skipped += 0 if ok else 1
        consumed += args.global_batch_size
        scheduler.step(increment=args.global_batch_size)
        loss = _mean_loss(reduced)
        elapsed = (time.perf_counter() - start) * 1000
        lr = optimizer.param_groups[0]["lr"]
        history["losses"].append(loss)
        history["grad_norms"].append(None if grad_norm is None else float(grad_norm))
        board.scalars(iteration, {"lm loss": loss, "grad norm": grad_norm, "learning rate": lr})
        if iteration % args.log_interval == 0:
            print_rank_0(iteration_line(iteration, args.train_iters, consumed, elapsed, lr, args.global_batch_size,
                                        loss, grad_norm, skipped))
            if iteration == start_iteration + args.log_interval:
                line = memory_line()
                print_rank_0(" " + line)
        if args.eval_interval and iteration % args.eval_interval == 0:
            valid = validate(iteration)
            if valid is not None:
                history["valid"].append(valid)
        exiting = bool(args.exit_interval) and iteration % args.exit_interval == 0
        if args.save and ((args.save_interval and iteration % args.save_interval == 0) or exiting):
            checkpointing.save_checkpoint(args, iteration, consumed, model, optimizer, scheduler)
            saved_at = iteration
        if exiting:
            print_rank_0(f" exiting after iteration {iteration} (--exit-interval {args.exit_interval})")
            break
        if exit_signal is not None and exit_signal.any_rank_received():
            if saved_at < iteration:
                checkpointing.save_checkpoint(args, iteration, consumed, model, optimizer, scheduler)
                saved_at = iteration
            print_rank_0(f" exiting after iteration {iteration}: SIGTERM received (--exit-signal-handler), "
                         "checkpoint saved")
            break
    if args.save and iteration > saved_at:
        checkpointing.save_checkpoint(args, iteration, consumed, model, optimizer, scheduler)
    board.close()
    if exit_signal is not None:
        exit_signal.close()
    return history


def main(argv=None) -> None:
    from .arguments import ArgumentError, parse_args

    args = parse_args(argv)
    try:
        pretrain(args)
    except (ArgumentError, CheckpointError) as exc:
        print_rank_0(f"error: {exc}")
        raise SystemExit(2)
    finally:
        if dist.is_initialized():
            shutdown()

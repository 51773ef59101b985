"""The forward step of the GPT the job trains, its loss (masked tokens, right under context parallelism) and the
validation over it: what ``get_forward_backward_func`` calls, and how a global batch's loss is reduced."""

from __future__ import annotations

import functools
import math
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.fsdp.collectives.simulation import is_fake

from .data import datasets as data


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


def mean_loss(losses_reduced: List[dict]) -> float:
    """Mean token loss of the global batch, the same on every rank."""
    from megatron.core import parallel_state as ps

    value = torch.zeros(2, dtype=torch.float64)
    if ps.is_pipeline_last_stage(ignore_virtual=True) and losses_reduced:
        reports = torch.stack([r["lm loss"].double().cpu() for r in losses_reduced])
        value[0] = (reports[:, 0] / reports[:, 1].clamp(min=1)).sum()
        value[1] = len(losses_reduced)
        dist.all_reduce(value, group=ps.get_data_parallel_group())
    dist.broadcast(value, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    if is_fake(value):
        return math.nan  # a simulated step (fake tensors) has no loss value
    return float(value[0] / max(value[1], 1))


def micro_batches(model, dataset, micro_batch_size: int, consumed: int):
    """This rank's micro-batches from ``consumed`` samples on: one iterator per model chunk (virtual pipeline)."""
    its = [data.MicroBatches(dataset, micro_batch_size, consumed) for _ in model]
    return its if len(its) > 1 else its[0]


def evaluate(forward_backward, forward_step, model, dataset, config, consumed: int) -> Optional[float]:
    """The mean validation loss over ``eval_iters`` global batches from ``consumed`` samples; None without a
    validation set. ``config``: the loop's ``trainer.LoopConfig`` (``eval_iters``, ``global_batch_size``,
    ``num_micro_batches``, ``seq_length``, ``micro_batch_size``)."""
    c = config
    if dataset is None or c.eval_iters == 0:
        return None
    for chunk in model:
        chunk.eval()
    losses = []
    with torch.no_grad():
        for k in range(c.eval_iters):
            reduced = forward_backward(
                forward_step_func=forward_step, data_iterator=micro_batches(model, dataset, c.micro_batch_size,
                                                                         consumed + k * c.global_batch_size),
                model=model if len(model) > 1 else model[0], num_microbatches=c.num_micro_batches,
                seq_length=c.seq_length, micro_batch_size=c.micro_batch_size,
                decoder_seq_length=c.seq_length, forward_only=True)
            losses.append(mean_loss(reduced))
    for chunk in model:
        chunk.train()
    return sum(losses) / len(losses)

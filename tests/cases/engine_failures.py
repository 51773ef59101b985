"""Failure cases (run inside the worker pool): replicas, collective timeouts, misuse."""

from __future__ import annotations

import torch

import megatron.fsdp as mfsdp
from megatron.fsdp.testing.models import Block, TinyLM, make_batches


def replicas_built_differently(ctx, strategy: str, steps: int = 3):
    """Each rank builds the model with its own seed; after the wrap and after training, all equal rank 0's."""
    torch.manual_seed(ctx.rank)
    module = TinyLM()
    with torch.no_grad():
        module.frozen_scale.fill_(1.0 + ctx.rank)  # a frozen parameter: no step would ever fix it
    torch.manual_seed(0)
    reference = {k: v.clone() for k, v in TinyLM().state_dict().items()}
    model = mfsdp.fully_shard(module, strategy=strategy, process_group=ctx.group, unit_modules=(Block,))
    at_wrap = model.full_state_dict()
    optimizer = mfsdp.FullyShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    for step in make_batches(steps, 1, 2 * ctx.size):
        tokens, targets = step[0]
        n = tokens.shape[0] // ctx.size
        model(tokens[ctx.rank * n:(ctx.rank + 1) * n], targets[ctx.rank * n:(ctx.rank + 1) * n]).backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = model.full_state_dict()
    return {
        "wrap_equals_rank0_build": all(torch.equal(at_wrap[k], reference[k]) for k in at_wrap if k in reference),
        "trained": {k: v for k, v in trained.items() if k != "causal_offset"},
        "broadcasts": model.ledger.calls("broadcast"),
    }


def collective_on_one_rank(ctx, timeout_s: float = 3.0):
    """Rank 0 alone calls ``full_state_dict`` (a collective under ZeRO-3): it must fail naming the call, not hang."""
    import datetime

    import torch.distributed as dist

    group = dist.new_group(list(range(ctx.size)), timeout=datetime.timedelta(seconds=timeout_s))
    try:
        model = mfsdp.fully_shard(TinyLM(), strategy="optim_grads_params", process_group=group, unit_modules=(Block,))
        if ctx.rank != 0:
            return None
        try:
            model.full_state_dict()
        except mfsdp.CollectiveError as exc:
            return str(exc)
        return "nothing raised"
    finally:
        dist.destroy_process_group(group)


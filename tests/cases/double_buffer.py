"""``fully_shard(double_buffer=True)``: the same training with and without persistent gather buffers."""

from __future__ import annotations

import dataclasses

import megatron.fsdp as mfsdp
from megatron.fsdp.testing.engine_training import RunConfig, make_batches, train_step, wrap, GLOBAL_MICRO_BATCH


def _at_its_buffer(storage):
    buffer = storage.gather_buffer
    return None if buffer is None else storage.full.data_ptr() == buffer.tensor.data_ptr()


def _train(ctx, cfg: RunConfig, **fully_shard_kwargs) -> dict:
    """Train ``cfg``; also, per unit, whether its weights were at its gather buffer's address at every forward."""
    fsdp, opt = wrap(ctx, cfg, **fully_shard_kwargs)
    addresses = {unit.name: set() for unit in fsdp.units if unit.storage.releases}
    for unit in fsdp.units:
        if unit.name in addresses and unit.name != "<root>":
            unit.module.register_forward_hook(
                lambda _m, _a, _o, u=unit: addresses[u.name].add(_at_its_buffer(u.storage)))
    losses, norms = [], []
    for step in make_batches(cfg.steps, cfg.micro_batches, GLOBAL_MICRO_BATCH):
        loss, norm = train_step(ctx, fsdp, opt, step, cfg)
        losses.append(loss)
        norms.append(norm)
    params = fsdp.full_state_dict()  # a collective: every rank
    buffers = {id(u.storage.gather_buffer) for u in fsdp.units if u.storage.gather_buffer is not None}
    return {"losses": losses, "grad_norms": norms, "params": params if ctx.rank == 0 else None,
            "at_buffer": {name: sorted(found, key=str) for name, found in addresses.items() if found},
            "buffers": len(buffers), "compute_bytes": fsdp.memory_report().compute_weights,
            "buffered_units": [u.name for u in fsdp.units if u.storage.gather_buffer is not None]}


def with_and_without(ctx, prefetch: int = 1, **cfg_fields) -> dict:
    """The run without double buffering, then with it (same model, batches, seed)."""
    cfg = dataclasses.replace(RunConfig(), **cfg_fields)
    overlap = dict(overlap=mfsdp.Overlap(forward_prefetch=prefetch, backward_prefetch=prefetch))
    return {"plain": _train(ctx, cfg, **overlap), "double": _train(ctx, cfg, double_buffer=True, **overlap)}

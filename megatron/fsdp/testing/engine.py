"""Engine cases that ``tools/engine_report.py`` runs and the tests check: gradient traffic and memory per rank.

Each runs inside the gloo worker pool and returns plain data with the closed-form amounts beside
the measured ones; the assertions live in the test modules. Cases only the tests run live in tests/.
"""

from __future__ import annotations

import dataclasses

import megatron.fsdp as mfsdp
from megatron.fsdp.testing.engine_training import GLOBAL_MICRO_BATCH, RunConfig, build_model, local_slice, train_step, wrap
from megatron.fsdp.testing.models import make_batches


GRAD_KINDS = ("reduce_scatter", "all_reduce")


def grad_traffic(ctx, strategy: str, micro_batches: int, mesh=None, outer_strategy=None):
    """Per axis: gradient-reduction calls after each micro-batch, bytes per step, and theory."""
    cfg = RunConfig(strategy=strategy, micro_batches=micro_batches, steps=1, hidden=64,
                    mesh=mesh, outer_strategy=outer_strategy)
    fsdp, opt = wrap(ctx, cfg)
    fsdp.ledger.trace = True
    fsdp.ledger.reset()
    calls_after = {"dp_shard": [], "dp_outer": []}

    def grad_events(axis):
        return [e for e in fsdp.ledger.events if e.axis == axis and e.kind in GRAD_KINDS and e.tag != "grad_norm"]

    def snapshot(_k):
        for axis in calls_after:
            calls_after[axis].append(len(grad_events(axis)))

    step = make_batches(1, micro_batches, GLOBAL_MICRO_BATCH)[0]
    train_step(ctx, fsdp, opt, step, cfg, after_micro_batch=snapshot)
    units_with_grads = sum(1 for u in fsdp.units if u.num_trainable)
    trainable = sum(p.numel() for p in build_model(cfg).parameters() if p.requires_grad)
    n, m = fsdp.sections["dense"].inner.size, fsdp.sections["dense"].outer.size
    inner, outer = fsdp.levels.inner, fsdp.levels.outer
    # Theory: the inner axis reduces the whole gradient (every micro-batch if it
    # shards grads); the outer axis reduces what the inner level left on this
    # rank (1/N of it if the inner level shards), every micro-batch if it shards grads.
    theory = {
        "dp_shard": 4 * trainable * (micro_batches if inner.shard_grads else 1) if n > 1 else 0,
        "dp_outer": (4 * trainable / (n if inner.shard_optim else 1) * (micro_batches if outer.shard_grads else 1))
        if m > 1 else 0,
    }
    return {
        "calls_after_micro_batch": calls_after,
        "grad_bytes": {axis: sum(e.nbytes for e in grad_events(axis)) for axis in calls_after},
        "theory_bytes": theory,
        "units_with_grads": units_with_grads,
        "outer_gathers": [e.tag for e in fsdp.ledger.events if e.axis == "dp_outer" and e.kind == "all_gather"],
        "units": [u.name for u in fsdp.units],
    }


def memory(ctx, strategy: str, bf16: bool, mesh=None, outer_strategy=None):
    """Bytes per rank against the closed-form amounts for the levels: in the step (after the
    optimizer step, gradients still held) and between steps (after ``zero_grad()``, which
    releases the gradient accumulators)."""
    cfg = RunConfig(strategy=strategy, bf16=bf16, steps=1, hidden=128, micro_batches=1,
                    mesh=mesh, outer_strategy=outer_strategy)
    fsdp, opt = wrap(ctx, cfg)
    built = fsdp.memory_report(opt)
    tokens, targets = make_batches(1, 1, GLOBAL_MICRO_BATCH)[0][0]
    fsdp(local_slice(ctx, tokens), local_slice(ctx, targets)).backward()
    opt.step()  # optimizer state exists after the first step
    in_step = fsdp.memory_report(opt)
    opt.zero_grad()
    report = fsdp.memory_report(opt)
    model = build_model(cfg)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n, m = fsdp.sections["dense"].inner.size, fsdp.sections["dense"].outer.size
    inner, outer = fsdp.levels.inner, fsdp.levels.outer

    def split(shard_inner: bool, shard_outer: bool) -> int:
        return (n if shard_inner else 1) * (m if shard_outer else 1)

    compute_bytes = 2 if bf16 else 4
    compute = compute_bytes * total / split(inner.shard_params, outer.shard_params)
    # ZeRO-3 under mixed precision keeps no compute copy of trainable weights (each gather
    # casts the main shard) unless the outer level shards optimizer state but not parameters
    # (HFSDP keeps the inner compute shard); frozen weights keep their compute-dtype piece,
    # which lies on whichever rank owns that part of the buffer.
    if bf16 and inner.shard_params and n * m > 1 and (outer.shard_params or not outer.shard_optim):
        compute = compute_bytes * sum(
            max(0, min(slot.end, unit.storage.regions.compute[1]) - max(slot.start, unit.storage.regions.compute[0]))
            for unit in fsdp.units for slot in unit.storage.layout.slots if not slot.spec.trainable)
    theory = mfsdp.PersistentMemory(
        compute_weights=compute,
        main_weights=(4 * trainable / split(inner.shard_optim, outer.shard_optim)) if bf16 else 0,
        main_grads=0,  # released by zero_grad (set_to_none)
        optimizer_state=8 * trainable / split(inner.shard_optim, outer.shard_optim),
    )
    grads = 4 * trainable / split(inner.shard_grads, outer.shard_grads)  # frozen parameters have none
    return {"report": dataclasses.asdict(report), "theory": dataclasses.asdict(theory),
            "report_in_step": dataclasses.asdict(in_step),
            "theory_in_step": dataclasses.asdict(dataclasses.replace(theory, main_grads=grads)),
            "grads_at_build": built.main_grads, "frozen_compute_bytes": compute_bytes * (total - trainable)}



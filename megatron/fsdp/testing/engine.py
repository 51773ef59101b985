"""Cases that run inside the gloo worker pool: schedule, memory and error checks.

Each returns plain data; the assertions live in the test modules, so a failure
reads as a normal pytest failure in the parent process.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

import megatron.fsdp as mfsdp
from megatron.fsdp.testing.engine_training import GLOBAL_MICRO_BATCH, RunConfig, build_model, local_slice, train_step, wrap
from megatron.fsdp.testing.models import MLP, Block, make_batches


GRAD_KINDS = ("reduce_scatter", "all_reduce")


def gather_schedule(ctx, micro_batches: int, recompute: bool, steps: int = 2):
    """ZeRO-3: all-gathers per unit tag, per micro-batch of the last step; prefetch statistics."""
    cfg = RunConfig(strategy="optim_grads_params", micro_batches=micro_batches, recompute=recompute, steps=steps)
    fsdp, opt = wrap(ctx, cfg)
    fsdp.ledger.trace = True
    per_micro_batch = []

    def snapshot(_k):
        counts = collections.Counter(e.tag for e in fsdp.ledger.events if e.kind == "all_gather")
        per_micro_batch.append(dict(counts))
        fsdp.ledger.reset()

    batches = make_batches(cfg.steps, cfg.micro_batches, GLOBAL_MICRO_BATCH)
    for i, step in enumerate(batches):
        if i == len(batches) - 1:
            fsdp.ledger.reset()
            for phase in fsdp.gather_stats.values():
                phase.update(dict.fromkeys(phase, 0))
            train_step(ctx, fsdp, opt, step, cfg, after_micro_batch=snapshot)
        else:
            train_step(ctx, fsdp, opt, step, cfg)
    resident = [u.name for u in fsdp.units if u.storage.resident or u.storage.full.untyped_storage().nbytes()]
    transient_grads = [u.name for u in fsdp.units if u.storage.grad_full is not None]
    return {
        "per_micro_batch": per_micro_batch,
        "units": [u.name for u in fsdp.units],
        "gather_stats": fsdp.gather_stats,
        "resident_after_step": resident,
        "transient_grads_after_step": transient_grads,
    }


def post_backward_hooks(ctx, micro_batches: int = 2):
    """ZeRO-3: what a ``register_post_backward_hook`` hook sees at each call (the unit, whether its
    weights are released and its reduction issued), one step with the hook, one after ``remove()``."""
    cfg = RunConfig(strategy="optim_grads_params", micro_batches=micro_batches, steps=2)
    fsdp, opt = wrap(ctx, cfg)
    fsdp.ledger.trace = True
    by_name = {u.name: u for u in fsdp.units}
    calls = []

    def hook(name):
        reduced = sum(1 for e in fsdp.ledger.events if e.kind in GRAD_KINDS and e.tag == name)
        calls.append((name, by_name[name].storage.resident, reduced))
    handle = fsdp.register_post_backward_hook(hook)
    first, second = make_batches(cfg.steps, cfg.micro_batches, GLOBAL_MICRO_BATCH)
    train_step(ctx, fsdp, opt, first, cfg)
    with_hook = list(calls)
    handle.remove()
    train_step(ctx, fsdp, opt, second, cfg)
    return {"calls": with_hook, "after_remove": len(calls) - len(with_hook),
            "units": [u.name for u in fsdp.units if u.num_trainable]}


def max_resident_units(ctx, steps: int = 2):
    """Largest number of units holding full ZeRO-3 weights at any forward or backward hook."""
    cfg = RunConfig(strategy="optim_grads_params", micro_batches=1, steps=steps)
    model = build_model(cfg)
    peak = [0]
    holder = {}

    def observe(*_args):
        if "fsdp" in holder:
            peak[0] = max(peak[0], sum(u.storage.resident for u in holder["fsdp"].units))

    for m in model.modules():
        if isinstance(m, (Block, MLP)):
            m.register_forward_pre_hook(lambda *a: observe())
            m.register_forward_hook(lambda *a: observe())
            m.register_full_backward_pre_hook(lambda *a: observe())
    fsdp = mfsdp.fully_shard(model, strategy=cfg.strategy, unit_modules=(Block, MLP), process_group=ctx.group)
    holder["fsdp"] = fsdp
    opt = mfsdp.FullyShardedOptimizer(fsdp, torch.optim.AdamW, lr=1e-3)
    for step in make_batches(cfg.steps, 1, GLOBAL_MICRO_BATCH):
        train_step(ctx, fsdp, opt, step, cfg)
    return {"peak": peak[0], "units": len(fsdp.units)}


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


def mismatched_models(ctx):
    """Rank 1 builds a wider MLP: every rank must raise the same error, and nobody hangs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8 if ctx.rank != 1 else 9), torch.nn.Linear(8 if ctx.rank != 1 else 9, 4))
    try:
        mfsdp.fully_shard(model, strategy="optim_grads_params", process_group=ctx.group)
    except ValueError as exc:
        return str(exc)
    return None


def error_before_collective(ctx, case: str):
    """Errors that every rank detects locally; returns the message (None if nothing was raised)."""
    model = build_model(RunConfig())
    try:
        if case == "strategy":
            mfsdp.fully_shard(model, strategy="zero3", unit_modules=(Block,), process_group=ctx.group)
        elif case == "units":
            mfsdp.fully_shard(model, unit_modules=(torch.nn.GRU,), process_group=ctx.group)
        elif case == "step_without_backward":
            fsdp = mfsdp.fully_shard(model, unit_modules=(Block,), process_group=ctx.group)
            opt = mfsdp.FullyShardedOptimizer(fsdp, torch.optim.AdamW, lr=1e-3)
            opt.step()
        elif case == "grad_outside_unit":
            fsdp = mfsdp.fully_shard(model, strategy="optim_grads", unit_modules=(Block,), process_group=ctx.group)
            x = torch.randn(2, 8, 32)
            torch.nn.functional.linear(x, fsdp.module.blocks[0].mlp.up.weight).sum().backward()  # no module call
        else:
            raise AssertionError(case)
    except (ValueError, RuntimeError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def forgotten_no_sync(ctx, strategy: str, mesh=None, outer_strategy=None):
    """Every micro-batch inside no_sync: optimizer.step() still reduces the gradients."""
    from megatron.fsdp.testing.engine_training import local_slice

    cfg = RunConfig(strategy=strategy, micro_batches=2, steps=3, mesh=mesh, outer_strategy=outer_strategy)
    fsdp, opt = wrap(ctx, cfg)
    losses, norms = [], []
    for step in make_batches(cfg.steps, cfg.micro_batches, GLOBAL_MICRO_BATCH):
        total = torch.zeros(1, dtype=torch.float64)
        with fsdp.no_sync():
            for tokens, targets in step:
                loss = fsdp(local_slice(ctx, tokens), local_slice(ctx, targets)) / cfg.micro_batches
                loss.backward()
                total += loss.item()
        torch.distributed.all_reduce(total, group=ctx.group)
        losses.append(total.item() / ctx.size)
        norms.append(opt.step())
        opt.zero_grad()
    params = fsdp.full_state_dict()  # a collective: every rank calls it
    return {"losses": losses, "grad_norms": norms, "params": params if ctx.rank == 0 else None}


def eval_forward(ctx, strategy: str):
    """A forward under no_grad between steps: the same loss as with grad, nothing left gathered."""
    from megatron.fsdp.testing.engine_training import local_slice

    cfg = RunConfig(strategy=strategy, micro_batches=1, steps=2)
    fsdp, opt = wrap(ctx, cfg)
    batches = make_batches(cfg.steps, 1, GLOBAL_MICRO_BATCH)
    train_step(ctx, fsdp, opt, batches[0], cfg)
    tokens, targets = batches[1][0]
    with torch.no_grad():
        eval_loss = fsdp(local_slice(ctx, tokens), local_slice(ctx, targets)).item()
    resident = [u.name for u in fsdp.units if fsdp.strategy.shard_params and u.storage.resident]
    train_loss = fsdp(local_slice(ctx, tokens), local_slice(ctx, targets))
    train_loss.backward()
    opt.step()
    return {"eval": eval_loss, "train": train_loss.item(), "resident_after_eval": resident}


def adapter_hooks(ctx, strategy: str):
    """Engine features the Megatron adapter relies on, checked against plain arithmetic."""
    from megatron.fsdp.testing.engine_training import local_slice

    cfg = RunConfig(strategy=strategy, micro_batches=1, steps=1)
    results = {}
    # Sum instead of average, then scale_gradients: equals the averaged gradient.
    grads = {}
    for average in (True, False):
        model = build_model(cfg)
        fsdp = mfsdp.fully_shard(model, strategy=strategy, unit_modules=(Block, MLP), process_group=ctx.group,
                                 average_grads=average)
        tokens, targets = make_batches(1, 1, GLOBAL_MICRO_BATCH)[0][0]
        fsdp(local_slice(ctx, tokens), local_slice(ctx, targets)).backward()
        fsdp.finish_grad_sync()
        if not average:
            fsdp.scale_gradients(1.0 / ctx.size)
        grads[average] = {name: fsdp.main_grad_piece(name).clone() for unit in fsdp.units for name in unit.param_names}
    results["sum_then_scale_equals_mean"] = all(torch.allclose(grads[True][n], grads[False][n], rtol=1e-6, atol=1e-9)
                                                for n in grads[True])
    # Pieces of one parameter on all ranks tile it exactly once under sharded optimizer levels.
    sizes = torch.tensor([grads[True]["embed.weight"].numel()], dtype=torch.int64)
    torch.distributed.all_reduce(sizes, group=ctx.group)
    results["embed_piece_total"] = int(sizes.item())
    # broadcast_params: replicas that drifted become rank 0's values again.
    model = build_model(cfg)
    fsdp = mfsdp.fully_shard(model, strategy=strategy, unit_modules=(Block,), process_group=ctx.group)
    for unit in fsdp.units:
        unit.storage.main.add_(float(ctx.rank))  # rank-dependent drift of this rank's copy
    fsdp.broadcast_params()
    full = fsdp.full_state_dict()
    results["norm_weight_sum"] = float(full["norm.weight"].sum())
    # load_full_state_dict (the DCP load's install path): drifted main weights back to ``full``, and
    # compute weights rebuilt from them (the same loss, bitwise, as after the first load; before it,
    # under optim/optim_grads, the compute weights still hold the drift of the other ranks' ranges).
    tokens, targets = make_batches(1, 1, GLOBAL_MICRO_BATCH)[0][0]
    fsdp.load_full_state_dict(full)
    with torch.no_grad():
        loss = fsdp(local_slice(ctx, tokens), local_slice(ctx, targets)).item()
    for unit in fsdp.units:
        unit.storage.main.add_(1.0)
    fsdp.install_updated_weights()
    fsdp.load_full_state_dict(full)
    with torch.no_grad():
        reloaded = fsdp(local_slice(ctx, tokens), local_slice(ctx, targets)).item()
    results["load_full_state_dict"] = (all(torch.equal(v, full[k]) for k, v in fsdp.full_state_dict().items())
                                       and reloaded == loss)
    # A module instance can be a unit.
    model = build_model(cfg)
    fsdp = mfsdp.fully_shard(model, strategy=strategy, unit_modules=(model.blocks[1],), process_group=ctx.group)
    results["instance_units"] = [u.name for u in fsdp.units]
    return results


def expert_layout(ctx):
    """Dense ZeRO-3 with an expert section at ZeRO-1 on the same ranks: units, levels, ledger axes."""
    cfg = RunConfig(strategy="optim_grads_params", expert_strategy="optim", micro_batches=2, steps=1)
    fsdp, opt = wrap(ctx, cfg)
    for step in make_batches(cfg.steps, cfg.micro_batches, GLOBAL_MICRO_BATCH):
        train_step(ctx, fsdp, opt, step, cfg)
    experts = [u for u in fsdp.units if u.storage.section == "expert"]
    return {
        "expert_units": [u.name for u in experts],
        "expert_params": [n for u in experts for n in u.param_names],
        "levels": {name: str(s.levels) for name, s in fsdp.sections.items()},
        "expert_axes": sorted({axis for _kind, axis in fsdp.ledger.summary() if axis.startswith("expert")}),
    }


def expert_outside_unit(ctx):
    """An expert parameter in the root unit cannot be gathered with its layer: a clear error on every rank."""
    model = build_model(RunConfig())
    experts = mfsdp.ExpertSharding(lambda name, p: name.startswith("embed"), mfsdp.DataParallelMesh(ctx.group))
    try:
        mfsdp.fully_shard(model, unit_modules=(Block,), process_group=ctx.group, experts=experts)
    except ValueError as exc:
        return str(exc)
    return None

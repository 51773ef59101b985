"""The collective schedule, read from the ledger: what is gathered and reduced, when, and how much."""

import pytest
import torch

import megatron.fsdp as mfsdp
from megatron.fsdp.testing.common import LEVELS
from megatron.fsdp.testing.engine import GRAD_KINDS, grad_traffic
from megatron.fsdp.testing.engine_training import GLOBAL_MICRO_BATCH, RunConfig, build_model, local_slice, train_step, wrap
from megatron.fsdp.testing.models import MLP, Block, make_batches
from tests.cases.engine_shared import assert_parity, forgotten_no_sync, gather_schedule, reference


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
    fsdp = mfsdp.fully_shard(model, strategy=cfg.strategy, unit_modules=(Block, MLP), mesh=ctx.group)
    holder["fsdp"] = fsdp
    opt = mfsdp.FullyShardedOptimizer(fsdp, torch.optim.AdamW, lr=1e-3)
    for step in make_batches(cfg.steps, 1, GLOBAL_MICRO_BATCH):
        train_step(ctx, fsdp, opt, step, cfg)
    return {"peak": peak[0], "units": len(fsdp.units)}


def eval_forward(ctx, strategy: str):
    """A forward under no_grad between steps: the same loss as with grad, nothing left gathered."""
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


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_zero3_gathers_each_unit_once_per_forward_and_backward(pool, micro_batches, recompute):
    result = pool.run(gather_schedule, size=2, micro_batches=micro_batches, recompute=recompute)[0]
    assert len(result["per_micro_batch"]) == micro_batches
    # The last block's forward ends last (after its nested MLP's), so the backward starts with it.
    last = [u for u in result["units"] if u.count(".") == 1][-1]
    assert last == "blocks.1", result["units"]
    for counts in result["per_micro_batch"]:
        for unit in result["units"]:
            # The root stays gathered from its forward through its backward, and so does the unit the
            # backward starts with (the previous step showed the order): one gather each.
            expected = 1 if unit in ("<root>", last) else 2
            assert counts.get(unit, 0) == expected, (unit, counts)
        assert set(counts) == set(result["units"]), counts
    assert result["resident_after_step"] == []  # nothing stays gathered between steps
    assert result["transient_grads_after_step"] == []


def test_post_backward_hook_runs_once_per_unit_after_its_reduction(pool):
    """``register_post_backward_hook``: every unit, every micro-batch's backward, weights released and
    reduction issued by then (the point the job trims its heap at); ``remove()`` stops it."""
    result = pool.run(post_backward_hooks, size=2, micro_batches=2)[0]
    names = [name for name, _, _ in result["calls"]]
    assert sorted(names) == sorted(result["units"] * 2), names
    half = len(names) // 2
    assert names[:half] == names[half:], names  # the same order in both micro-batches
    assert all(not resident for _, resident, _ in result["calls"]), result["calls"]
    # ZeRO-3 reduce-scatters every micro-batch: the unit's k-th call follows its k-th reduction
    seen = {}
    for name, _, reduced in result["calls"]:
        seen[name] = seen.get(name, 0) + 1
        assert reduced == seen[name], (name, reduced, seen[name])
    assert result["after_remove"] == 0


def test_prefetch_overlaps_every_gather(pool):
    """Steady state: no unit waits for a gather issued on demand (the root prefetches the first one).

    The first pass, other depths and the bound on gathered units: tests/engine/test_overlap.py.
    """
    result = pool.run(gather_schedule, size=2, micro_batches=1, recompute=False, steps=3)[0]
    non_root = len(result["units"]) - 1
    for phase in ("forward", "backward"):
        stats = result["gather_stats"][phase]
        held = 1 if phase == "backward" else 0  # the unit whose forward ended last, still gathered
        assert stats == {"prefetched": non_root - held, "on_demand": 0, "held": held}, (phase, stats)


def test_gathered_units_are_bounded(pool):
    """Root + a block + its nested MLP + one prefetched unit at most; never the whole model."""
    result = pool.run(max_resident_units, size=2)[0]
    assert result["units"] == 5
    assert result["peak"] <= 4


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("strategy", LEVELS)
def test_gradient_traffic_equals_theory_plus_padding(pool, strategy, world_size):
    micro_batches = 3
    result = pool.run(grad_traffic, size=world_size, strategy=strategy, micro_batches=micro_batches)[0]
    overhead = result["grad_bytes"]["dp_shard"] / result["theory_bytes"]["dp_shard"] - 1
    assert 0 <= overhead < 0.01, result
    assert result["grad_bytes"]["dp_outer"] == 0
    calls = result["calls_after_micro_batch"]["dp_shard"]
    if strategy in ("no_shard", "optim"):
        assert calls[:-1] == [0] * (micro_batches - 1), f"grad collective before the last micro-batch: {calls}"
        assert calls[-1] == result["units_with_grads"]
    else:  # reduce-scattered every micro-batch, once per unit
        assert calls == [result["units_with_grads"] * (k + 1) for k in range(micro_batches)], calls


def test_single_rank_issues_no_collective(pool):
    result = pool.run(grad_traffic, size=1, strategy="optim_grads_params", micro_batches=2)[0]
    assert result["calls_after_micro_batch"] == {"dp_shard": [0, 0], "dp_outer": [0, 0]}
    assert result["grad_bytes"] == {"dp_shard": 0, "dp_outer": 0}


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_forgotten_no_sync_is_reduced_at_step(pool, strategy):
    cfg = RunConfig(strategy=strategy, micro_batches=2, steps=3)
    result = pool.run(forgotten_no_sync, size=3, strategy=strategy)[0]
    assert_parity(result, reference(cfg), 1e-5, 1e-5)


def every_micro_batch_synced(ctx, strategy: str, reduce_in_backward: bool, mesh=None, outer_strategy=None):
    """Every micro-batch outside no_sync, as Megatron's schedule runs them without --overlap-grad-reduce (it sets no
    no_sync_func), then ``finish_grad_sync``: losses, grad norms and weights, or ``{"error": message}``."""
    cfg = RunConfig(strategy=strategy, micro_batches=2, steps=3, mesh=mesh, outer_strategy=outer_strategy)
    fsdp, opt = wrap(ctx, cfg, overlap=mfsdp.Overlap(reduce_in_backward=reduce_in_backward))
    losses, norms = [], []
    try:
        for step in make_batches(cfg.steps, cfg.micro_batches, GLOBAL_MICRO_BATCH):
            total = torch.zeros(1, dtype=torch.float64)
            for tokens, targets in step:
                loss = fsdp(local_slice(ctx, tokens), local_slice(ctx, targets)) / cfg.micro_batches
                loss.backward()
                total += loss.item()
            fsdp.finish_grad_sync()
            torch.distributed.all_reduce(total, group=ctx.group)
            losses.append(total.item() / ctx.size)
            norms.append(opt.step())
            opt.zero_grad()
    except RuntimeError as error:
        return {"error": str(error)}
    params = fsdp.full_state_dict()  # a collective: every rank calls it
    return {"losses": losses, "grad_norms": norms, "params": params if ctx.rank == 0 else None}


@pytest.mark.parametrize("strategy, mesh, outer", [("no_shard", None, None), ("optim", None, None),
                                                   ("optim_grads", None, None),
                                                   ("optim_grads_params", (2, 2), "no_shard")])
def test_every_micro_batch_synced_reduces_once_per_step_or_is_refused(pool, strategy, mesh, outer):
    """Why: a once-per-step reduction (full-gradient levels, an unsharded outer axis) run in the first micro-batch's
    backward, with the second added after it, counted the first twice (Megatron-LM's trainer without
    --overlap-grad-reduce, level optim: grad norm 1.071 for DDP's 1.039). ``Overlap(reduce_in_backward=False)``
    defers it to ``finish_grad_sync``; with the default the second micro-batch is refused with one line.
    Reduce-scatters of sharded gradients accumulate per micro-batch and need neither."""
    cfg = RunConfig(strategy=strategy, micro_batches=2, steps=3, mesh=mesh, outer_strategy=outer)
    size = 4 if mesh else 2
    deferred = pool.run(every_micro_batch_synced, size=size, strategy=strategy, reduce_in_backward=False, mesh=mesh,
                        outer_strategy=outer)[0]
    assert "error" not in deferred, deferred
    assert_parity(deferred, reference(cfg), 1e-5, 1e-5)
    eager = pool.run(every_micro_batch_synced, size=size, strategy=strategy, reduce_in_backward=True, mesh=mesh,
                     outer_strategy=outer)
    if strategy == "optim_grads":  # its reduce-scatters accumulate: nothing is once per step
        assert_parity(eager[0], reference(cfg), 1e-5, 1e-5)
    else:
        assert all("received another micro-batch's gradients after this step's reduction" in result["error"]
                   and "no_sync" in result["error"] for result in eager), eager


@pytest.mark.parametrize("strategy", LEVELS)
def test_no_grad_forward_between_steps(pool, strategy):
    for result in pool.run(eval_forward, size=2, strategy=strategy):
        assert result["eval"] == result["train"]
        assert result["resident_after_eval"] == []

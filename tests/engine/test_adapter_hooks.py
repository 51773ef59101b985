"""Engine features the Megatron-Core adapter builds on."""

import pytest
import torch

import megatron.fsdp as mfsdp
from megatron.fsdp.testing.common import LEVELS
from megatron.fsdp.testing.engine_training import GLOBAL_MICRO_BATCH, RunConfig, build_model, local_slice
from megatron.fsdp.testing.models import MLP, Block, make_batches


def adapter_hooks(ctx, strategy: str):
    """Engine features the Megatron adapter relies on, checked against plain arithmetic."""
    cfg = RunConfig(strategy=strategy, micro_batches=1, steps=1)
    results = {}
    # Sum instead of average, then scale_gradients: equals the averaged gradient.
    grads = {}
    for average in (True, False):
        model = build_model(cfg)
        fsdp = mfsdp.fully_shard(model, strategy=strategy, unit_modules=(Block, MLP), mesh=ctx.group,
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
    fsdp = mfsdp.fully_shard(model, strategy=strategy, unit_modules=(Block,), mesh=ctx.group)
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
    fsdp = mfsdp.fully_shard(model, strategy=strategy, unit_modules=(model.blocks[1],), mesh=ctx.group)
    results["instance_units"] = [u.name for u in fsdp.units]
    return results


@pytest.mark.parametrize("strategy", LEVELS)
def test_engine_hooks_for_the_adapter(pool, strategy):
    results = pool.run(adapter_hooks, size=3, strategy=strategy)
    for r in results:
        assert r["sum_then_scale_equals_mean"]
        assert r["instance_units"] == ["<root>", "blocks.1"]
        assert r["load_full_state_dict"]
    # Sharded optimizer levels: the three pieces tile embed.weight (67 x 32); no_shard: each rank holds all.
    expected = 67 * 32 * (3 if strategy == "no_shard" else 1)
    assert results[0]["embed_piece_total"] == expected
    # After broadcast_params every rank holds identical values; replicated levels take rank 0's drift (0).
    sums = {r["norm_weight_sum"] for r in results}
    assert len(sums) == 1
    if strategy == "no_shard":
        assert sums == {32.0}  # LayerNorm weight starts at ones; rank 0 added 0

"""``fully_shard(overlap=Overlap(double_buffer=True))`` (``--fsdp-double-buffer``): persistent gather buffers, bitwise the same training.

Without it a ZeRO-3 unit allocates its full weights at every gather; with it the units
gather into a few buffers allocated once (``sharding/gather_buffers.py``): each unit finds
its weights at one address every step, two (or prefetch depth + 1) buffers per section and
nesting depth, and losses, grad norms and parameters equal the run without, bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import megatron.fsdp as mfsdp
from megatron.fsdp.sharding.gather_buffers import Candidate, nesting_depth, plan
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
    overlap = mfsdp.Overlap(forward_prefetch=prefetch, backward_prefetch=prefetch)
    return {"plain": _train(ctx, cfg, overlap=overlap),
            "double": _train(ctx, cfg, overlap=dataclasses.replace(overlap, double_buffer=True))}


def _assert_bitwise(plain, double):
    assert double["losses"] == plain["losses"]
    assert double["grad_norms"] == plain["grad_norms"]
    assert plain["params"].keys() == double["params"].keys()
    for name, value in plain["params"].items():
        assert torch.equal(value, double["params"][name]), name


@pytest.mark.parametrize("size, fields, buffers", [
    # bf16, nested units (Block holds MLP), recompute, 2 micro-batches, prefetch 2 (3 buffers per depth, 2 units
    # each here) and the root's: 5 buffers.
    (2, dict(bf16=True, recompute=True, micro_batches=2), 5),
    # two axes (ZeRO-3 inside, optimizer state sharded across) and an expert section of its own:
    # root, 2 blocks, 2 MLPs (dense) and 2 MLPs' experts: 7 buffers.
    (4, dict(mesh=(2, 2), outer_strategy="optim", expert_strategy="optim_grads_params", expert_mesh=(2, 2),
             steps=3), 7),
], ids=["bf16-recompute-prefetch2", "mesh2x2-experts"])
def test_double_buffer_is_bitwise_equal_and_reuses_its_buffers(pool, size, fields, buffers):
    prefetch = 2 if "recompute" in fields else 1
    result = pool.run(with_and_without, size=size, prefetch=prefetch, **fields)
    plain, double = result[0]["plain"], result[0]["double"]
    _assert_bitwise(plain, double)
    assert plain["buffers"] == 0 and double["buffers"] == buffers
    # every unit gathers into its buffer, at the buffer's address, at every forward of every step
    assert "<root>" in double["buffered_units"]
    assert set(double["at_buffer"]) == set(plain["at_buffer"]) == set(double["buffered_units"]) - {"<root>"}
    assert all(seen == [True] for seen in double["at_buffer"].values()), double["at_buffer"]
    assert all(seen == [None] for seen in plain["at_buffer"].values())  # without: allocated per gather
    assert double["compute_bytes"] > plain["compute_bytes"]  # the buffers are persistent (memory_report says so)


def test_the_plan_alternates_units_of_one_depth_and_sizes_buffers_by_their_largest():
    names = ["", "blocks.0", "blocks.0.mlp", "blocks.1", "blocks.1.mlp", "blocks.2"]
    assert [nesting_depth(n, names) for n in names[1:]] == [0, 1, 0, 1, 0]
    f32 = torch.float32
    units = [Candidate("blocks.0", "dense", 0, 10, f32), Candidate("blocks.0.mlp", "dense", 1, 4, f32),
             Candidate("blocks.1", "dense", 0, 12, f32), Candidate("blocks.1.mlp", "dense", 1, 4, f32),
             Candidate("blocks.2", "dense", 0, 11, f32), Candidate("blocks.0.mlp[experts]", "expert", 1, 3, f32)]
    assignment, shapes = plan(units, depth=1)
    assert assignment == [0, 1, 2, 3, 0, 4]
    assert shapes[0] == (11, f32) and shapes[2] == (12, f32) and shapes[4] == (3, f32)
    assert plan(units, depth=2)[0] == [0, 1, 2, 3, 4, 5]  # three buffers per depth: blocks.2 gets its own

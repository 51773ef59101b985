"""Persistent memory per rank equals the closed-form amount of each level; a reduction widens no whole gradient."""

import pytest
import torch

from megatron.fsdp.testing import engine as cases
from megatron.fsdp.testing.common import LEVELS
from tests.cases.engine_shared import assert_memory_matches_theory, gather_schedule
from tests.cases.level_matrix import covering


# Every level on 2 and 4 ranks; fp32 and bf16 alternate so each level and world size meets both.
@pytest.mark.parametrize("strategy, world_size, bf16", covering(LEVELS, [2, 4], [False, True], full=2))
def test_persistent_bytes_match_theory(pool, strategy, world_size, bf16):
    results = pool.run(cases.memory, size=world_size, strategy=strategy, bf16=bf16)
    assert_memory_matches_theory(results)
    if bf16 and strategy == "optim_grads_params":  # no compute copy of trainable weights: frozen ones only
        assert sum(r["report"]["compute_weights"] for r in results) == results[0]["frozen_compute_bytes"]


def test_no_full_parameters_remain_after_zero3_backward(pool):
    result = pool.run(gather_schedule, size=3, micro_batches=2, recompute=True)[0]
    assert result["resident_after_step"] == []
    assert result["transient_grads_after_step"] == []


def widened_gradients(ctx):
    """bf16 ZeRO-3, two steps: fp32 tensors of a whole unit's size that the backward's ops create.

    Watched by a dispatch mode on the training thread (the gloo ring's worker, which widens
    one 1/N chunk at a time, is not watched); returns the ops that made one, and the losses.
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from megatron.fsdp.testing.engine_training import GLOBAL_MICRO_BATCH, RunConfig, local_slice, make_batches, wrap

    cfg = RunConfig(bf16=True, steps=2)
    fsdp, opt = wrap(ctx, cfg)
    sizes = {unit.storage.layout.padded_size for unit in fsdp.units if unit.storage.trainable_params}
    hits = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() in sizes:
                    hits.append(str(func))
            return out

    for step in make_batches(cfg.steps, cfg.micro_batches, GLOBAL_MICRO_BATCH):
        for tokens, targets in step:
            loss = fsdp(local_slice(ctx, tokens), local_slice(ctx, targets))
            with Watch():
                loss.backward()
        opt.step()
        opt.zero_grad()
    return {"hits": hits, "units": len(sizes)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_bf16_gradients_reduced_without_a_whole_fp32_copy(pool, world_size):
    """Why: each reduction in flight held an fp32 copy of its unit's gradient (twice the bf16
    size) until it was waited, the largest transient of the early backward (docs/performance.md,
    "Peak memory against FSDP2"); the ring widens one chunk at a time instead."""
    for rank, result in enumerate(pool.run(widened_gradients, size=world_size)):
        assert result["units"] > 1, result
        assert result["hits"] == [], (rank, result["hits"][:5])


def poisoned_flat_gradients(ctx, strategy: str, recompute: bool):
    """Final main weights after 2 steps, normally and with every unit's flat gradient filled with
    NaN when its backward begins: it is not zero-filled up front, so every byte the reduction
    reads must have been written by a gradient or zeroed at the unit's end (padding, the
    blocks' never-used parameter, frozen ranges)."""
    from megatron.fsdp.sharding.buffers import UnitStorage
    from megatron.fsdp.testing.engine_training import GLOBAL_MICRO_BATCH, RunConfig, local_slice, make_batches, wrap

    def train():
        cfg = RunConfig(strategy=strategy, steps=2, micro_batches=2, recompute=recompute)
        fsdp, opt = wrap(ctx, cfg)
        for step in make_batches(cfg.steps, cfg.micro_batches, GLOBAL_MICRO_BATCH):
            for tokens, targets in step:
                fsdp(local_slice(ctx, tokens), local_slice(ctx, targets)).backward()
            opt.step()
            opt.zero_grad()
        return [u.storage.main.clone() for u in fsdp.units if u.storage.trainable_params]

    clean = train()
    begin = UnitStorage.begin_grads

    def poisoned(self):
        fresh = self.grad_full is None and not self.grads_in_place
        begin(self)
        if fresh and self.grad_full is not None:
            self.grad_full.fill_(float("nan"))
    UnitStorage.begin_grads = poisoned
    try:
        dirty = train()
    finally:
        UnitStorage.begin_grads = begin
    return {"equal": [torch.equal(a, b) for a, b in zip(clean, dirty)], "units": len(clean)}


@pytest.mark.parametrize("strategy, recompute", [("optim_grads_params", True), ("optim_grads", False)])
def test_flat_gradient_needs_no_zero_fill(pool, strategy, recompute):
    """Why: zero-filling a unit's whole flat gradient when its backward begins made all its
    pages resident at once; gradients are written into it as they arrive and
    only what none reached is zeroed. Recomputation delivers gradients in a second backward."""
    for result in pool.run(poisoned_flat_gradients, size=2, strategy=strategy, recompute=recompute):
        assert result["units"] > 1 and all(result["equal"]), result

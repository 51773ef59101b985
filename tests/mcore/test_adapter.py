"""Adapter parity: Megatron-Core's GPTModel through megatron.fsdp.mcore vs Megatron-Core's own DDP.

Same seed, data, optimizer settings and schedule (``get_forward_backward_func``,
``gpt.MICRO_BATCHES`` micro-batches, ``gpt.STEPS`` iterations); only the data-parallel wrapper, the optimizer and the
schedule hooks differ. Losses and grad norms must agree within 1e-5 relative.
"""

import pytest
import torch

from megatron.fsdp.testing.common import LEVELS, rel
from megatron.fsdp_training.testing.adapter import build, fsdp_run, wire_fsdp_hooks
from megatron.fsdp_training.testing.gpt import (ROWS_PER_DP_RANK, SEQ_LENGTH, STEPS, TOPOLOGIES, Topology, data_iterator,
                                                forward_step, make_batches, parallel, tiny_gpt_config)
from tests.cases.baselines import megatron_ddp
from tests.cases.level_matrix import covering


RTOL = 1e-5


def eval_leaves_nothing_gathered(ctx, topology: Topology, strategy: str) -> dict:
    """A forward-only pass through Megatron's schedule (evaluation) releases every unit."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with parallel(ctx, topology):
        config = tiny_gpt_config(topology)
        model, optimizer = build(config, topology, strategy)
        wire_fsdp_hooks(model, config, optimizer)
        batches = make_batches(1, 2, ROWS_PER_DP_RANK * topology.dp(ctx.size))
        with torch.no_grad():
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=data_iterator(batches[0]),
                model=model[0], num_microbatches=2, seq_length=SEQ_LENGTH,
                micro_batch_size=ROWS_PER_DP_RANK, decoder_seq_length=SEQ_LENGTH, forward_only=True)
        return {"resident": [u.name for m in model for u in m.fsdp.units if u.storage.resident]}


def _baseline(pool, name):
    return megatron_ddp(pool, TOPOLOGIES[name])[0]


@pytest.mark.slow
# Every topology once, every level on at least one (ZeRO-3 on DP 4 and PP 2 x VPP 2, the
# multi-chunk case); with the tests below ZeRO-3 also meets TP 2 + SP and 2 x 2 instances.
# The levels themselves are proven on every world size by tests/engine/test_parity.py.
# MFSDP_FULL_MATRIX=1: all 24 (topology, level) combinations.
@pytest.mark.parametrize("name, strategy", covering(list(TOPOLOGIES), LEVELS[::-1]))
def test_parity_with_megatron_ddp(mcore_pool, name, strategy):
    baseline = _baseline(mcore_pool, name)
    results = mcore_pool.run(fsdp_run, timeout=300, topology=TOPOLOGIES[name],
                             strategy=strategy)
    for r in results[1:]:
        assert r["losses"] == results[0]["losses"]
    result = results[0]
    for key in ("losses", "grad_norms"):
        errs = [rel(a, b) for a, b in zip(result[key], baseline[key])]
        assert len(errs) == STEPS and max(errs) <= RTOL, f"{key}: {result[key]} vs Megatron DDP {baseline[key]}"


def test_zero3_schedule_inside_megatron_schedule(mcore_pool):
    """One gather per TransformerLayer per forward and per backward of each micro-batch, except the
    last layer's backward: the backward starts with it, so from the job's second micro-batch on (once
    a pass has shown the order) it stays gathered from its forward."""
    micro_batches, steps = 4, 2
    result = mcore_pool.run(fsdp_run, timeout=300, topology=Topology(),
                            strategy="optim_grads_params", steps=steps, micro_batches=micro_batches, trace=True)[0]
    layers = [u for u in result["units"] if ".layers." in u]
    assert len(layers) == 4 and layers[-1] == "decoder.layers.3", layers
    held = micro_batches * steps - 1  # backward gathers the last layer did not need
    for unit in layers:
        expected = 2 * micro_batches - (held / steps if unit == layers[-1] else 0)
        assert result["gathers_per_step"][unit] == expected, result["gathers_per_step"]
    assert result["gathers_per_step"]["<root>"] == micro_batches
    assert result["resident_after"] == []


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim"])
def test_forward_only_pass_leaves_nothing_gathered(mcore_pool, strategy):
    result = mcore_pool.run(eval_leaves_nothing_gathered, timeout=300,
                            topology=Topology(pp=2), strategy=strategy)
    for r in result:
        if strategy == "optim_grads_params":
            assert r["resident"] == []


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_two_optimizer_instances_hsdp_hfsdp(mcore_pool, outer):
    """DP 4 as 2 domains x 2 ranks (num_distributed_optimizer_instances=2): same numbers as flat DP 4."""
    baseline = _baseline(mcore_pool, "dp4")
    result = mcore_pool.run(fsdp_run, timeout=300, topology=Topology(instances=2),
                            strategy="optim_grads_params", outer=outer)[0]
    for key in ("losses", "grad_norms"):
        errs = [rel(a, b) for a, b in zip(result[key], baseline[key])]
        assert max(errs) <= RTOL, f"{key}: {result[key]} vs Megatron DDP {baseline[key]}"


def test_groups_from_a_process_group_collection(mcore_pool):
    """``pg_collection=`` builds the same mesh as ``parallel_state``: same numbers."""
    baseline = _baseline(mcore_pool, "tp2sp-dp2")
    result = mcore_pool.run(fsdp_run, timeout=300, topology=TOPOLOGIES["tp2sp-dp2"],
                            strategy="optim_grads_params", use_pg_collection=True)[0]
    for key in ("losses", "grad_norms"):
        assert max(rel(a, b) for a, b in zip(result[key], baseline[key])) <= RTOL

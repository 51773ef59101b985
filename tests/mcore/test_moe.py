"""MoE parity: experts on their own data-parallel mesh and level vs Megatron-Core's own DDP.

The tiny GPT of ``megatron/fsdp_training/testing/gpt.py`` with 4 experts (top-2, aux-loss load
balancing) in every layer, fp32, 2 micro-batches, 3 iterations on 4 ranks. Only
the data-parallel wrapper and the optimizer differ from the baseline
(Megatron-Core DDP + its chained dense/expert optimizer), so losses and grad
norms must agree within 1e-5 relative in every configuration: expert
data-parallel groups of 4, 2 and 1 ranks (EP 1, 2, 4; with one rank a doubled
gradient per micro-batch would show at once), both token dispatchers, expert
levels different from the dense ones, HSDP for dense layers with flat experts,
an expert outer axis of its own, and EP with tensor parallelism.
"""

import dataclasses

import pytest

from megatron.fsdp_training.testing.adapter import fsdp_run
from tests.cases.baselines import megatron_ddp
from megatron.fsdp.testing.common import rel
from megatron.fsdp_training.testing.gpt import STEPS, Topology
from megatron.fsdp_training.testing.moe import EP_CASES, MIXED_CASES, moe_topology


RTOL = 1e-5


def _baseline(pool, topology: Topology):
    return megatron_ddp(pool, topology)[0]


def _check(pool, topology: Topology, strategy: str, **overrides) -> dict:
    # The optimizer-instance count only shapes our mesh: the baseline is the flat run
    # (Megatron-Core's DDP without its distributed optimizer mis-reduces experts over instances).
    baseline = _baseline(pool, dataclasses.replace(topology, instances=1))
    results = pool.run(fsdp_run, timeout=300, topology=topology,
                       strategy=strategy, trace=True, **overrides)
    for r in results[1:]:
        assert r["losses"] == results[0]["losses"] and r["grad_norms"] == results[0]["grad_norms"]
    result = results[0]
    for key in ("losses", "grad_norms"):
        errs = [rel(a, b) for a, b in zip(result[key], baseline[key])]
        assert len(errs) == STEPS and max(errs) <= RTOL, f"{key}: {result[key]} vs Megatron DDP {baseline[key]}"
    assert result["expert_params"] and all(".experts." in n for n in result["expert_params"])
    return result


@pytest.mark.parametrize("dispatcher, ep, strategy", EP_CASES)
def test_expert_parallel_parity(mcore_pool, dispatcher, ep, strategy):
    result = _check(mcore_pool, moe_topology(dispatcher, ep), strategy)
    level = f"{strategy} x no_shard"
    assert result["sections"] == {"dense": (level, 4, 1), "expert": (level, 4 // ep, 1)}


@pytest.mark.parametrize("name", list(MIXED_CASES))
def test_expert_levels_of_their_own(mcore_pool, name):
    topology, strategy, overrides, sections = MIXED_CASES[name]
    result = _check(mcore_pool, topology, strategy, **overrides)
    for section, expected in sections.items():
        assert result["sections"][section] == expected


def test_expert_level_errors_name_the_field():
    from megatron.fsdp.mcore import FullyShardedDataParallelConfig
    from megatron.fsdp.mcore.data_parallel import check_configs

    bad = FullyShardedDataParallelConfig(use_megatron_fsdp=True, expert_data_parallel_sharding_strategy="zero3")
    with pytest.raises(ValueError, match="zero3"):
        check_configs(object(), bad)
    outer = FullyShardedDataParallelConfig(use_megatron_fsdp=True, expert_outer_dp_sharding_strategy="optim")
    with pytest.raises(ValueError, match="expert_num_distributed_optimizer_instances"):
        check_configs(object(), outer)

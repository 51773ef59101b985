"""Two-axis data parallelism: a level per axis (HSDP, HFSDP) on 2 x 2, 3 x 2 and 2 x 3 meshes."""

import dataclasses

import pytest

import megatron.fsdp as mfsdp
from megatron.fsdp.sharding.strategy import parse_mesh_strategy, valid_pairs
from megatron.fsdp.testing import engine as cases
from megatron.fsdp.testing.engine_training import RunConfig
from tests.cases.engine_shared import (FP32_RTOL, assert_memory_matches_theory, assert_parity, forgotten_no_sync,
                                       reference, run)
from tests.cases.level_matrix import covering


SHAPES = [(2, 2), (3, 2), (2, 3)]
PAIRS = valid_pairs()  # every (inner, outer) pair where the outer level shards no more than the inner


def test_ten_pairs_are_valid():
    assert len(PAIRS) == 10
    assert ("optim_grads_params", "no_shard") in PAIRS and ("optim_grads_params", "optim") in PAIRS


def _ids(value):
    """``2x2`` for a mesh shape, ``inner-outer`` for a level pair."""
    if isinstance(value, tuple):
        return "x".join(map(str, value)) if isinstance(value[0], int) else "-".join(value)
    return None


@pytest.mark.slow
# Every pair once; the shapes rotate (each meets 3-4 pairs, inner and outer of 3 ranks both) and
# so do 1 and 3 micro-batches (every shape meets both). MFSDP_FULL_MATRIX=1: all 60 combinations.
@pytest.mark.parametrize("pair, shape, micro_batches", covering(PAIRS, SHAPES, [1, 3]), ids=_ids)
def test_two_axis_parity(pool, pair, shape, micro_batches):
    inner, outer = pair
    cfg = RunConfig(strategy=inner, outer_strategy=outer, mesh=shape, micro_batches=micro_batches)
    ref = reference(dataclasses.replace(cfg, mesh=None, outer_strategy=None, strategy="no_shard"))
    assert_parity(run(pool, cfg, shape[0] * shape[1]), ref, FP32_RTOL, 1e-5)


@pytest.mark.parametrize("inner, outer", [("optim_grads_params", "no_shard"), ("optim_grads_params", "optim")])
def test_hsdp_hfsdp_parity_smoke(pool, inner, outer):
    """The two named configurations, outside the slow matrix."""
    cfg = RunConfig(strategy=inner, outer_strategy=outer, mesh=(2, 2), micro_batches=3)
    ref = reference(dataclasses.replace(cfg, mesh=None, outer_strategy=None, strategy="no_shard"))
    assert_parity(run(pool, cfg, 4), ref, FP32_RTOL, 1e-5)


# Every pair once, on an even and an uneven inner axis in turn (MFSDP_FULL_MATRIX=1: both for every pair).
@pytest.mark.parametrize("pair, shape", covering(PAIRS, [(2, 2), (3, 2)]), ids=_ids)
def test_outer_traffic_once_per_step_and_equal_to_theory(pool, pair, shape):
    inner, outer = pair
    micro_batches = 3
    result = pool.run(cases.grad_traffic, size=shape[0] * shape[1], strategy=inner, micro_batches=micro_batches,
                      mesh=shape, outer_strategy=outer)[0]
    units = result["units_with_grads"]
    for axis in ("dp_shard", "dp_outer"):
        overhead = result["grad_bytes"][axis] / result["theory_bytes"][axis] - 1
        assert 0 <= overhead < 0.01, (axis, result)
    outer_calls = result["calls_after_micro_batch"]["dp_outer"]
    if outer in ("no_shard", "optim"):
        # Once per step per unit, and nothing before the last micro-batch.
        assert outer_calls == [0] * (micro_batches - 1) + [units], outer_calls
    else:  # the outer level shards gradients: reduce-scattered every micro-batch
        assert outer_calls == [units * (k + 1) for k in range(micro_batches)], outer_calls
    gathers = result["outer_gathers"]
    if outer == "optim":  # HFSDP: updated weights gathered across domains once per step per unit
        assert sorted(gathers) == sorted(result["units"]), gathers
    elif outer == "no_shard":
        assert gathers == []


# Every pair once, fp32 and bf16 in turn (each precision meets five pairs of both kinds).
@pytest.mark.parametrize("pair, bf16", covering(PAIRS, [False, True]), ids=_ids)
def test_persistent_bytes_match_formulas(pool, pair, bf16):
    inner, outer = pair
    results = pool.run(cases.memory, size=6, strategy=inner, bf16=bf16, mesh=(3, 2), outer_strategy=outer)
    assert_memory_matches_theory(results)


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_forgotten_no_sync_still_reduces_across_domains(pool, outer):
    result = pool.run(forgotten_no_sync, size=4, strategy="optim_grads_params", mesh=(2, 2),
                      outer_strategy=outer)[0]
    cfg = RunConfig(strategy="no_shard", micro_batches=2, steps=3)
    assert_parity(result, reference(cfg), FP32_RTOL, 1e-5)


def test_outer_level_finer_than_inner_is_rejected():
    with pytest.raises(ValueError, match=r"outer level 'optim_grads' shards more than inner level 'optim'; "
                                         r"valid \(inner, outer\) pairs are: .*\(optim_grads_params, optim\)"):
        parse_mesh_strategy("optim", "optim_grads", has_outer_axis=True)


def test_outer_level_without_outer_axis_is_rejected():
    import torch
    with pytest.raises(ValueError, match="needs an outer data-parallel axis"):
        mfsdp.fully_shard(torch.nn.Linear(2, 2), strategy="optim_grads_params", outer_strategy="optim")

"""The collective schedule, read from the ledger: what is gathered and reduced, when, and how much."""

import pytest

from megatron.fsdp.testing import engine as cases
from megatron.fsdp.testing.common import LEVELS
from megatron.fsdp.testing.engine_training import RunConfig
from tests.cases.parity import assert_parity, reference


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_zero3_gathers_each_unit_once_per_forward_and_backward(pool, micro_batches, recompute):
    result = pool.run(cases.gather_schedule, size=2, micro_batches=micro_batches, recompute=recompute)[0]
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
    result = pool.run(cases.post_backward_hooks, size=2, micro_batches=2)[0]
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
    result = pool.run(cases.gather_schedule, size=2, micro_batches=1, recompute=False, steps=3)[0]
    non_root = len(result["units"]) - 1
    for phase in ("forward", "backward"):
        stats = result["gather_stats"][phase]
        held = 1 if phase == "backward" else 0  # the unit whose forward ended last, still gathered
        assert stats == {"prefetched": non_root - held, "on_demand": 0, "held": held}, (phase, stats)


def test_gathered_units_are_bounded(pool):
    """Root + a block + its nested MLP + one prefetched unit at most; never the whole model."""
    result = pool.run(cases.max_resident_units, size=2)[0]
    assert result["units"] == 5
    assert result["peak"] <= 4


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("strategy", LEVELS)
def test_gradient_traffic_equals_theory_plus_padding(pool, strategy, world_size):
    micro_batches = 3
    result = pool.run(cases.grad_traffic, size=world_size, strategy=strategy, micro_batches=micro_batches)[0]
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
    result = pool.run(cases.grad_traffic, size=1, strategy="optim_grads_params", micro_batches=2)[0]
    assert result["calls_after_micro_batch"] == {"dp_shard": [0, 0], "dp_outer": [0, 0]}
    assert result["grad_bytes"] == {"dp_shard": 0, "dp_outer": 0}


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_forgotten_no_sync_is_reduced_at_step(pool, strategy):
    cfg = RunConfig(strategy=strategy, micro_batches=2, steps=3)
    result = pool.run(cases.forgotten_no_sync, size=3, strategy=strategy)[0]
    assert_parity(result, reference(cfg), 1e-5, 1e-5)


@pytest.mark.parametrize("strategy", LEVELS)
def test_no_grad_forward_between_steps(pool, strategy):
    for result in pool.run(cases.eval_forward, size=2, strategy=strategy):
        assert result["eval"] == result["train"]
        assert result["resident_after_eval"] == []

"""Persistent memory per rank equals the closed-form amount of each level."""

import pytest

from tests.cases import engine as cases
from tests.cases.common import LEVELS
from tests.cases.parity import assert_memory_matches_theory
from tests.harness.matrix import covering


# Every level on 2 and 4 ranks; fp32 and bf16 alternate so each level and world size meets both.
@pytest.mark.parametrize("strategy, world_size, bf16", covering(LEVELS, [2, 4], [False, True], full=2))
def test_persistent_bytes_match_theory(pool, strategy, world_size, bf16):
    results = pool.run(cases.memory, size=world_size, strategy=strategy, bf16=bf16)
    assert_memory_matches_theory(results)
    if bf16 and strategy == "optim_grads_params":  # no compute copy of trainable weights: frozen ones only
        assert sum(r["report"]["compute_weights"] for r in results) == results[0]["frozen_compute_bytes"]


def test_no_full_parameters_remain_after_zero3_backward(pool):
    result = pool.run(cases.gather_schedule, size=3, micro_batches=2, recompute=True)[0]
    assert result["resident_after_step"] == []
    assert result["transient_grads_after_step"] == []

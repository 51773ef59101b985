"""Persistent memory per rank equals the closed-form amount of each level."""

import pytest

from tests.engine.test_parity import LEVELS
from tests.harness.matrix import covering

CASES = "tests.engine.cases:"


# Every level on 2 and 4 ranks; fp32 and bf16 alternate so each level and world size meets both.
@pytest.mark.parametrize("strategy, world_size, bf16", covering(LEVELS, [2, 4], [False, True], full=2))
def test_persistent_bytes_match_theory(pool, strategy, world_size, bf16):
    results = pool.run(CASES + "memory", size=world_size, strategy=strategy, bf16=bf16)
    assert_memory_matches_theory(results)
    if bf16 and strategy == "optim_grads_params":  # no compute copy of trainable weights: frozen ones only
        assert sum(r["report"]["compute_weights"] for r in results) == results[0]["frozen_compute_bytes"]


def assert_memory_matches_theory(results) -> None:
    """Every kind within 1% of the formula, in the step and between steps (gradients released
    by ``zero_grad``); no gradient memory from the build until the first backward."""
    for rank, result in enumerate(results):
        assert result["grads_at_build"] == 0, (rank, result["grads_at_build"])
        for when in ("", "_in_step"):
            report, theory = result["report" + when], result["theory" + when]
            for kind, expected in theory.items():
                got = report[kind]
                if expected == 0:
                    assert got == 0, (rank, when, kind, report)
                else:
                    assert abs(got / expected - 1) < 0.01, \
                        f"rank {rank}{when} {kind}: {got} bytes vs theory {expected:.0f}"


def test_no_full_parameters_remain_after_zero3_backward(pool):
    result = pool.run(CASES + "gather_schedule", size=3, micro_batches=2, recompute=True)[0]
    assert result["resident_after_step"] == []
    assert result["transient_grads_after_step"] == []

"""Engine features the Megatron-Core adapter builds on."""

import pytest

from megatron.fsdp.testing import engine as cases
from megatron.fsdp.testing.common import LEVELS


@pytest.mark.parametrize("strategy", LEVELS)
def test_engine_hooks_for_the_adapter(pool, strategy):
    results = pool.run(cases.adapter_hooks, size=3, strategy=strategy)
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

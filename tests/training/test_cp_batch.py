"""Context parallelism's batch split, rank by rank: each CP rank holds chunks ``r`` and ``2*cp-1-r`` of its
data-parallel rank's unsplit sequence (Megatron's load balancing), for every key the job's ``get_batch`` yields.

Why a test of its own: Megatron-Core 0.18 made ``get_batch_on_this_cp_rank``'s group default the world,
so a call that passes no group splits every sequence over all ranks; a model trains on that without an
error (only the losses differ). ``megatron/fsdp/mcore_releases.py`` always passes the CP group.
"""

from __future__ import annotations

from typing import Dict

import pytest


def cp_batch_slices(ctx) -> Dict[str, object]:
    from megatron.core import parallel_state as ps
    from megatron.fsdp_training.data.datasets import get_batch
    from megatron.fsdp_training.testing.gpt import Topology, data_iterator, make_batches, parallel

    topology = Topology(cp=2)
    with parallel(ctx, topology):
        dp = topology.dp(ctx.size)
        unsplit = next(data_iterator(make_batches(1, 1, global_micro_batch_size=2 * dp)[0]))
        got = get_batch(iter([dict(unsplit)]))
        return {"cp_rank": ps.get_context_parallel_rank(), "cp_size": ps.get_context_parallel_world_size(),
                "dp_rank": ps.get_data_parallel_rank(),
                "unsplit": {k: v.tolist() for k, v in unsplit.items()},
                "got": {k: v.tolist() for k, v in got.items()}}


def _expected(values, cp_size: int, cp_rank: int, dim: int):
    """Chunks ``cp_rank`` and ``2*cp-1-cp_rank`` of ``2*cp`` along ``dim`` of a nested list."""
    if dim:
        return [_expected(v, cp_size, cp_rank, dim - 1) for v in values]
    chunk = len(values) // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return values[first * chunk:(first + 1) * chunk] + values[second * chunk:(second + 1) * chunk]


def test_every_cp_rank_holds_its_load_balanced_chunks(mcore_pool):
    results = mcore_pool.run(cp_batch_slices, timeout=120)
    assert sorted((r["dp_rank"], r["cp_rank"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        assert r["cp_size"] == 2 and set(r["got"]) == set(r["unsplit"]) >= {"tokens", "labels", "loss_mask",
                                                                              "position_ids", "attention_mask"}
        for key, unsplit in r["unsplit"].items():
            # [b, s] per key; Megatron's attention mask [b, 1, s, s] is split along its queries only
            expected = _expected(unsplit, 2, r["cp_rank"], 2 if key == "attention_mask" else 1)
            assert r["got"][key] == expected, (key, r["dp_rank"], r["cp_rank"])
    # the two CP ranks of one DP rank hold every position of its sequences once, the DP ranks different rows
    by_dp = {}
    for r in results:
        by_dp.setdefault(r["dp_rank"], []).extend(p for row in r["got"]["position_ids"] for p in row)
    seq = len(results[0]["unsplit"]["position_ids"][0])
    assert all(sorted(positions) == sorted(list(range(seq)) * len(results[0]["unsplit"]["position_ids"]))
               for positions in by_dp.values())
    assert results[0]["unsplit"]["tokens"] != next(r for r in results if r["dp_rank"] == 1)["unsplit"]["tokens"]


def test_cp_split_refuses_no_group():
    from megatron.fsdp.mcore_releases import batch_on_this_cp_rank

    with pytest.raises(ValueError, match="context-parallel group"):
        batch_on_this_cp_rank({}, None)

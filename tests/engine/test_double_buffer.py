"""``fully_shard(double_buffer=True)`` (``--fsdp-double-buffer``): persistent gather buffers, bitwise the same training.

Without it a ZeRO-3 unit allocates its full weights at every gather; with it the units
gather into a few buffers allocated once (``sharding/gather_buffers.py``): each unit finds
its weights at one address every step, two (or prefetch depth + 1) buffers per section and
nesting depth, and losses, grad norms and parameters equal the run without, bit for bit.
"""

import pytest
import torch

from megatron.fsdp.sharding.gather_buffers import Candidate, nesting_depth, plan
from tests.cases.double_buffer import with_and_without


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

"""The flat layout is a pure function: check it without any process group."""

import itertools

import pytest

from megatron.fsdp.sharding.layout import ParamSpec, build_layout
from megatron.fsdp.sharding.regions import unit_regions
from megatron.fsdp.sharding.strategy import parse_mesh_strategy


def _specs():
    return [
        ParamSpec("w1", (7, 5)),
        ParamSpec("b1", (7,), no_weight_decay=True),
        ParamSpec("frozen", (3,), trainable=False),
        ParamSpec("w2", (11,)),
        ParamSpec("b2", (2,), no_weight_decay=True),
    ]


@pytest.mark.parametrize("world_size, align", list(itertools.product([1, 2, 3, 4, 5, 7], [1, 4])))
def test_every_element_has_exactly_one_owner(world_size, align):
    layout = build_layout(_specs(), world_size, align)
    covered = {s.spec.name: [0] * s.spec.numel for s in layout.slots}
    for rank in range(world_size):
        lo, hi = layout.shard_range(rank)
        assert hi - lo == layout.shard_size
        for piece in layout.pieces(rank):
            slot = layout.slots[piece.slot_index]
            assert slot.start + piece.param_offset == lo + piece.shard_offset
            for k in range(piece.param_offset, piece.param_offset + piece.length):
                covered[slot.spec.name][k] += 1
    assert all(c == 1 for counts in covered.values() for c in counts)
    assert layout.padded_size % world_size == 0
    assert layout.padding == layout.padded_size - layout.numel


def test_order_puts_decay_then_no_decay_then_frozen():
    layout = build_layout(_specs(), 2)
    assert [s.spec.name for s in layout.slots] == ["w1", "w2", "b1", "b2", "frozen"]
    assert layout.trainable_end == layout.slots[3].end
    runs = layout.runs(0, layout.padded_size, [s.spec.no_weight_decay for s in layout.slots])
    assert runs == ((0, 46, False), (46, 55, True))


def test_alignment_pads_parameter_starts_and_shards():
    layout = build_layout(_specs(), 3, align=4)
    assert all(s.start % 4 == 0 for s in layout.slots)
    assert layout.shard_size % 4 == 0
    assert layout.padding < 4 * (len(layout.slots) + 3)


def test_uneven_split_and_a_rank_that_owns_nothing():
    layout = build_layout([ParamSpec("w", (5,)), ParamSpec("v", (1,))], 4)
    assert layout.shard_size == 2
    assert [len(layout.pieces(r)) for r in range(4)] == [1, 1, 2, 0]  # "w" is split 2/2/1; rank 3 holds padding
    zero3 = parse_mesh_strategy("optim_grads_params", None, False)
    assert unit_regions(layout, zero3, 3, 0, 1).main == (6, 6)  # empty range: no main weights, grads or state


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        build_layout(_specs(), 0)
    with pytest.raises(ValueError, match="align"):
        build_layout(_specs(), 2, align=0)

"""Host staging buffers of ``--async-save`` (megatron/fsdp/checkpoint/staging.py): reused between saves, never shared
between values of one save, and invisible outside ``staging_into``."""

import torch

from megatron.fsdp.checkpoint.staging import StagingArena, staged_copy, staged_zeros, staging_into


def _round(arena, values):
    with staging_into(arena):
        return [staged_copy(v, torch.float32) for v in values] + [staged_zeros(3, torch.bfloat16, torch.device("cpu"))]


def test_arena_reuses_its_buffers_from_one_save_to_the_next():
    values = [torch.randn(4, 5, dtype=torch.bfloat16), torch.randn(7)]
    arena = StagingArena()
    first = _round(arena, values)
    values[1].add_(1.0)  # training moved on: the next save must see the new values
    second = _round(arena, values)
    assert [t.data_ptr() for t in first] == [t.data_ptr() for t in second]  # the same memory
    assert len({t.data_ptr() for t in second}) == len(second)  # one buffer per value
    assert second[0].dtype == torch.float32 and torch.equal(second[0], values[0].float())
    assert torch.equal(second[1], values[1]) and torch.equal(second[2], torch.zeros(3, dtype=torch.bfloat16))
    assert arena.replaced == 0 and arena.nbytes == (20 + 7) * 4 + 3 * 2
    # A value whose size changed gets a new buffer (once); the others stay put.
    third = _round(arena, [values[0], torch.randn(8)])
    assert arena.replaced == 1 and third[0].data_ptr() == first[0].data_ptr()
    assert third[1].data_ptr() != first[1].data_ptr() and third[1].shape == (8,)
    # Outside staging_into a copy is a fresh tensor, as the engine's state dicts always were.
    fresh = staged_copy(values[1])
    assert fresh.data_ptr() != values[1].data_ptr() and torch.equal(fresh, values[1])


def test_pieces_are_kept_with_their_slots():
    """A DTensor piece built over a slot is handed out again while its slot and description stay, with the
    new values; outside an arena every call builds a new one."""
    from megatron.fsdp.checkpoint.staging import staged_piece

    arena, value = StagingArena(), torch.arange(6, dtype=torch.float32)
    pieces = []
    for step in range(2):
        value.add_(step)
        with staging_into(arena):
            pieces.append(staged_piece(value[2:], (2, 3), 2))
    assert pieces[0] is pieces[1] and torch.equal(pieces[1]._local_tensor, value[2:])
    with staging_into(arena):
        moved = staged_piece(value[2:], (2, 3), 1)  # another description: built anew
    assert moved is not pieces[0] and staged_piece(value[2:], (2, 3), 2) is not pieces[0]
    # Optimizer state before the first step (zeros) leaves its piece for the first save after the step.
    from megatron.fsdp.checkpoint.staging import staged_zeros_piece

    arena = StagingArena()
    with staging_into(arena):
        zeros = staged_zeros_piece(4, torch.float32, torch.device("cpu"), (2, 2), 0)
    assert torch.equal(zeros._local_tensor, torch.zeros(4))
    with staging_into(arena):
        assert staged_piece(value[2:], (2, 2), 0) is zeros and torch.equal(zeros._local_tensor, value[2:])


def test_deferred_copies_wait_for_copy_deferred():
    """In a deferring round a stable value's slot is filled only by ``copy_deferred`` (with the value as it is
    then); other values are copied at once."""
    from megatron.fsdp.checkpoint.staging import staged_piece

    arena, stable, other = StagingArena(), torch.arange(6, dtype=torch.float32), torch.ones(3)
    with staging_into(arena):  # the first round (start-up): everything copied at once
        staged_piece(stable, (2, 3), 0, stable=True)
    with staging_into(arena, defer=True):
        piece = staged_piece(stable + 100, (2, 3), 0, stable=True)  # a new value object: its copy waits
        copied = staged_copy(other)
    assert torch.equal(copied, other) and arena.deferred_bytes == 6 * 4
    assert torch.equal(piece._local_tensor, stable)  # still the previous round's contents
    arena.copy_deferred()
    assert torch.equal(piece._local_tensor, stable + 100) and arena.deferred_bytes == 0

"""Flat buffer layout of one unit: a pure function of parameter shapes and world size.

Every rank owns the contiguous slice ``[rank * shard_size, (rank + 1) * shard_size)``
of a buffer of ``shard_size * world_size`` elements. Parameters are packed in
order and may straddle shard boundaries, so a rank can own part of a parameter
or none of it. Padding is explicit: alignment gaps between parameters and the
tail that rounds the buffer up to a multiple of the world size.

Parameters are ordered trainable-with-weight-decay first, then trainable
without weight decay, then frozen. That makes the trainable region one prefix
``[0, trainable_end)`` (the only region with main weights, grads and optimizer
state) and, with Megatron's default decay rule, gives the optimizer two long
runs per unit instead of one tensor per parameter.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know about one parameter."""

    name: str
    shape: Tuple[int, ...]
    trainable: bool = True
    no_weight_decay: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def order_key(self) -> int:
        if not self.trainable:
            return 2
        return 1 if self.no_weight_decay else 0


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in the flat buffer: ``[start, start + numel)``."""

    spec: ParamSpec
    start: int

    @property
    def end(self) -> int:
        return self.start + self.spec.numel


@dataclasses.dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that a rank owns.

    ``param_offset`` is the offset inside the flattened parameter;
    ``shard_offset`` the offset inside the rank's shard.
    """

    slot_index: int
    param_offset: int
    shard_offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    slots: Tuple[ParamSlot, ...]
    world_size: int
    shard_size: int
    trainable_end: int
    used_end: int

    @property
    def padded_size(self) -> int:
        return self.shard_size * self.world_size

    @property
    def numel(self) -> int:
        """Elements that belong to parameters (excludes all padding)."""
        return sum(slot.spec.numel for slot in self.slots)

    @property
    def padding(self) -> int:
        return self.padded_size - self.numel

    def shard_range(self, rank: int) -> Tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def pieces(self, rank: int) -> Tuple[ShardPiece, ...]:
        """The parameter pieces inside ``rank``'s shard, in buffer order."""
        return self.pieces_in(*self.shard_range(rank))

    def pieces_in(self, lo: int, hi: int) -> Tuple[ShardPiece, ...]:
        """The parameter pieces inside buffer range ``[lo, hi)``; offsets relative to ``lo``."""
        out = []
        for i, slot in enumerate(self.slots):
            a, b = max(lo, slot.start), min(hi, slot.end)
            if a < b:
                out.append(ShardPiece(i, a - slot.start, a - lo, b - a))
        return tuple(out)

    def runs(self, lo: int, hi: int, no_weight_decay: Sequence[bool]) -> Tuple[Tuple[int, int, bool], ...]:
        """Split the trainable part of ``[lo, hi)`` into runs ``(a, b, no_weight_decay)``.

        Adjacent parameters of the same decay class merge into one run, across
        alignment padding (padding holds zeros in weights and grads and stays
        zero under any elementwise optimizer). With the default decay rule the
        layout order makes this at most two runs per unit.
        """
        out = []
        for slot, nwd in zip(self.slots, no_weight_decay):
            a, b = max(lo, slot.start), min(hi, slot.end)
            if not slot.spec.trainable or a >= b:
                continue
            if out and out[-1][2] == nwd:
                out[-1][1] = b
            else:
                out.append([a, b, nwd])
        return tuple(tuple(run) for run in out)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def build_layout(specs: Sequence[ParamSpec], world_size: int, align: int = 1, sub_shards: int = 1) -> FlatLayout:
    """Pack ``specs`` (stably reordered by trainable/decay class) for ``world_size`` ranks.

    ``align`` (elements) applies to every parameter's start and to the shard
    size, so each view and each shard starts on an aligned address when the
    buffer itself is aligned. ``sub_shards`` (the outer axis size of a
    two-axis mesh) splits every shard again into equal aligned pieces.
    """
    if sub_shards < 1:
        raise ValueError(f"sub_shards must be >= 1, got {sub_shards}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    ordered = sorted(specs, key=lambda s: s.order_key)
    slots, offset = [], 0
    trainable_end = None
    for spec in ordered:
        if trainable_end is None and not spec.trainable:
            trainable_end = offset
        offset = _round_up(offset, align)
        slots.append(ParamSlot(spec, offset))
        offset += spec.numel
    used_end = offset
    trainable_end = used_end if trainable_end is None else trainable_end
    shard_size = _round_up(max(1, -(-used_end // world_size)), align * sub_shards)
    return FlatLayout(tuple(slots), world_size, shard_size, trainable_end, used_end)

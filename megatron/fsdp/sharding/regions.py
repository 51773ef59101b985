"""Which buffer ranges a rank keeps, per kind of state: a pure function of layout, levels and ranks.

With an inner axis of ``N`` ranks and an outer axis of ``M`` ranks, the buffer of
``P = N * S`` elements is cut into inner shards ``[i*S, (i+1)*S)`` and each
inner shard again into ``M`` outer pieces of ``S / M``. Each kind of state
lives on the finest range its levels allow:

* compute weights: the outer piece if the outer level shards params, else the
  inner shard if the inner level does, else the whole buffer;
* gradient accumulator: the same rule with "shards grads", clipped to the trainable prefix
  when the unit holds frozen parameters (they have no gradient; a unit without any keeps its
  whole range, padding included, so its reductions run on the buffer as it is);
* main weights and optimizer state: the same rule with "shards optimizer
  state", clipped to the trainable prefix ``[0, trainable_end)``.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple

from .layout import FlatLayout
from .strategy import MeshStrategy

Range = Tuple[int, int]


@dataclasses.dataclass(frozen=True)
class UnitRegions:
    inner: Range    # inner shard, or the whole buffer when the inner level shards nothing
    piece: Range    # this rank's outer piece of ``inner``
    compute: Range  # persistent compute weights
    accum: Range    # gradient accumulator between micro-batches (no frozen parameter's range)
    owned: Range    # the finest range optimizer state is sharded over: this rank's checkpoint values
    main: Range     # main weights / optimizer state: the trainable part of ``owned`` (may be empty)

    @staticmethod
    def size(r: Range) -> int:
        return r[1] - r[0]


def trainable_part(r: Range, trainable_end: int) -> Range:
    """The part of buffer range ``r`` inside the trainable prefix ``[0, trainable_end)``; ``(lo, lo)``
    when there is none. The one statement of the owned-range rule's clipping."""
    return r[0], max(r[0], min(r[1], trainable_end))


def unit_regions(layout: FlatLayout, levels: MeshStrategy, inner_rank: int, outer_rank: int, outer_size: int) -> UnitRegions:
    inner = layout.shard_range(inner_rank) if levels.inner.shard_optim else (0, layout.padded_size)
    width = (inner[1] - inner[0]) // outer_size
    if width * outer_size != inner[1] - inner[0]:
        raise ValueError(f"inner range {inner} does not split into {outer_size} outer pieces; "
                         "build the layout with sub_shards equal to the outer axis size")
    piece = (inner[0] + outer_rank * width, inner[0] + (outer_rank + 1) * width)

    def finest(outer_flag: bool, inner_flag: bool) -> Range:
        if outer_flag:
            return piece
        return inner if inner_flag else (0, layout.padded_size)

    owned = finest(levels.outer.shard_optim, levels.inner.shard_optim)
    frozen = any(not slot.spec.trainable for slot in layout.slots)
    return UnitRegions(
        inner=inner,
        piece=piece,
        compute=finest(levels.outer.shard_params, levels.inner.shard_params),
        accum=trainable_part(finest(levels.outer.shard_grads, levels.inner.shard_grads),
                             layout.trainable_end if frozen else layout.padded_size),
        owned=owned,
        main=trainable_part(owned, layout.trainable_end),
    )

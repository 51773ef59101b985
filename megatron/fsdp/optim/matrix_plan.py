"""Which parameters a matrix optimizer steps, who owns each, and how pieces travel: pure functions.

A matrix optimizer (Muon, and any per-matrix optimizer) needs each weight
matrix whole, while every level splits matrices unevenly across ranks. Each
matrix gets one owner among the ranks that shard optimizer state (the "owner
set": the inner axis, times the outer axis when its level shards optimizer
state too); the owner receives the other ranks' pieces, runs the matrix step,
and sends the pieces of the result back. Everything here is a function of the
layouts and the levels, so every rank computes the same plan without talking,
and collective order follows unit order.

Owners are dealt largest-cost first, the cost being the Newton-Schulz work of
a matrix (``rows * cols * min(rows, cols)``), onto the least-loaded rank, or
onto another rank that keeps the same compute makespan and leaves the largest
per-rank byte count smaller (``assign_owners``). With ``N`` owners each rank
sends about ``(N-1)/N^2`` of the matrix bytes per direction, less where owners
hold much of their own matrices.

Exchange stages: on a flat axis one stage (inner). When the outer level shards
optimizer state too, a rank's piece is an outer piece of an inner shard, so the
pieces travel in two stages: over the outer axis to the rank of the owner's
outer coordinate (which then holds the matrix's part of its inner shard), then
over the inner axis to the owner. The result returns the same way reversed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

from ..sharding.layout import FlatLayout
from ..sharding.strategy import MeshStrategy

Range = Tuple[int, int]


@dataclasses.dataclass(frozen=True)
class MatrixSlot:
    """One matrix: where it lives (model chunk, unit, slot, buffer range ``[start, end)``) and its owner.

    A parameter is one matrix, or (grouped-GEMM expert weights) several
    consecutive row-major blocks of its storage, each its own matrix: then
    ``name`` is ``param[k]`` and ``[start, end)`` is block ``k``'s range.
    """

    model: int
    unit: int
    slot: int
    name: str
    shape: Tuple[int, int]
    start: int
    end: int
    owner: int  # index in the section's owner set (inner coordinate + N * outer coordinate)
    param: str = ""  # the parameter's name (== name unless the parameter holds several matrices)

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def cost(self) -> int:
        rows, cols = self.shape
        return rows * cols * min(rows, cols)


@dataclasses.dataclass(frozen=True)
class OwnerSet:
    """The ranks of one section that shard optimizer state: ``inner`` x ``outer`` coordinates."""

    inner: int  # inner axis size if the inner level shards optimizer state, else 1
    outer: int  # outer axis size if the outer level shards optimizer state, else 1

    @property
    def size(self) -> int:
        return self.inner * self.outer

    def coordinates(self, owner: int) -> Tuple[int, int]:
        return owner % self.inner, owner // self.inner

    def index(self, inner_rank: int, outer_rank: int) -> int:
        return (inner_rank if self.inner > 1 else 0) + self.inner * (outer_rank if self.outer > 1 else 0)


def owner_set(levels: MeshStrategy, inner_size: int, outer_size: int) -> OwnerSet:
    return OwnerSet(inner_size if levels.inner.shard_optim else 1,
                    outer_size if levels.outer.shard_optim else 1)


def assign_owners(costs: Sequence[int], owners: int, held: Optional[Sequence[Sequence[int]]] = None) -> List[int]:
    """Largest cost first onto the least-loaded owner; ties go to the lower index. Deterministic.

    With ``held`` (``held[o][k]``: elements of matrix ``k`` owner ``o`` holds before the
    exchange) the choice also balances bytes: among the owners that keep the compute
    makespan where the least-loaded choice would put it, the one that leaves the largest
    per-rank send load smallest (an owner sends back all but its own piece; every other
    rank sends its piece), so no rank sends much more than ``2 (N-1)/N^2`` of the matrix
    elements, and owners that hold much of a matrix save its traffic.
    """
    load = [0] * owners
    send = [0] * owners
    result = [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        least = min(range(owners), key=lambda r: (load[r], r))
        if held is None:
            result[k] = least
            load[least] += costs[k]
            continue
        cap = max(max(load), load[least] + costs[k])
        numel = sum(held[r][k] for r in range(owners))
        best = None
        for o in range(owners):
            if load[o] + costs[k] > cap:
                continue
            after = [send[r] + (numel - held[r][k] if r == o else held[r][k]) for r in range(owners)]
            key = (max(after), load[o], o)
            if best is None or key < best[0]:
                best = (key, o, after)
        _, o, send = best
        result[k] = o
        load[o] += costs[k]
    return result


def held_elements(layout: FlatLayout, owners: "OwnerSet", start: int, end: int) -> List[int]:
    """Elements of ``[start, end)`` each owner index holds before the exchange (its inner shard, cut
    into ``owners.outer`` equal parts when the outer axis shards optimizer state too)."""
    out = []
    for o in range(owners.size):
        inner, outer = owners.coordinates(o)
        lo, hi = layout.shard_range(inner) if owners.inner > 1 else (0, layout.padded_size)
        width = (hi - lo) // owners.outer
        a, b = overlap((lo + outer * width, lo + (outer + 1) * width), start, end)
        out.append(b - a)
    return out


@dataclasses.dataclass(frozen=True)
class Stage:
    """One exchange over one axis for one unit.

    ``axis`` is "inner" or "outer"; ``ranges[k]`` the buffer range coordinate
    ``k`` of the axis holds before the stage (toward the owner); the owner's
    coordinate on this axis receives their concatenation, in ``k`` order.
    ``outer_owner_only``: the stage runs only for matrices whose owner has this
    rank's outer coordinate (the second stage of a two-axis exchange).
    """

    axis: str
    ranges: Tuple[Range, ...]
    outer_owner_only: bool


def exchange_stages(layout: FlatLayout, levels: MeshStrategy, inner_rank: int, outer_size: int) -> Tuple[Stage, ...]:
    """The stages toward the owner for a unit with ``layout`` on this rank (reverse them for the way back)."""
    stages = []
    sharded_outer = levels.outer.shard_optim and outer_size > 1
    if sharded_outer:
        lo, hi = layout.shard_range(inner_rank)
        width = (hi - lo) // outer_size
        stages.append(Stage("outer", tuple((lo + k * width, lo + (k + 1) * width) for k in range(outer_size)), False))
    if levels.inner.shard_optim and layout.world_size > 1:
        stages.append(Stage("inner", tuple(layout.shard_range(k) for k in range(layout.world_size)), sharded_outer))
    return tuple(stages)


def overlap(r: Range, start: int, end: int) -> Range:
    """``r`` clipped to ``[start, end)``; an empty range sits at ``start``."""
    a, b = max(r[0], start), min(r[1], end)
    return (a, b) if a < b else (start, start)


def matrix_blocks(name: str, shape: Sequence[int], block: Optional[Sequence[int]]) -> Tuple[int, int]:
    """The shape of each matrix of a parameter: itself, or ``block`` when its storage holds several
    (``numel`` must be a multiple of the block's); one error naming the parameter otherwise."""
    if block is None:
        return tuple(shape)
    block = tuple(int(n) for n in block)
    numel = math.prod(shape)
    if len(block) != 2 or min(block) < 1 or numel % math.prod(block):
        raise ValueError(f"PerMatrixOptimizer.split({name!r}) returned {block}, which does not tile the parameter of shape "
                         f"{tuple(shape)}: return (rows, cols) of one of its consecutive row-major matrices, "
                         "or None for one matrix")
    return block


def matrix_slots(units: Sequence[Tuple[int, int, FlatLayout, Sequence[str]]],
                 selected: Sequence[Sequence[Optional[Tuple[int, int]]]], owners: OwnerSet) -> List[MatrixSlot]:
    """Every selected slot of ``units`` (``(model, unit index, layout, names)``) with its owner, in unit order.

    ``selected[u][i]`` is ``None`` (not a matrix) or the shape of each matrix in
    slot ``i`` (the parameter's own shape, or a block of it: one matrix per block).
    """
    found = []
    for (model, unit, layout, names), blocks in zip(units, selected):
        for i, (slot, name, block) in enumerate(zip(layout.slots, names, blocks)):
            if block is None:
                continue
            size = math.prod(block)
            count = (slot.end - slot.start) // size
            for k in range(count):
                label = name if count == 1 and tuple(block) == tuple(slot.spec.shape) else f"{name}[{k}]"
                found.append((model, unit, i, label, tuple(block), slot.start + k * size,
                              slot.start + (k + 1) * size, name))
    costs = [math.prod(shape) * min(shape) for _, _, _, _, shape, _, _, _ in found]
    layouts = {(model, unit): layout for model, unit, layout, _ in units}
    per_matrix = [held_elements(layouts[(m, u)], owners, s, e) for m, u, _, _, _, s, e, _ in found]
    owner_of = assign_owners(costs, owners.size, [list(col) for col in zip(*per_matrix)] if found else None)
    return [MatrixSlot(m, u, i, n, shape, s, e, o, p) for (m, u, i, n, shape, s, e, p), o in zip(found, owner_of)]


def loads(slots: Sequence[MatrixSlot], owners: int) -> Dict[int, int]:
    """Newton-Schulz cost per owner (for reports and tests)."""
    out = {o: 0 for o in range(owners)}
    for m in slots:
        out[m.owner] += m.cost
    return out

"""Persistent gather buffers (``Overlap(double_buffer=True)``, Megatron-LM's ``--fsdp-double-buffer``).

Without them a ZeRO-3 unit allocates its full compute buffer at every gather and releases
it after use. With them, the full buffers of the units that release live in a few buffers
allocated once, at ``fully_shard``, and reused every step: memory whose address never
changes (what NCCL user-buffer registration needs) and no allocation per gather.

Which buffer a unit uses is fixed for the model's life, because autograd keeps views of a
unit's weights from its forward to its backward: the unit must find its weights at the same
address when it is gathered again for the backward. Units are grouped by what can be gathered
at the same time: per section (dense, expert), per nesting depth (a unit is resident while the
units inside it run), per dtype; within a group the ``k``-th unit in registration order takes
buffer ``k % depth``, ``depth`` = the prefetch depth + 1 (at least two: "double"). A group's
buffer is as large as its largest unit. Consecutive units of one depth alternate, so the
running unit and the ones prefetched behind it never share a buffer when units run in
registration order, as a stack of layers does (Megatron-LM's double buffer has the same
limit: "simple repetitive model structures"). Units without trainable parameters keep
allocating per gather (a unit that gets no gradient stays gathered until the end of the
backward). A schedule that would gather two units of one buffer at once stops with an error
naming both (``GatherBuffer.claim``); it never reads another unit's weights.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch


class GatherBuffer:
    """One persistent flat buffer and the unit gathered into it now (``None``: free)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, name: str):
        self.tensor = torch.empty(numel, dtype=dtype, device=device)
        self.name = name
        self.holder: Optional[str] = None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def view(self, numel: int) -> torch.Tensor:
        return self.tensor[:numel]

    def claim(self, unit: str) -> None:
        if self.holder is not None and self.holder != unit:
            raise RuntimeError(
                f"fsdp double buffer: unit {unit} is gathered while unit {self.holder} still holds their shared "
                f"gather buffer {self.name}; the units run in an order other than their registration order, or "
                "more are gathered at once than the prefetch depth: run without double_buffer "
                "(--fsdp-double-buffer) for this model, or make fewer units")
        self.holder = unit

    def release(self, unit: str) -> None:
        if self.holder == unit:
            self.holder = None


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A unit that may use a gather buffer: its name, section, the units enclosing it, its size and dtype."""

    name: str
    section: str
    depth: int
    numel: int
    dtype: torch.dtype


def nesting_depth(name: str, unit_names: Sequence[str]) -> int:
    """How many other (non-root) units enclose the unit called ``name`` (the root, ``""``, encloses all)."""
    return sum(1 for other in unit_names if other and other != name and name.startswith(other + "."))


def plan(candidates: Sequence[Candidate], depth: int) -> Tuple[List[int], Dict[int, Tuple[int, torch.dtype]]]:
    """The buffer of each candidate (an index) and each buffer's (size, dtype); a pure function."""
    slots = max(2, depth + 1)
    seen: Dict[tuple, int] = {}
    assignment: List[int] = []
    buffers: Dict[tuple, int] = {}
    shapes: Dict[int, Tuple[int, torch.dtype]] = {}
    for c in candidates:
        group = (c.section, c.depth, c.dtype)
        k = seen.get(group, 0)
        seen[group] = k + 1
        key = group + (k % slots,)
        if key not in buffers:
            buffers[key] = len(buffers)
        index = buffers[key]
        size = max(c.numel, shapes.get(index, (0, c.dtype))[0])
        shapes[index] = (size, c.dtype)
        assignment.append(index)
    return assignment, shapes


def allocate(shapes: Dict[int, Tuple[int, torch.dtype]], device: torch.device) -> List[GatherBuffer]:
    return [GatherBuffer(shapes[i][0], shapes[i][1], device, f"#{i}") for i in range(len(shapes))]

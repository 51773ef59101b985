"""How one rank's flat piece of a parameter looks to ``torch.distributed.checkpoint``.

A rank owns a contiguous range of each flattened parameter, which is in
general not a rectangle of the parameter. ``flat_boxes`` cuts such a range
into at most ``2 * ndim - 1`` boxes (a partial leading row, the full rows, a
partial trailing row, recursively per dimension); each box is itself contiguous
in memory, so it is a plain view of the flat piece. ``sharded_piece`` wraps the
piece in a ``DTensor`` of the parameter's global shape whose local tensor
carries DCP's ``__create_write_items__`` / ``__create_chunk_list__`` /
``__get_tensor_shard__`` hooks (DTensor defers to its local tensor for them):
DCP writes one chunk per box, reads any overlap of saved and wanted boxes, and
its planner keeps one copy of identical chunks written by several ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate


@dataclasses.dataclass(frozen=True)
class Box:
    """A rectangular block of a tensor that is also one contiguous flat range ``[start, start + numel)``."""

    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_boxes(shape: Sequence[int], lo: int, hi: int) -> Tuple[Box, ...]:
    """Cut the flat range ``[lo, hi)`` of a row-major tensor of ``shape`` into boxes, in flat order."""
    shape = tuple(shape)
    if lo >= hi:
        return ()
    if not shape:
        return (Box((), (), 0),)
    row = math.prod(shape[1:])
    first, last = lo // row, (hi - 1) // row
    full_lo, full_hi = -(-lo // row), hi // row
    if first == last and full_lo >= full_hi:  # inside one row: recurse into it
        base = first * row
        return tuple(Box((first,) + b.offsets, (1,) + b.sizes, base + b.start)
                     for b in flat_boxes(shape[1:], lo - base, hi - base))
    out: List[Box] = []
    if lo % row:
        out += flat_boxes(shape, lo, (first + 1) * row)
    if full_lo < full_hi:
        out.append(Box((full_lo,) + (0,) * (len(shape) - 1), (full_hi - full_lo,) + shape[1:], full_lo * row))
    if hi % row:
        out += flat_boxes(shape, last * row, hi)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _mesh(device_type: str, rank: int) -> DeviceMesh:
    """A one-rank mesh without process groups: DCP only asks whether this rank is in it.

    The placement says nothing about where the data lives (the chunk hooks do),
    so no collective and no new process group is needed to describe a piece.
    """
    return DeviceMesh(device_type, [rank], _init_backend=False, _rank=rank)


class _PieceHooks:
    """DCP's chunk hooks of one piece, as bound methods of a module-level class (not closures).

    Why: the hooks are attributes of the local tensor, and ``torch.save(model.state_dict())``
    pickles them; closures cannot be pickled (the save failed half-way, leaving a corrupt file).
    """

    def __init__(self, shape, chunks, views, properties):
        self.shape, self.chunks, self.views, self.properties = shape, chunks, views, properties

    def write_items(self, fqn: str, _obj) -> List[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=self.properties, size=self.shape))
                for c in self.chunks]

    def chunk_list(self):
        return list(self.chunks)

    def tensor_shard(self, index: MetadataIndex) -> torch.Tensor:
        chunks = self.chunks
        if index.index is not None and index.index < len(chunks) and chunks[index.index].offsets == index.offset:
            return self.views[index.index]
        for c, v in zip(chunks, self.views):
            if c.offsets == index.offset:
                return v
        raise ValueError(f"{index.fqn}: this rank holds no chunk at offsets {tuple(index.offset)}")


def sharded_piece(local: torch.Tensor, shape: Sequence[int], lo: int) -> DTensor:
    """A DTensor of global ``shape`` whose data on this rank is ``local``: flat elements ``[lo, lo + numel)``."""
    shape = torch.Size(shape)
    if math.prod(shape) == 0:  # nothing to own: every rank describes the empty tensor the same way
        boxes = (Box((0,) * len(shape), tuple(shape), 0),)
    else:
        boxes = flat_boxes(shape, lo, lo + local.numel())
    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    dt = DTensor.from_local(local, _mesh(local.device.type, rank), [Replicate()], run_check=False,
                            shape=shape, stride=stride)
    flat = dt._local_tensor  # the tensor DTensor asks for the hooks (a view sharing ``local``'s storage)
    views = [flat[b.start - lo:b.start - lo + b.numel].view(b.sizes) for b in boxes]
    chunks = [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)) for b in boxes]
    properties = TensorProperties.create_from_tensor(flat)

    hooks = _PieceHooks(shape, chunks, views, properties)
    flat.__create_write_items__ = hooks.write_items
    flat.__create_chunk_list__ = hooks.chunk_list
    flat.__get_tensor_shard__ = hooks.tensor_shard
    return dt


def local_piece(value: Any, lo: int, hi: int, name: str) -> torch.Tensor:
    """This rank's flat elements ``[lo, hi)`` of a loaded value: a DTensor piece or a full tensor."""
    if isinstance(value, DTensor):
        local = value._local_tensor.reshape(-1)
        if local.numel() != hi - lo:
            raise ValueError(f"{name}: the state dict holds {local.numel()} elements on this rank, the model owns "
                             f"{hi - lo}; build the state dict with state_dict() of the model it is loaded into")
        return local
    return value.detach().reshape(-1)[lo:hi]

"""How one rank's flat piece of a parameter looks to ``torch.distributed.checkpoint``.

A rank owns a contiguous range of each flattened parameter, which is in
general not a rectangle of the parameter. ``flat_boxes`` cuts such a range
into at most ``2 * ndim - 1`` boxes (a partial leading row, the full rows, a
partial trailing row, recursively per dimension); each box is itself contiguous
in memory, so it is a plain view of the flat piece. ``sharded_piece`` wraps the
piece in a ``DTensor`` of the parameter's global shape (or, with a
``GlobalPlacement``, of a larger tensor it is a part of: its tensor-parallel
shard's place in the TP-global weight) whose local tensor
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


@dataclasses.dataclass(frozen=True)
class GlobalPlacement:
    """Where a rank's whole parameter sits inside a larger global tensor (e.g. its tensor-parallel shard).

    ``view``: the parameter's elements seen in this shape (row-major, same count;
    e.g. a fused ``[2 * f, h]`` weight as ``[2, f, h]``); ``shape``: the global
    tensor's; ``offsets``: the view's corner in it. The view must fit inside the
    global tensor in every dimension but the first: rows beyond ``shape[0]`` are
    outside (neither saved nor loaded), which is how a checkpoint with fewer
    padded vocabulary rows loads into a larger embedding. The caller (the
    Megatron-Core adapter) chooses the coordinates; the engine only applies them.
    """

    view: Tuple[int, ...]
    shape: Tuple[int, ...]
    offsets: Tuple[int, ...]

    def __post_init__(self):
        if not (len(self.view) == len(self.shape) == len(self.offsets)):
            raise ValueError(f"{self}: view, shape and offsets need one entry per dimension")
        if any(o < 0 or o + v > g for o, v, g in zip(self.offsets[1:], self.view[1:], self.shape[1:])):
            raise ValueError(f"{self}: the view leaves the global tensor outside its first dimension")

    @classmethod
    def identity(cls, shape: Sequence[int]) -> "GlobalPlacement":
        shape = tuple(shape)
        return cls(shape, shape, (0,) * len(shape))

    def region(self) -> Tuple[slice, ...]:
        """The view's elements in a full global tensor (rows outside clipped)."""
        return tuple(slice(o, min(o + v, g)) for o, v, g in zip(self.offsets, self.view, self.shape))


def _placed_boxes(placement: GlobalPlacement, lo: int, hi: int) -> Tuple[Box, ...]:
    """This flat range's boxes in global coordinates, rows outside the global tensor dropped.

    A box of ``flat_boxes`` spans several rows only when they are whole, so
    cutting rows off its end keeps it a contiguous prefix of the flat range.
    """
    out = []
    for b in flat_boxes(placement.view, lo, hi):
        offsets = tuple(o + p for o, p in zip(b.offsets, placement.offsets))
        if not offsets:
            out.append(b)
            continue
        rows = min(b.sizes[0], placement.shape[0] - offsets[0])
        if rows > 0:
            out.append(Box(offsets, (rows,) + b.sizes[1:], b.start))
    return tuple(out)


def sharded_piece(local: torch.Tensor, shape: Sequence[int], lo: int,
                  placement: "GlobalPlacement | None" = None) -> DTensor:
    """A DTensor whose data on this rank is ``local``: flat elements ``[lo, lo + numel)`` of a
    parameter of ``shape`` (which sits in a larger global tensor when ``placement`` says so)."""
    placement = placement or GlobalPlacement.identity(shape)
    if math.prod(placement.view) != math.prod(shape):
        raise ValueError(f"placement {placement} does not fit a parameter of shape {tuple(shape)}")
    glob = torch.Size(placement.shape)
    if math.prod(glob) == 0:  # nothing to own: every rank describes the empty tensor the same way
        boxes = (Box((0,) * len(glob), tuple(glob), 0),)
    else:
        boxes = _placed_boxes(placement, lo, lo + local.numel())
    stride = tuple(math.prod(glob[d + 1:]) for d in range(len(glob)))
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    dt = DTensor.from_local(local, _mesh(local.device.type, rank), [Replicate()], run_check=False,
                            shape=glob, stride=stride)
    flat = dt._local_tensor  # the tensor DTensor asks for the hooks (a view sharing ``local``'s storage)
    views = [flat[b.start - lo:b.start - lo + b.numel].view(b.sizes) for b in boxes]
    chunks = [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)) for b in boxes]
    properties = TensorProperties.create_from_tensor(flat)

    hooks = _PieceHooks(glob, chunks, views, properties)
    flat.__create_write_items__ = hooks.write_items
    flat.__create_chunk_list__ = hooks.chunk_list
    flat.__get_tensor_shard__ = hooks.tensor_shard
    flat._fsdp_piece = (tuple(shape), lo, placement)  # how ``on_host`` describes a copy the same way
    return dt


def on_host(value: torch.Tensor, pin: bool = False) -> torch.Tensor:
    """A host copy of a state-dict value (pinned when ``pin``), a piece described as the original.

    A background writer then reads host memory only; the copies are issued
    non-blocking, so the caller synchronises the device once for all of them.
    """
    if isinstance(value, DTensor) and hasattr(value._local_tensor, "_fsdp_piece"):
        local = value._local_tensor
        host = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
        host.copy_(local, non_blocking=pin)
        return sharded_piece(host, *local._fsdp_piece)
    host = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pin)
    return host.copy_(value.detach(), non_blocking=pin)


def local_piece(value: Any, lo: int, hi: int, name: str, placement: "GlobalPlacement | None" = None) -> torch.Tensor:
    """This rank's flat elements ``[lo, hi)`` of a loaded value: a DTensor piece or a full (global) tensor."""
    if isinstance(value, DTensor):
        local = value._local_tensor.reshape(-1)
        if local.numel() != hi - lo:
            raise ValueError(f"{name}: the state dict holds {local.numel()} elements on this rank, the model owns "
                             f"{hi - lo}; build the state dict with state_dict() of the model it is loaded into")
        return local
    value = value.detach()
    if placement is not None:
        region = value[placement.region()]
        if tuple(region.shape) != placement.view:
            raise ValueError(f"{name}: a full tensor of shape {tuple(value.shape)} does not cover this rank's "
                             f"part {placement}; load it through dcp.load into state_dict()")
        value = region.contiguous()
    return value.reshape(-1)[lo:hi]

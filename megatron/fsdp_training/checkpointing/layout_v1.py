"""Layout version 1 checkpoints read in TP-global coordinates, so they load at any TP, expert-TP and EP size.

Version 1 (before TP-global coordinates) stored each tensor-parallel rank's shard
as a tensor of its own: key ``tp{t}.<key>`` (TP > 1; the expert TP rank for expert
parameters) in TP-local shape, and legacy ``GroupedMLP`` weights under EP > 1 as
``[tp{t}.]ep{e}.<key>`` in their raw shape (``weight1`` ``[hidden, local experts x
(2 x) ffn / TP]``, ``weight2`` ``[local experts x ffn / TP, hidden]``); replicated
parameters were written once per TP rank (identical copies). Version 2 stores one
TP-global tensor per parameter (docs/checkpoints.md, "TP-global coordinates").

Why a translation of the metadata, not a conversion of the files: every version-1
chunk is, unchanged, a part of the version-2 tensor, so DCP can read it where it
is. ``translate`` rewrites the checkpoint's metadata (keys, global shapes, chunk
offsets) into version-2 terms and points each new chunk at the bytes of the old
one; the load then runs exactly as for a version-2 checkpoint, reading only the
byte ranges each rank needs. A TP-split shard is one box of the TP-global tensor
(its offsets shifted by ``t x`` its size along the partition dimension). A raw
grouped-GEMM shard's memory is the box ``[local experts of e, hidden, (2,),
ffn / TP of t]`` of ``[experts, hidden, (2,), ffn]`` in row-major order (how
GroupedMLP's forward views it); each of its chunks is a flat range of that
memory, which ``flat_boxes`` cuts into boxes of the view: those chunks are read
by ``TranslatedReader.read_data`` (the chunk's bytes, the range, reshaped).

How each parameter was split comes from the live model (``split_rules`` of the
adapter's chunks, gathered from every rank so that all translate alike); a
parameter without a rule is replicated and read from TP rank 0's copy.
"""

from __future__ import annotations

import dataclasses
import io
import math
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from megatron.fsdp.checkpoint.pieces import Box, flat_boxes

from .files import CheckpointError

# ``model.`` or ``optimizer.state.``, then the TP and EP rank prefixes of version 1, then the version-2 key.
_PREFIXED = re.compile(r"^(model\.|optimizer\.state\.)(?:tp(\d+)\.)?(?:ep(\d+)\.)?(.+)$")


def parse_key(key: str) -> Optional[Tuple[str, Optional[int], Optional[int], str]]:
    """``(head, tp rank, ep rank, key without the prefixes)`` of a version-1 key with a rank prefix, else None."""
    m = _PREFIXED.match(key)
    if m is None or (m.group(2) is None and m.group(3) is None):
        return None
    head, tp, ep, rest = m.groups()
    return head, None if tp is None else int(tp), None if ep is None else int(ep), rest


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one parameter (version-2 key, ``model.`` stripped) was split in version 1.

    ``split``: a TP shard along ``dim``. ``grouped``: a raw GroupedMLP weight of the
    TP-global ``shape`` (``[experts, hidden, (2,), ffn]`` or ``[experts, ffn, hidden]``),
    its ffn dimension ``dim``.
    """

    kind: str  # "split" | "grouped"
    dim: int
    shape: Tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Reshaped:
    """A new chunk's source: the stored chunk ``source``'s flat elements from ``start``, viewed as ``sizes``."""

    source: Any  # the version-1 chunk's _StorageInfo
    start: int
    sizes: Tuple[int, ...]


def _param_of(head: str, rest: str) -> str:
    return rest if head == "model." else rest.rsplit(".", 1)[0]  # optimizer.state.<param>.<state name>


def translate(metadata: Metadata, rules: Mapping[str, Rule]) -> Metadata:
    """``metadata`` of a version-1 checkpoint in version-2 keys and coordinates (the files are unchanged)."""
    prefixed: Dict[str, List[Tuple[int, int, str, TensorStorageMetadata]]] = {}
    out_md: Dict[str, Any] = {}
    renamed: Dict[str, str] = {}
    for key, md in metadata.state_dict_metadata.items():
        parsed = parse_key(key)
        if parsed is None:
            out_md[key] = md
            continue
        head, tp, ep, rest = parsed
        prefixed.setdefault(head + rest, []).append((tp or 0, ep or 0, key, md))
        renamed[key] = head + rest
    storage: Dict[MetadataIndex, Any] = {i: v for i, v in metadata.storage_data.items() if i.fqn not in renamed}
    for new_key, shards in sorted(prefixed.items()):
        head = "model." if new_key.startswith("model.") else "optimizer.state."
        rule = rules.get(_param_of(head, new_key[len(head):]))
        tps = sorted({t for t, _, _, _ in shards})
        eps = sorted({e for _, e, _, _ in shards})
        first = shards[0][3]
        if rule is None:  # replicated: TP rank 0's copy (every TP rank wrote the same values)
            if len(eps) > 1:
                raise CheckpointError(f"layout-1 key {shards[0][2]} has EP prefixes but this model does not split "
                                      f"{new_key} by expert: the checkpoint is not of this model")
            (_, _, old, md), = [s for s in shards if s[0] == tps[0]]
            chunks = [_renamed_chunk(storage, metadata, old, new_key, c, c.offsets) for c in md.chunks]
            out_md[new_key] = TensorStorageMetadata(md.properties, md.size, chunks)
            continue
        chunks = []
        if rule.kind == "split":
            size = tuple(first.size)
            glob = tuple(n * len(tps) if d == rule.dim else n for d, n in enumerate(size))
            for t, _, old, md in shards:
                for c in md.chunks:
                    offsets = tuple(o + t * size[d] if d == rule.dim else o for d, o in enumerate(c.offsets))
                    chunks.append(_renamed_chunk(storage, metadata, old, new_key, c, offsets))
        else:
            glob = rule.shape
            experts, ffn = glob[0] // len(eps), glob[rule.dim] // len(tps)
            view = (experts,) + tuple(ffn if d == rule.dim else n for d, n in enumerate(glob) if d > 0)
            for t, e, old, md in shards:
                if math.prod(md.size) != math.prod(view):
                    raise CheckpointError(f"layout-1 key {old} holds {tuple(md.size)}, not the {view} of this model's "
                                          f"{new_key}: the checkpoint is not of this model")
                shift = tuple(e * experts if d == 0 else t * ffn if d == rule.dim else 0 for d in range(len(view)))
                for c in md.chunks:
                    start = sum(o * math.prod(md.size[d + 1:]) for d, o in enumerate(c.offsets))
                    if flat_boxes(md.size, start, start + math.prod(c.sizes)) != (
                            Box(tuple(c.offsets), tuple(c.sizes), start),):
                        raise CheckpointError(f"layout-1 chunk {old} at {tuple(c.offsets)} is not one flat range "
                                              "of the parameter: not written by this job's engine")
                    source = metadata.storage_data[MetadataIndex(old, c.offsets)]
                    for box in flat_boxes(view, start, start + math.prod(c.sizes)):
                        offsets = torch.Size(o + s for o, s in zip(box.offsets, shift))
                        storage[MetadataIndex(new_key, offsets)] = _Reshaped(source, box.start - start, box.sizes)
                        chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(box.sizes)))
        out_md[new_key] = TensorStorageMetadata(first.properties, torch.Size(glob), chunks)
    planner_data = metadata.planner_data
    if isinstance(planner_data, dict):  # flat key -> its path in the nested state dict
        planner_data = {renamed.get(k, k): _renamed_path(v, renamed[k]) if k in renamed else v
                        for k, v in planner_data.items()}
    return dataclasses.replace(metadata, state_dict_metadata=out_md, storage_data=storage, planner_data=planner_data)


def _renamed_path(path: Tuple, new_key: str) -> Tuple:
    head = ".".join(map(str, path[:-1]))
    return tuple(path[:-1]) + (new_key[len(head) + 1:],)


def _renamed_chunk(storage, metadata, old: str, new: str, chunk, offsets) -> ChunkStorageMetadata:
    storage[MetadataIndex(new, torch.Size(offsets))] = metadata.storage_data[MetadataIndex(old, chunk.offsets)]
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=chunk.sizes)


class TranslatedReader(FileSystemReader):
    """A ``FileSystemReader`` of a version-1 checkpoint that DCP sees in version-2 terms (``translate``)."""

    def __init__(self, path, rules: Mapping[str, Rule]):
        super().__init__(str(path))
        self._rules = dict(rules)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return translate(super().read_metadata(*args, **kwargs), self._rules)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        """Plain chunks as DCP reads them; grouped-GEMM ranges: the stored chunk, the range, reshaped."""
        plain = [r for r in plan.items if not isinstance(self.storage_data[r.storage_index], _Reshaped)]
        future = super().read_data(dataclasses.replace(plan, items=plain), planner)
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if not isinstance(info, _Reshaped):
                continue
            source = info.source
            with self.fs.create_stream(self.fs.concat_path(self.path, source.relative_path), "rb") as stream:
                stream.seek(source.offset)
                stored = torch.load(io.BytesIO(stream.read(source.length)), map_location="cpu", weights_only=True)
            part = stored.reshape(-1)[info.start:info.start + math.prod(info.sizes)].view(info.sizes)
            target = planner.resolve_tensor(req).detach()
            target.copy_(narrow_tensor_by_index(part, req.storage_offsets, req.lengths))
            planner.commit_tensor(req, target)
        return future

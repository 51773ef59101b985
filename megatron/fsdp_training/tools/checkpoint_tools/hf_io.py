"""Streaming tensor I/O for the HuggingFace converter: one tensor in host memory at a time.

Why not the libraries' own calls: ``safetensors.torch.save_file`` takes a whole
shard as a dict, ``safe_open`` memory-maps the file (touched pages count as the
process's resident memory), and ``dcp.save`` / ``dcp.load`` want the whole state
dict. DeepSpeed's ``zero_to_fp32`` needed over 1 TB of host memory for an 80B model
(DeepSpeed #6526) for that reason. Here:

- ``DcpTensors`` reads the keys asked for from a DCP checkpoint (``dcp.load`` of a
  partial state dict: only those byte ranges are read);
- ``SafetensorsReader`` parses the header and reads one tensor with ``readinto``;
- ``write_safetensors_shards`` writes each shard's header from a plan (names,
  dtypes, shapes known up front) and then streams the tensors in order;
- ``write_dcp_lazily`` saves a DCP checkpoint whose tensors are produced one at a
  time when the writer asks for them (``SavePlanner.resolve_data``), planned from
  meta tensors of the right shapes.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Mapping, Sequence, Tuple

import torch

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPE_OF = {v: k for k, v in SAFETENSORS_DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def return_large_buffers_to_the_os() -> None:
    """Have glibc serve buffers of 1 MiB and more with their own mappings, unmapped when freed.

    Why: glibc raises its mmap threshold each time a mapped buffer is freed (up to 32 MiB),
    after which same-sized tensors come from the heap, whose freed pages it keeps: measured,
    from-hf's peak grew by +129 MiB instead of +48 MiB on a 160 MiB model. A fixed threshold
    (``mallopt(M_MMAP_THRESHOLD)``, as ``MALLOC_MMAP_THRESHOLD_`` would set) stops that. No-op
    where glibc is not the allocator.
    """
    from megatron.fsdp_training.allocator import fix_mmap_threshold

    fix_mmap_threshold(1 << 20)


def _status_bytes(field: str) -> int:
    """A memory line of /proc/self/status in bytes (``ru_maxrss``, the peak, where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (``VmHWM``)."""
    return _status_bytes("VmHWM")


def current_rss_bytes() -> int:
    return _status_bytes("VmRSS")


# ------------------------------------------------------------------ DCP, reading
class DcpTensors:
    """The tensors of one DCP checkpoint directory, read on request (full, unsharded tensors)."""

    def __init__(self, directory: Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.directory = Path(directory)
        metadata = FileSystemReader(str(directory)).read_metadata()
        self.meta = {k: (tuple(m.size), m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
                     if isinstance(m, TensorStorageMetadata)}

    def shape(self, key: str) -> Tuple[int, ...]:
        return self.meta[key][0]

    def read(self, keys: Sequence[str]) -> Dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        missing = [k for k in keys if k not in self.meta]
        if missing:
            raise KeyError(f"{self.directory} has no tensors {missing}")
        state = {k: torch.empty(self.meta[k][0], dtype=self.meta[k][1]) for k in keys}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(self.directory)), no_dist=True)
        return state


# ------------------------------------------------------------ DCP, lazy writing
def write_dcp_lazily(directory: Path, shapes: Mapping[str, Tuple[Tuple[int, ...], torch.dtype]],
                     produce: Callable[[str], torch.Tensor]) -> None:
    """``dcp.save`` of ``{key: tensor}`` where each tensor is ``produce(key)``, called once, when written.

    The plan is made from meta tensors; DCP's CPU writer resolves the items one by
    one (``_SerialCpuLoader``), so only the tensor being written is in memory.
    ``produce`` may compute several keys at once and cache them: it is called in
    the order of ``shapes``'s keys within each file (one file: thread_count 1).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    written: List[torch.Tensor] = []

    def release() -> None:
        # DCP's writer keeps every tensor of a file in a dict until the file is done (it needs them
        # for its safetensors format only); the previous tensor is written once the next is asked
        # for (serial loader), so its storage is released here and the dict keeps empty shells.
        while written:
            written.pop().untyped_storage().resize_(0)

    class LazyPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            release()
            tensor = produce(write_item.index.fqn).contiguous()
            want = shapes[write_item.index.fqn]
            if tuple(tensor.shape) != tuple(want[0]) or tensor.dtype != want[1]:
                raise RuntimeError(f"{write_item.index.fqn}: produced {tuple(tensor.shape)} {tensor.dtype}, "
                                   f"planned {want}")
            storage = tensor.untyped_storage()
            if storage.nbytes() != tensor.nbytes or not storage.resizable():
                # its own storage, one release() can free (a view's would be copied by DCP, out of
                # reach; one numpy has seen, e.g. read with readinto, cannot be resized)
                tensor = tensor.clone()
            written.append(tensor)
            return tensor

    state = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (shape, dtype) in shapes.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), thread_count=1),
                 planner=LazyPlanner(), no_dist=True)
    release()


# ------------------------------------------------------------ safetensors, reading
class SafetensorsReader:
    """Every tensor of a HuggingFace model directory (one file, or shards with an index), read on request."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        index = self.directory / INDEX
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (self.directory / SINGLE).is_file():
            files = [SINGLE]
        else:
            raise FileNotFoundError(f"{directory}: no {SINGLE} or {INDEX} (only safetensors checkpoints are read; "
                                    "save the model with save_pretrained(..., safe_serialization=True))")
        self.entries: Dict[str, Tuple[Path, int, int, torch.dtype, Tuple[int, ...]]] = {}
        for name in files:
            path = self.directory / name
            length, header = _header(path)
            for key, e in header.items():
                if key == "__metadata__":
                    continue
                begin, end = e["data_offsets"]
                self.entries[key] = (path, 8 + length + begin, end - begin, _DTYPE_OF[e["dtype"]], tuple(e["shape"]))

    def shape(self, key: str) -> Tuple[int, ...]:
        return self.entries[key][4]

    def dtype(self, key: str) -> torch.dtype:
        return self.entries[key][3]

    def read(self, key: str) -> torch.Tensor:
        return self.read_rows(key, 0, self.shape(key)[0] if self.shape(key) else 1)

    def read_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``key`` (all of a 0-d tensor), read on their own."""
        path, offset, size, dtype, shape = self.entries[key]
        rows = shape[0] if shape else 1
        row_bytes = size // rows if rows else 0
        stop = min(stop, rows)
        out = torch.empty((stop - start, *shape[1:]) if shape else (), dtype=dtype)
        view = out.view(-1).view(torch.uint8) if out.numel() else out.view(torch.uint8)
        with open(path, "rb") as f:
            f.seek(offset + start * row_bytes)
            if f.readinto(memoryview(view.numpy())) != (stop - start) * row_bytes:
                raise OSError(f"{path}: {key} is truncated")
        return out


def _header(path: Path) -> Tuple[int, Dict[str, dict]]:
    """A safetensors file's header length and header, checked against the file's size (one line if not)."""
    from .hf_layouts import ConversionError

    size = path.stat().st_size
    fix = "download or save the model again"
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if length is None or 8 + length > size:
            raise ConversionError(f"{path} is not a complete safetensors file ({size} bytes, too short for its "
                                  f"header): {fix}")
        try:
            header = json.loads(f.read(length))
            ends = [e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise ConversionError(f"{path} is not a safetensors file (its header does not parse): {fix}") from None
    needed = 8 + length + max(ends, default=0)
    if size < needed:
        raise ConversionError(f"{path} is truncated: its header describes {needed} bytes, the file has {size}: "
                              f"{fix}")
    return length, header


# ------------------------------------------------------------ safetensors, writing
def shard_plan(entries: Sequence[Tuple[str, Tuple[int, ...], torch.dtype]], max_shard_bytes: int) -> List[List[int]]:
    """Consecutive runs of ``entries`` (in order) of at most ``max_shard_bytes`` each (a larger tensor alone)."""
    shards: List[List[int]] = [[]]
    size = 0
    for i, (_, shape, dtype) in enumerate(entries):
        nbytes = _nbytes(shape, dtype)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def _nbytes(shape, dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def write_safetensors_shards(directory: Path, entries: Sequence[Tuple[str, Tuple[int, ...], torch.dtype]],
                             tensors: Iterable[Tuple[str, torch.Tensor]], max_shard_bytes: int) -> List[Path]:
    """Write ``tensors`` (yielded in the order of ``entries``) as safetensors shards plus the index.

    Each shard's header comes from ``entries``; then its tensors are written as
    they arrive, so at most one is held. Returns the files written.
    """
    directory.mkdir(parents=True, exist_ok=True)
    shards = shard_plan(entries, max_shard_bytes)
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map, total, written = {}, 0, []
    stream = iter(tensors)
    for name, members in zip(names, shards):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for i in members:
            key, shape, dtype = entries[i]
            nbytes = _nbytes(shape, dtype)
            header[key] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                           "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[key] = name
        total += offset
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        path = directory / name
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for i in members:
                key, shape, dtype = entries[i]
                got_key, tensor = next(stream)
                if got_key != key or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                    raise RuntimeError(f"expected {key} {tuple(shape)} {dtype}, got {got_key} "
                                       f"{tuple(tensor.shape)} {tensor.dtype}")
                data = tensor.detach().contiguous().reshape(-1)
                f.write(memoryview(data.view(torch.uint8).numpy()) if data.numel() else b"")
                del data, tensor
            f.flush()
            os.fsync(f.fileno())
        written.append(path)
    index = directory / INDEX
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    written.append(index)
    return written

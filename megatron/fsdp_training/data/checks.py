"""The data files and the vocabulary, checked at start-up (every rank the same, before any collective).

Why: an empty ``.bin`` ended training's start in 128 lines ending ``cannot mmap an empty
file``; a ``.bin`` truncated to 1,000 bytes in 124 lines at iteration 1 (the index still
pointed past its end); a tokenizer smaller than the data's largest token id in a 76-line
``IndexError`` inside the embedding. Each is now one line naming the file and the fix.
An ``.idx`` and a ``.bin`` written with different token dtypes (an int32 ``.bin``, a uint16
index) trained on tokens interleaved with zeros: the sizes must agree exactly.
``check_index_files`` reads the ``.idx`` header, three offsets and the sizes only; the vocabulary check reads
the token ids of the ``.bin`` once, each rank a share (``largest_token``; the maximum is
shared by one all-reduce), skipped where the file's dtype cannot hold an id as large as the
vocabulary.
"""

from __future__ import annotations

import math
import os
import struct
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from megatron.fsdp.commands import PREPROCESS

_HEADER = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 34  # magic 9, version 8, dtype code 1, sequence count 8, document count 8
# Megatron-Core's DType codes (megatron.core.datasets.indexed_dataset.DType).
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
           8: np.uint16}
_REBUILD = f"rebuild it with {PREPROCESS}"


def _index_geometry(idx: str):
    """``(dtype, sequence count, document count)`` of an ``.idx``, or a problem sentence."""
    size = os.path.getsize(idx)
    if size == 0:
        return f"{idx} is empty (0 bytes); {_REBUILD}"
    with open(idx, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if len(head) < _HEADER_BYTES or head[:9] != _HEADER or struct.unpack("<Q", head[9:17])[0] != 1:
        return f"{idx} is not a Megatron-Core index (bad header, {size} bytes); {_REBUILD}"
    code = head[17]
    sequences, documents = struct.unpack("<QQ", head[18:34])
    if code not in _DTYPES:
        return f"{idx} names an unknown token dtype (code {code}); {_REBUILD}"
    expected = _HEADER_BYTES + sequences * (4 + 8) + documents * 8  # (multimodal indexes append modes)
    if size < expected:
        return (f"{idx} has {size} bytes, its header ({sequences} sequences, {documents} document boundaries) "
                f"needs {expected}: truncated or damaged; {_REBUILD}")
    return np.dtype(_DTYPES[code]), sequences, documents


def check_index_files(prefix: str) -> Optional[str]:
    """The problem with ``prefix``'s ``.idx``/``.bin`` pair as one sentence, or None (both exist: the caller checks).

    The ``.bin`` must hold exactly the bytes the index describes: its last sequence's offset plus that
    sequence's tokens in the index's dtype (Megatron-Core's writer leaves nothing between or after). A
    ``.bin`` written with another dtype than its ``.idx`` (an int32 ``.bin`` with a uint16 index of the same
    documents) is larger or smaller by the ratio of the sizes: read through the index it was tokens
    interleaved with zeros, without a word. The document index must end at the sequence count."""
    idx, bin_path = prefix + ".idx", prefix + ".bin"
    geometry = _index_geometry(idx)
    if isinstance(geometry, str):
        return geometry
    dtype, sequences, documents = geometry
    if sequences == 0 or documents < 2:
        return f"{prefix}: the dataset holds no documents; preprocess a non-empty input"
    lengths_at, pointers_at = _HEADER_BYTES, _HEADER_BYTES + 4 * sequences
    last_length = int(np.fromfile(idx, dtype=np.int32, count=1, offset=lengths_at + 4 * (sequences - 1))[0])
    first_pointer, last_pointer = (int(np.fromfile(idx, dtype=np.int64, count=1, offset=pointers_at + 8 * i)[0])
                                   for i in (0, sequences - 1))
    last_document = int(np.fromfile(idx, dtype=np.int64, count=1,
                                    offset=pointers_at + 8 * sequences + 8 * (documents - 1))[0])
    if first_pointer != 0 or last_pointer % dtype.itemsize or last_document != sequences:
        return (f"{idx} is damaged (its offsets or document boundaries do not describe {sequences} sequences "
                f"of {dtype.name} tokens); {_REBUILD}")
    needed = last_pointer + last_length * dtype.itemsize
    size = os.path.getsize(bin_path)
    if size == 0:
        return f"{bin_path} is empty (0 bytes) but its index lists {sequences} sequences; {_REBUILD}"
    if size == needed:
        return None
    tokens = needed // dtype.itemsize
    other = [np.dtype(d).name for d in dict.fromkeys(_DTYPES.values())
             if np.dtype(d).itemsize != dtype.itemsize and size == tokens * np.dtype(d).itemsize]
    if other:
        return (f"{bin_path} has {size} bytes, {tokens} tokens of {np.dtype(other[0]).itemsize} bytes "
                f"({' or '.join(other)}), but {idx} says its tokens are {dtype.name} ({needed} bytes): the two "
                f"files were written with different token dtypes; {_REBUILD} (it writes both)")
    if size < needed:
        return (f"{bin_path} has {size} bytes, its index needs {needed} ({sequences} sequences of "
                f"{dtype.name} tokens): truncated; {_REBUILD}")
    return (f"{bin_path} has {size} bytes, {size - needed} more than {idx} describes ({sequences} sequences of "
            f"{dtype.name} tokens): the two files do not belong together; {_REBUILD}")


def largest_token(prefix: str, rank: int = 0, world: int = 1) -> int:
    """The largest token id in this rank's share of ``prefix``'s ``.bin`` (every ``world``-th block of 16M
    tokens; -1 for none)."""
    dtype = _index_geometry(prefix + ".idx")[0]
    data = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
    block = 1 << 24
    return max((int(data[i:i + block].max()) for i in range(rank * block, len(data), world * block)), default=-1)


def needs_scan(prefix: str, vocab_size: int) -> bool:
    """Whether a token id of ``prefix``'s dtype could reach ``vocab_size`` (uint16 data with a 50,257-entry
    vocabulary can; uint8 data with a 257-entry one cannot: no read)."""
    geometry = _index_geometry(prefix + ".idx")
    if isinstance(geometry, str):
        return False  # check_index_files reported it
    dtype = geometry[0]
    return not (dtype.kind in "ui" and np.iinfo(dtype).max < vocab_size)


def vocabulary_problem(prefix: str, top: int, vocab_size: int) -> Optional[str]:
    """The line for a largest token id ``top`` of ``prefix`` that the vocabulary (the embedding's rows) cannot
    hold, or None."""
    if top < vocab_size:
        return None
    return (f"--data-path {prefix} holds token id {top}, but the tokenizer's vocabulary has {vocab_size} "
            "entries: the data was preprocessed with another tokenizer; pass that one (--tokenizer-type and "
            "its files) or preprocess the data again with this one")


def blend_problem(flag: str, values: Optional[Sequence[str]]) -> Optional[str]:
    """A weighted blend (``W1 P1 W2 P2 ...``) whose weight is not positive, as one line, or None.

    Megatron-Core's ``BlendedDataset`` asserts every weight is positive: ``--data-path 0 a 1 b`` or
    ``-1 a 2 b`` stopped there with a bare ``AssertionError`` on rank 0 and a gloo error on the
    others, after the process groups were up."""
    from megatron.core.datasets.utils import get_blend_from_list

    blend = get_blend_from_list(list(values) if values else None)
    if not blend or blend[1] is None:
        return None
    for weight, prefix in zip(blend[1], blend[0]):
        if not (math.isfinite(weight) and weight > 0):
            return (f"{flag}: weight {weight:g} for {prefix}: blend weights must be positive (the blend samples "
                    f"each dataset in proportion to its weight); give {prefix} a positive weight, or leave it out")
    return None


def cache_directories(data_cache_path: Optional[str], prefixes: List[str]) -> List[str]:
    """Where Megatron-Core writes the dataset indexes: ``--data-cache-path``, else beside each prefix."""
    if data_cache_path:
        return [data_cache_path]
    return [os.path.join(prefix, "cache", "GPTDataset_indices") for prefix in prefixes]


def cache_dir_problem(directory: str, given: bool) -> Optional[str]:
    """The cache ``directory`` (created if missing) cannot take a file, as one line, or None.

    Megatron-Core's rank 0 writes the indexes there while the other ranks wait at a barrier: a
    read-only ``--data-cache-path`` ended in a 25-frame traceback and the others' gloo errors. A
    read-only directory that already holds Megatron-Core's caches (``*-description.txt``) is kept:
    a complete cache is read without writing."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write_probe_"):
            return None
    except OSError as exc:
        if path.is_dir() and any(path.glob("*-description.txt")):
            return None
        where = f"--data-cache-path {directory}" if given else f"the dataset index cache {directory} (beside the data)"
        return (f"{where} is not writable ({exc.strerror or exc}): Megatron-Core writes the dataset indexes "
                "there before training; pass --data-cache-path DIR, a writable directory")

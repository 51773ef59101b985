"""The data files and the vocabulary, checked at start-up (every rank the same, before any collective).

Why: an empty ``.bin`` ended training's start in 128 lines ending ``cannot mmap an empty
file``; a ``.bin`` truncated to 1,000 bytes in 124 lines at iteration 1 (the index still
pointed past its end); a tokenizer smaller than the data's largest token id in a 76-line
``IndexError`` inside the embedding. Each is now one line naming the file and the fix.
``check_index_files`` reads the ``.idx`` header and sizes only; the vocabulary check reads
the token ids of the ``.bin`` once, each rank a share (``largest_token``; the maximum is
shared by one all-reduce), skipped where the file's dtype cannot hold an id as large as the
vocabulary.
"""

from __future__ import annotations

import os
import struct
from typing import Optional

import numpy as np

_HEADER = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 34  # magic 9, version 8, dtype code 1, sequence count 8, document count 8
# Megatron-Core's DType codes (megatron.core.datasets.indexed_dataset.DType).
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
           8: np.uint16}
_REBUILD = "rebuild it with tools/preprocess_data.py"


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
    """The problem with ``prefix``'s ``.idx``/``.bin`` pair as one sentence, or None (both exist: the caller checks)."""
    idx, bin_path = prefix + ".idx", prefix + ".bin"
    geometry = _index_geometry(idx)
    if isinstance(geometry, str):
        return geometry
    dtype, sequences, documents = geometry
    if sequences == 0 or documents < 2:
        return f"{prefix}: the dataset holds no documents; preprocess a non-empty input"
    last_length = np.fromfile(idx, dtype=np.int32, count=1, offset=_HEADER_BYTES + 4 * (sequences - 1))
    last_pointer = np.fromfile(idx, dtype=np.int64, count=1, offset=_HEADER_BYTES + 4 * sequences + 8 * (sequences - 1))
    needed = int(last_pointer[0]) + int(last_length[0]) * dtype.itemsize
    size = os.path.getsize(bin_path)
    if size == 0:
        return f"{bin_path} is empty (0 bytes) but its index lists {sequences} sequences; {_REBUILD}"
    if size < needed:
        return (f"{bin_path} has {size} bytes, its index needs {needed} ({sequences} sequences of "
                f"{dtype.name} tokens): truncated; {_REBUILD}")
    return None


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

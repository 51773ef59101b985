"""A manifest of every checkpoint file (size and CRC-32), computed while writing, verified at load.

Why: a truncated ``.distcp``, a missing ``.metadata`` or a damaged tracker gave 44-134
lines of DCP traceback naming no file, and 16 KiB of a ``.distcp`` overwritten with
finite floats loaded silently and trained on. ``manifest.json`` in each checkpoint
lists each file with its size and CRC-32; the load checks it before DCP reads anything
and stops with one line naming the damaged file and the newest other checkpoint that
verifies (``--ckpt-step N``).

How "while writing": ``ChecksummingWriter`` is a DCP ``FileSystemWriter`` whose
filesystem hands out streams that update a CRC and a byte count on every ``write``,
so the checksum costs no second read. (A stream that was seeked is re-read once.)
Each rank checksums its own files; ``manifest_entries`` gathers them, rank 0 writes
the manifest. Verification at load is split over the ranks (each reads every N-th
file) and the verdict is shared, so it costs 1/N of a read per rank.

Kept apart from the save step's other work so that a background writer can call the
same functions: ``ChecksummingWriter`` for the DCP write, ``write_manifest`` at publish.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

MANIFEST = "manifest.json"
_CHUNK = 8 << 20


class _ChecksumStream(io.RawIOBase):
    """A write stream that keeps a running CRC-32 and size of what went through it."""

    def __init__(self, raw):
        self._raw = raw
        self.crc = 0
        self.size = 0
        self.seeked = False

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = self._raw.write(view)
        n = len(view) if n is None else n
        self.crc = zlib.crc32(view[:n], self.crc)
        self.size += n
        return n

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._raw.tell()

    def seek(self, offset, whence=0):
        self.seeked = True
        return self._raw.seek(offset, whence)

    def seekable(self) -> bool:
        return self._raw.seekable()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()


class _ChecksummingFileSystem(FileSystem):
    def __init__(self):
        super().__init__()
        self.files: Dict[str, Tuple[int, int]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _ChecksumStream(raw)
            yield stream
        name = Path(path).name
        size, crc = (stream.size, stream.crc) if not stream.seeked else file_checksum(Path(path))
        if name.endswith(".tmp"):  # DCP writes .metadata.tmp and renames it
            name = name[:-4]
        with self._lock:
            self.files[name] = (size, crc)


class ChecksummingWriter(FileSystemWriter):
    """``FileSystemWriter`` that records each file's size and CRC-32 as it writes (``.files``)."""

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        self.fs = _ChecksummingFileSystem()

    @property
    def files(self) -> Dict[str, Tuple[int, int]]:
        return dict(self.fs.files)


def file_checksum(path: Path) -> Tuple[int, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                return size, crc
            crc = zlib.crc32(block, crc)
            size += len(block)


def write_manifest(directory: Path, files: Dict[str, Tuple[int, int]], extra: List[str] = (),
                   source: Optional[Dict[str, object]] = None) -> None:
    """Rank 0: write ``manifest.json`` from every rank's ``files`` plus ``extra`` files checksummed here.

    ``source`` (a converter's output): what the checkpoint was converted from and whether that was verified
    (``unverified_source``); the checksums vouch for the files since they were written, not for what they were
    made from."""
    entries = {name: {"size": size, "crc32": crc} for name, (size, crc) in files.items()}
    for name in extra:
        size, crc = file_checksum(Path(directory) / name)
        entries[name] = {"size": size, "crc32": crc}
    record = {"version": 1, "files": dict(sorted(entries.items()))}
    if source is not None:
        record["source"] = source
    text = json.dumps(record, indent=1)
    with open(Path(directory) / MANIFEST, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path) -> Optional[Dict[str, Dict[str, int]]]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())["files"]
    except (ValueError, KeyError, UnicodeDecodeError):
        return {MANIFEST: {"size": -1, "crc32": -1}}  # the manifest itself is damaged


def unverified_source(what: str, path: str, why: str) -> Dict[str, object]:
    """The manifest's record of a conversion whose source could not be checked (``why``: it has no checksums)."""
    return {"format": what, "path": str(path), "verified": False, "why": why}


def read_source(directory: Path) -> Optional[Dict[str, object]]:
    """The manifest's ``source`` record (a converted checkpoint's), or None (a save's, or no manifest)."""
    try:
        source = json.loads((Path(directory) / MANIFEST).read_text()).get("source")
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        return None
    return source if isinstance(source, dict) else None


def source_line(source: Dict[str, object]) -> str:
    """What a manifest can and cannot vouch for in a converted checkpoint, as one clause."""
    return (f"source unverified: converted from {source.get('format')} {source.get('path')}, which "
            f"{source.get('why')}, so damage the source held before the conversion is in these files too")


def file_problem(directory: Path, name: str, entry: Dict[str, int], checksum: bool = True) -> Optional[str]:
    """What is wrong with one listed file, or None."""
    path = Path(directory) / name
    if entry.get("size", -1) < 0:
        return f"{path} is unreadable"
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != entry["size"]:
        return f"{path} has {size} bytes, the manifest says {entry['size']} (truncated or overwritten)"
    if checksum and file_checksum(path)[1] != entry["crc32"]:
        return f"{path} fails its checksum (its contents changed after the save)"
    return None


def manifest_required(common: Dict) -> bool:
    """Whether a checkpoint must have a manifest: its ``common.json`` says it was published with one (every
    save and every conversion publishes one since; ``files.ensure_manifest``)."""
    return bool(common.get("manifest"))


def _missing_manifest(directory: Path) -> List[str]:
    try:
        common = json.loads((Path(directory) / "common.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return []  # no readable common.json: the load names that itself
    if not isinstance(common, dict) or not manifest_required(common):
        return []
    return [f"{Path(directory) / MANIFEST} is missing (common.json says the checkpoint was published with one: "
            "without it nothing can be verified)"]


def verify(directory: Path, rank: int = 0, world: int = 1, checksum: bool = True) -> List[str]:
    """This rank's share of the checks (every ``world``-th file): the problems found (empty: fine).

    A checkpoint without a manifest is checked only for needing one (``manifest_required``: rank 0 says so);
    one written before manifests existed passes.
    """
    files = read_manifest(directory)
    if files is None:
        return _missing_manifest(directory) if rank == 0 else []
    names = sorted(files)
    return [p for p in (file_problem(directory, n, files[n], checksum) for n in names[rank::world]) if p]


def previous_good(root: Path, damaged: Path) -> Optional[int]:
    """The newest other ``iter_*`` checkpoint of ``root`` that passes ``--verify`` (sizes and checksums of every
    listed file, ``.metadata`` present, a manifest where one is required), so the hint never names a damaged one."""
    candidates = sorted((p for p in Path(root).glob("iter_*") if p.is_dir() and p.name != Path(damaged).name),
                        reverse=True)
    for path in candidates:
        if (path / ".metadata").is_file() and (path / "common.json").is_file() and not verify(path):
            try:
                return int(path.name[5:])
            except ValueError:
                continue
    return None

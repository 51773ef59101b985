"""Where a converter may write, and how it publishes: the rule every ``convert.py`` command follows.

Why: a converter writing into a directory a job saves to would otherwise replace its same-numbered
``iter_*`` and move the tracker back (10 -> 4, 10 -> 0) with exit status 0. So:

- a converter holds the destination's save lock while it writes (``.save_lock.json``, the lock a
  training job holds on its ``--save``: ``checkpointing/ownership.py``), so it never writes under a
  running job, nor a job starts saving into a directory being converted into;
- it writes only into a new or empty directory, or into any directory with ``--overwrite`` (then
  its own iteration is replaced, the other iterations are left);
- it never moves a tracker backwards: a directory whose tracker names a newer iteration is
  refused even with ``--overwrite`` (the job would resume from the converted weights' iteration
  and write over its newer checkpoints);
- the published checkpoint has a ``manifest.json`` (each file's size and CRC-32, the training
  job's own format: ``checkpointing/manifest.py``), so ``inspect.py --verify`` and the job's
  load check it like a checkpoint the job saved; it also records what it was converted from and
  that the source was not verified (no format a converter reads carries checksums it checks);
- a conversion that fails leaves the destination as it was (``abandon``: its temporary, its lock
  file and a directory it created are removed).

Every refusal is one line raised as ``SystemExit`` (exit code 1) before anything is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple


def check_destination(out: str, iteration: int, overwrite: bool = False) -> Path:
    """Refuse ``out`` unless it is new or empty (or ``overwrite``), and if its tracker is ahead of ``iteration``."""
    from megatron.fsdp_training.checkpointing import files

    root = Path(out)
    if root.exists() and not root.is_dir():
        raise SystemExit(f"error: {root} is a file, not a directory: choose a new directory for the converted "
                         "checkpoint")
    from megatron.fsdp_training.checkpointing.ownership import LOCK

    entries = sorted(p.name for p in root.iterdir() if p.name != LOCK) if root.is_dir() else []
    try:
        tracked = files.read_tracker(root) if entries else None
    except files.CheckpointError:
        tracked = None
    if tracked is not None and tracked > iteration:
        raise SystemExit(f"error: {root} holds a newer checkpoint (its tracker names iteration {tracked}, this "
                         f"conversion is iteration {iteration}): writing there would move the tracker backwards; "
                         "convert into a new directory")
    if entries and not overwrite:
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise SystemExit(f"error: {root} is not empty ({shown}): convert into a new or empty directory, or pass "
                         "--overwrite to replace its iteration "
                         f"{iteration}")
    return root


def check_empty(out: str, overwrite: bool = False) -> Path:
    """A HuggingFace directory or torch file to write: new, an empty directory, or ``overwrite``."""
    root = Path(out)
    taken = root.is_file() or (root.is_dir() and any(root.iterdir()))
    if taken and not overwrite:
        raise SystemExit(f"error: {root} exists and is not empty: write into a new or empty "
                         f"{'file' if root.is_file() else 'directory'}, or pass --overwrite to replace it")
    return root


@dataclasses.dataclass
class _Conversion:
    """The conversion under way in this process: what ``abandon`` undoes."""

    root: Path
    created: Optional[Path]  # the outermost directory this conversion made (``root`` or a missing parent)
    tmp: Optional[Path] = None


_pending: Optional[_Conversion] = None


def destination(out: str, iteration: int, overwrite: bool) -> Tuple[Path, Path]:
    """``check_destination``, the destination's lock, ``check_destination`` again under it (nothing else writes
    there now), then the temporary directory to write: the root and the temporary. A running job's ``--save``
    (its lock held) is refused with one line."""
    from megatron.fsdp_training.checkpointing import files, ownership

    global _pending
    root = check_destination(out, iteration, overwrite)  # refusals that need no lock touch nothing
    absolute = root.absolute()
    _pending = _Conversion(root, created=next((p for p in reversed([absolute, *absolute.parents]) if not p.exists()),
                                              None))
    try:
        root.mkdir(parents=True, exist_ok=True)
        problem, note = ownership.acquire_save_lock(root, label=f"the destination {root}",
                                                    fix="convert into another directory")
        if problem:
            raise SystemExit(f"error: {problem}")
        if note:
            print(note)
        check_destination(out, iteration, overwrite)
        _pending.tmp = files.temporary_dir(root, iteration, files.new_nonce())
        _pending.tmp.mkdir()
    except BaseException:
        abandon()
        raise
    return root, _pending.tmp


def abandon() -> Optional[Path]:
    """Undo the conversion under way (a failure): the destination is left as it was before it started; returns
    it (None: no conversion was under way)."""
    from megatron.fsdp_training.checkpointing import ownership

    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return None
    if pending.tmp is not None:
        shutil.rmtree(pending.tmp, ignore_errors=True)
    ownership.release_save_lock(pending.root)
    if pending.created is not None:
        shutil.rmtree(pending.created, ignore_errors=True)
    return pending.root


def publish(tmp: Path, root: Path, iteration: int, source: Optional[Dict[str, object]] = None) -> Path:
    """Checksum every file of ``tmp`` into its manifest (with ``source``: what it was converted from; by default
    a source that was not verified), then rename it into place, move the tracker and release the lock."""
    from megatron.fsdp_training.checkpointing import files, manifest, ownership

    global _pending
    if source is None:
        source = _hf_source(tmp)
    names = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name != manifest.MANIFEST)
    manifest.write_manifest(tmp, {}, extra=names, source=source)
    files.fsync_dir(tmp)
    final = files.publish(tmp, root, iteration)
    ownership.release_save_lock(root)
    _pending = None
    return final


def _hf_source(tmp: Path) -> Dict[str, object]:
    """The source record of a conversion that names none: ``from-hf``'s safetensors (its ``common.json`` says
    where from), which carry no checksums."""
    import json

    from megatron.fsdp_training.checkpointing import files, manifest
    from .source import NO_CHECKSUMS

    try:
        path = json.loads((tmp / files.COMMON).read_text())["hf"]["source"]
    except (OSError, ValueError, KeyError, TypeError):
        path = "(not recorded)"
    return manifest.unverified_source("HuggingFace safetensors", path, NO_CHECKSUMS)


def progress(total: int, what: str):
    """tqdm for a conversion (on a terminal; a log file gets the totals line only)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=what, unit="tensor", mininterval=1.0, disable=None)


@contextlib.contextmanager
def writing(out: str, iteration: int, overwrite: bool) -> Iterator[Tuple[Path, Path]]:
    """``destination``'s root and temporary for a body that may fail outside ``convert.py``'s ``main`` (which
    abandons on any failure itself): a failure then ``abandon``s too, so ``out`` is left as it was."""
    root, tmp = destination(out, iteration, overwrite)
    try:
        yield root, tmp
    except BaseException:
        abandon()
        raise

"""Where a converter may write, and how it publishes: the rule every ``convert.py`` command follows.

Why (issue 29, item 2): ``from-torch-dist`` and ``from-hf`` into a directory a job was saving to
replaced its same-numbered ``iter_*`` and moved the tracker back (10 -> 4, 10 -> 0), rc 0. So:

- a converter writes only into a new or empty directory, or into any directory with
  ``--overwrite`` (then its own iteration is replaced, the other iterations are left);
- it never moves a tracker backwards: a directory whose tracker names a newer iteration is
  refused even with ``--overwrite`` (the job would resume from the converted weights' iteration
  and write over its newer checkpoints);
- the published checkpoint has a ``manifest.json`` (each file's size and CRC-32, the training
  job's own format: ``checkpointing/manifest.py``), so ``inspect.py --verify`` and the job's
  load check it like a checkpoint the job saved.

Every refusal is one line raised as ``SystemExit`` (exit code 1) before anything is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Tuple


def check_destination(out: str, iteration: int, overwrite: bool = False) -> Path:
    """Refuse ``out`` unless it is new or empty (or ``overwrite``), and if its tracker is ahead of ``iteration``."""
    from megatron.fsdp_training.checkpointing import files

    root = Path(out)
    if root.exists() and not root.is_dir():
        raise SystemExit(f"error: {root} is a file, not a directory: choose a new directory for the converted "
                         "checkpoint")
    entries = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
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


def new_temporary(root: Path, iteration: int) -> Path:
    """The save protocol's temporary directory for ``iteration`` under ``root`` (created with ``root``)."""
    from megatron.fsdp_training.checkpointing import files

    root.mkdir(parents=True, exist_ok=True)
    tmp = files.temporary_dir(root, iteration, files.new_nonce())
    tmp.mkdir()
    return tmp


def publish(tmp: Path, root: Path, iteration: int) -> Path:
    """Checksum every file of ``tmp`` into its manifest, then rename it into place and move the tracker."""
    from megatron.fsdp_training.checkpointing import files, manifest

    names = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name != manifest.MANIFEST)
    manifest.write_manifest(tmp, {}, extra=names)
    files.fsync_dir(tmp)
    return files.publish(tmp, root, iteration)


def progress(total: int, what: str):
    """tqdm for a conversion (on a terminal; a log file gets the totals line only)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=what, unit="tensor", mininterval=1.0, disable=None)


def destination(out: str, iteration: int, overwrite: bool) -> Tuple[Path, Path]:
    """``check_destination`` then ``new_temporary``: the root and the temporary directory to write."""
    root = check_destination(out, iteration, overwrite)
    return root, new_temporary(root, iteration)

"""``--save`` / ``--load`` paths checked at start-up, stale temporaries, and running out of space.

Why at start-up: a save directory that cannot be written (``/etc/hostname/x``, a
read-only filesystem) used to fail at the first save, after training, with one raw
traceback per rank; ``--load`` naming a file trained from scratch silently. These
checks run in ``validate_args``, before any process group exists, so every rank stops
with the same one line.

Why clean temporaries: a save that died (a full disk, a kill) leaves
``.tmp_iter_*``; the resumed job filled the disk again and failed at its next save,
forever. Each temporary carries an owner file (host and pid of rank 0 of the job that
writes it); at start-up rank 0 removes those whose owner is a dead process of this
host, or that have no owner file and are older than ``ownership.STALE_AFTER_S``. A live job's
temporary (another job saving into the same directory) is never touched.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
from pathlib import Path
from typing import Iterable, Optional

from . import files
from .files import COMMON, TRACKER
from .ownership import is_stale

TEMPORARY_PREFIXES = (".tmp_iter_", ".old_iter_")


# ------------------------------------------------------------------ start-up checks
def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def save_dir_problem(path: str) -> Optional[str]:
    """Create ``path`` if needed and write a probe file there; the problem as one sentence, or None."""
    root = Path(path)
    for parent in [root] + list(root.parents):
        if parent.exists():
            if not parent.is_dir():
                return f"--save {path}: {parent} is a file, not a directory; pass a directory path"
            break
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write_probe_{socket.gethostname()}_{os.getpid()}"
        probe.write_bytes(b"probe")
        probe.unlink()
    except OSError as exc:
        return f"--save {path} is not writable ({exc.strerror or exc}); choose a writable directory"
    return None


def load_dir_problem(path: str) -> Optional[str]:
    """A ``--load`` path that exists but is not a save directory is an error (a missing one is a first run)."""
    root = Path(path)
    if not root.exists():
        return None
    if not root.is_dir():
        return f"--load {path} is a file, not a checkpoint directory (pass the --save directory of a run)"
    if (root / ".metadata").exists() or (root / COMMON).exists():
        parent, name = root.parent, root.name
        step = f" --ckpt-step {int(name[5:])}" if name.startswith("iter_") and name[5:].isdigit() else ""
        return (f"--load {path} is one checkpoint, not a save directory; pass its parent: --load {parent}{step}")
    entries = [e.name for e in root.iterdir() if not e.name.startswith(".")]
    if entries and TRACKER not in entries and not any(n.startswith("iter_") for n in entries):
        return (f"--load {path} is not a checkpoint directory: no {TRACKER} and no iter_* inside "
                f"(found {', '.join(sorted(entries)[:4])})")
    return None


# ------------------------------------------------------------------ temporaries
def remove_stale_temporaries(root: Path) -> list:
    """Delete the temporaries of ``root`` that no live job owns; returns their names."""
    removed = []
    if not Path(root).is_dir():
        return removed
    for entry in sorted(Path(root).iterdir()):
        if entry.is_dir() and entry.name.startswith(".tmp_iter_") and is_stale(entry):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


# ------------------------------------------------------------------ space
def directory_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())


def free_bytes(root: Path) -> int:
    return shutil.disk_usage(str(root)).free


def space_problem(root: Path, iteration: int, needed: int, free: int) -> Optional[str]:
    if needed <= free:
        return None
    return (f"not enough space to save iteration {iteration} in {root}: it needs {needed} bytes, {free} are free; "
            "free some space or pass another --save (nothing was written; earlier checkpoints are intact)")


def _causes(exc: BaseException) -> Iterable[BaseException]:
    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: exception or a wrapper}
        if isinstance(failures, dict):
            for v in failures.values():
                stack.append(v if isinstance(v, BaseException) else v[0] if isinstance(v, tuple) and v else None)


def is_out_of_space(exc: BaseException, root: Path) -> bool:
    """ENOSPC anywhere in the chain (DCP and torch.save report it as 'unexpected pos ...' too)."""
    for e in _causes(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e) + repr(getattr(e, "failures", ""))
        if "No space left" in text or "unexpected pos" in text or "Errno 28" in text:
            return True
    try:
        return free_bytes(root) < (1 << 20)
    except OSError:
        return False


# ------------------------------------------------------------------ which checkpoint
def find_checkpoint(args) -> Optional[Path]:
    """The directory ``--load`` (and ``--ckpt-step``) names, or None when there is no checkpoint yet."""
    root = Path(args.load)
    iteration = args.ckpt_step if args.ckpt_step is not None else files.read_tracker(root)
    if iteration is None:
        return None
    return files.checkpoint_dir(root, iteration)

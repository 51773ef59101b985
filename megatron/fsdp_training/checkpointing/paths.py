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

Why "which checkpoint" here (``find_checkpoint``, ``newer_checkpoint_problem``): a lost
tracker made the job start from scratch and overwrite ``iter_0000002``/``4`` while
``iter_0000010`` was newest; now the newest complete checkpoint that verifies is loaded,
and no run's saves may overwrite a newer checkpoint that verifies.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from . import files, ownership
from .files import COMMON, TRACKER
from .ownership import is_stale

TEMPORARY_PREFIXES = (".tmp_iter_", ".old_iter_")
# Megatron-LM's default directory of global non-persistent checkpoints, inside --save / --load.
NON_PERSISTENT_SUBDIR = "non_persistent"
Problems = Callable[[Path], List[str]]  # what is wrong with one checkpoint directory (empty: it verifies)


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
    entries = [e.name for e in root.iterdir() if not e.name.startswith(".") and e.name != NON_PERSISTENT_SUBDIR]
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


def set_aside_copies(root: Path) -> list:
    """``.old_iter_*``: copies moved aside by re-saves of an iteration (removed by the next save that completes)."""
    if not Path(root).is_dir():
        return []
    return sorted(e.name for e in Path(root).iterdir() if e.is_dir() and e.name.startswith(".old_iter_"))


# ------------------------------------------------------------------ space
def directory_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())


def free_bytes(root: Path) -> int:
    return shutil.disk_usage(str(root)).free


def space_problem(root: Path, iteration: int, needed: int, free: int, flag: str = "--save") -> Optional[str]:
    if needed <= free:
        return None
    return (f"not enough space to save iteration {iteration} in {root}: it needs {needed} bytes, {free} are free; "
            f"free some space or pass another {flag} (nothing was written; earlier checkpoints are intact)")


def is_out_of_space(exc: BaseException, root: Path) -> bool:
    """ENOSPC anywhere in the chain (DCP and torch.save report it as 'unexpected pos ...' too)."""
    for e in files.exception_chain(exc):
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
def complete_iterations(root: Path, complete: Callable[[Path], bool] = files.is_complete) -> List[int]:
    """The iterations of ``root``'s complete ``iter_*`` directories, newest first."""
    found = []
    for path in Path(root).glob("iter_*"):
        if path.is_dir() and path.name[5:].isdigit() and complete(path):
            found.append(int(path.name[5:]))
    return sorted(found, reverse=True)


def newest_verified(root: Path, problems: Problems, below: Optional[int] = None,
                    complete: Callable[[Path], bool] = files.is_complete) -> Tuple[Optional[int], List[int]]:
    """The newest complete checkpoint of ``root`` (below ``below``) whose ``problems`` are none, and the newer
    complete ones that failed. ``problems`` may be a collective: every rank walks the same list."""
    damaged = []
    for iteration in complete_iterations(root, complete):
        if below is not None and iteration >= below:
            continue
        if not problems(files.checkpoint_dir(root, iteration)):
            return iteration, damaged
        damaged.append(iteration)
    return None, damaged


def find_checkpoint(load: str, step: Optional[int], problems: Problems = lambda directory: [],
                    complete: Callable[[Path], bool] = files.is_complete) -> Optional[Path]:
    """The directory ``--load`` (``load``) and ``--ckpt-step`` (``step``) name, or None when there is no checkpoint
    yet.

    Without a tracker but with complete checkpoints (a tracker deleted or lost), the newest that verifies
    (``problems`` returns none: a collective for fsdp_dtensor) is loaded, said in one line: starting from
    scratch would overwrite them. A tracker naming a missing directory stops with the one to pass instead.
    """
    from ..logs.lines import print_rank_0

    root = Path(load)
    iteration = step if step is not None else files.read_tracker(root)
    if iteration is not None:
        try:
            return files.checkpoint_dir(root, iteration)
        except files.CheckpointError as exc:
            good, _ = newest_verified(root, problems, complete=complete)
            hint = (f"; the newest complete checkpoint that verifies is iteration {good}: pass --ckpt-step {good}"
                    if good is not None else f"; {root} holds no other complete checkpoint")
            raise files.CheckpointError(str(exc) + hint) from None
    good, damaged = newest_verified(root, problems, complete=complete)
    if good is None:
        if damaged:
            raise files.CheckpointError(
                f"no {TRACKER} in {root}, and none of its complete checkpoints verifies (iterations "
                f"{', '.join(map(str, damaged))}): nothing to resume from; pass another --load, or no --load to "
                "start from scratch (with another --save)")
        return None
    skipped = f"; newer ones that fail verification: {', '.join(map(str, damaged))}" if damaged else ""
    print_rank_0(f" no {TRACKER} in {root}: loading its newest complete checkpoint that verifies, "
                 f"iteration {good}{skipped}")
    return files.checkpoint_dir(root, good)


def newer_checkpoint_problem(save: Path, start: int, problems: Problems,
                             complete: Callable[[Path], bool] = files.is_complete) -> Optional[str]:
    """Saves of a run starting after iteration ``start`` would overwrite ``save``'s newer checkpoints and move
    its tracker back: a published one (at or below the tracker; any, without a tracker) that verifies stops
    start-up (the line returned); damaged or never published ones (a save killed between its rename and
    the tracker) are replaced, said in one line."""
    from ..logs.lines import print_rank_0

    newer = [i for i in complete_iterations(save, complete) if i > start]
    try:
        tracker = files.read_tracker(save)
    except files.CheckpointError:  # a damaged tracker: the load said so, or --ckpt-step chose
        tracker = None
    unpublished = [i for i in newer if tracker is not None and i > tracker]  # a save killed before its tracker
    newer = [i for i in newer if i not in unpublished]
    if unpublished:
        print_rank_0(f" --save {save}: iterations {', '.join(map(str, unpublished))} were never published (the "
                     f"tracker names {tracker}): replaced when this run saves them")
    good = [i for i in newer if not problems(files.checkpoint_dir(save, i))]
    if good:
        names = ", ".join(files.iteration_dir_name(i) for i in good)
        return (f"--save {save} holds {names}, newer than iteration {start} this run starts from: its saves would "
                "overwrite them and move the tracker back; resume from the newest with --load "
                f"{save} (no --ckpt-step), or pass another --save")
    if newer:
        print_rank_0(f" --save {save}: the damaged checkpoints of iterations {', '.join(map(str, newer))} (newer "
                     f"than iteration {start}) are replaced when this run saves those iterations")
    return None


# ------------------------------------------------------------------ who may use a non-persistent directory
# Why: a --non-persistent-global-ckpt-dir naming another run's --save deleted that run's checkpoints, and a second job
# given the first one's --non-persistent-local-ckpt-dir resumed the first job's training. The owner file
# (``ownership.DIRECTORY_OWNER``) names the job's --save; only that job saves there or resumes from there.
def non_persistent_owners(save: Optional[str], load: Optional[str], saving: bool) -> List[str]:
    """The paths a non-persistent directory's owner file may name for this job: its ``--save`` when it saves
    non-persistent checkpoints (``saving``: only the job that writes them may replace them), else its ``--load``
    and ``--save``."""
    if saving:
        return [save]
    return [p for p in (load, save) if p]


def global_dir_is_default(global_dir: str, save: Optional[str], load: Optional[str]) -> bool:
    """``--non-persistent-global-ckpt-dir`` (``global_dir``) spelt as its default, ``<--save>/non_persistent`` or
    ``<--load>/non_persistent``: inside that directory, owned with it (its lock and its rules)."""
    given = os.path.realpath(global_dir)
    return any(base and given == os.path.realpath(os.path.join(base, NON_PERSISTENT_SUBDIR))
               for base in (save, load))


def _checkpoints_in(directory: Path) -> List[str]:
    return sorted(e.name for e in Path(directory).iterdir()
                  if e.name == TRACKER or (e.name.startswith(("iter_",) + TEMPORARY_PREFIXES) and e.is_dir()))


def non_persistent_owner_problem(directory: Path, flag: str, owners: List[str], saving: bool) -> Optional[str]:
    """Why this job may not use the non-persistent ``directory`` (``flag``'s), or None. ``owners``: the paths this
    job answers to (its ``--save`` when it saves there; its ``--load`` too when it only loads)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    owner = ownership.directory_owner(directory)
    mine = {os.path.realpath(p) for p in owners if p}
    if owner is not None:
        if owner in mine:
            return None
        harm = "its non-persistent saves would replace them" if saving else "resuming them would continue that job"
        return (f"{flag} {directory} holds the non-persistent checkpoints of another job (--save {owner}; owner file "
                f"{directory / ownership.DIRECTORY_OWNER}): {harm}; pass another {flag}, or resume that job with "
                f"--load {owner} --save {owner}")
    held = _checkpoints_in(directory)
    if not held:
        return None
    shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
    harm = "its non-persistent saves would delete them" if saving else "they are not this job's to resume"
    return (f"{flag} {directory} holds checkpoints that no non-persistent save of this job wrote ({shown}; no "
            f"{ownership.DIRECTORY_OWNER}: another run's --save?): {harm}; pass a new or empty {flag}")

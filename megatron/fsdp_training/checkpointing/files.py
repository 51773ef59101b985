"""Checkpoint directories on disk: Megatron-LM's layout, published atomically, and fault injection.

Layout (Megatron-LM's)::

    DIR/latest_checkpointed_iteration.txt   the iteration of the newest complete checkpoint
    DIR/iter_0000100/                       one DCP checkpoint (.metadata, __*_*.distcp) + common.json

Why the protocol below: a process can die at any instant of a save (a node
failure, a pre-emption, an OOM kill). Every save writes into a private
temporary directory ``DIR/.tmp_iter_XXXXXXX_<nonce>``; only when every rank
has written (a barrier) does rank 0 make it visible with one atomic
``os.rename``, then replace the tracker atomically (temporary file, fsync,
``os.replace``), and only then delete older temporaries. The tracker therefore
always names a complete checkpoint: a crash before the tracker moves leaves
the previous checkpoint in charge; a crash after it, the new one.

Saving an iteration whose directory already exists (a stale one from a save
killed after its rename, or the same iteration saved again) first moves the old
directory aside to ``.old_iter_XXXXXXX_<nonce>``; should the process die between
the two renames, ``checkpoint_dir`` finds the set-aside copy.

Fault injection for tests: ``MEGATRON_FSDP_CKPT_FAULT=POINT[:RANK[:ITERATION]]``
makes rank ``RANK`` (default 0) SIGKILL itself at ``POINT`` of the save of
``ITERATION`` (default: any). Only this module reads the variable.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

from .ownership import OWNER, is_stale

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.json"
FAULT_ENV = "MEGATRON_FSDP_CKPT_FAULT"
# ``in_background_write``: in --async-save's writer thread, this rank's files written, training running;
# ``in_local_write``: a local non-persistent save, this rank's files written into its temporary, not renamed.
FAULT_POINTS = ("after_write", "before_rename", "after_rename_before_tracker", "after_tracker", "in_background_write",
                "in_local_write")
EVERY_RANK_POINTS = ("after_write", "in_background_write", "in_local_write")  # the others: rank 0's publish steps


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this run; the message names the keys or arguments."""


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception behind it: causes, contexts, and the per-rank failures DCP's
    ``CheckpointException`` carries."""
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


def failure_as_value(exc: BaseException) -> BaseException:
    """``exc`` kept past its ``except`` block as a value (a rank's write outcome, told to every rank by
    ``save_steps.finish``): its type and message; the frames it and the exceptions behind it passed through are
    cleared of their variables, and it keeps no traceback and no chain.

    A failed DCP write's frames hold a ``BytesIO`` and a view of its buffer (``getbuffer()``), and the traceback
    sits in reference cycles (the frame that keeps the error; ``contextlib``'s exits; closures). Left to the
    collector, which frees a cycle in any order, CPython 3.12 can clear the ``BytesIO`` first and crash releasing
    the view. Cleared here, while the error is handled, they are freed by reference counting, in order.
    """
    for e in list(exception_chain(exc)):
        traceback.clear_frames(e.__traceback__)
    exc.__traceback__ = None
    exc.__cause__ = exc.__context__ = None
    return exc


def check_fault_spec(world_size: Optional[int] = None) -> None:
    """Reject a spec that would never fire (a misspelt point, a rank outside the job, a bad number) up front.

    A typo would otherwise test nothing, silently. ``validate_args`` calls it at start-up.
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    parts = spec.split(":")
    form = f"{FAULT_ENV}={spec!r} (form POINT[:RANK[:ITERATION]])"
    if parts[0] not in FAULT_POINTS or len(parts) > 3:
        raise ValueError(f"{form}: the point must be one of {', '.join(FAULT_POINTS)}")
    for label, value in zip(("RANK", "ITERATION"), parts[1:]):
        if value and not value.isdigit():
            raise ValueError(f"{form}: {label} must be a non-negative integer, got {value!r}")
    if world_size is not None and len(parts) > 1 and parts[1] and int(parts[1]) >= world_size:
        raise ValueError(f"{form}: rank {parts[1]} does not exist in a job of {world_size} ranks")
    if parts[0] not in EVERY_RANK_POINTS and len(parts) > 1 and parts[1] and int(parts[1]) != 0:
        raise ValueError(f"{form}: only rank 0 reaches {parts[0]} (it publishes the checkpoint); use rank 0")


def fault_point(point: str, iteration: int, rank: int) -> None:
    """SIGKILL this process here if ``MEGATRON_FSDP_CKPT_FAULT`` names this point, rank and iteration."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    parts = spec.split(":") + ["", ""]
    if parts[0] != point or int(parts[1] or 0) != rank or (parts[2] and int(parts[2]) != iteration):
        return
    print(f"[rank {rank}] {FAULT_ENV}: killing this process at {point} of the save of iteration {iteration}",
          flush=True)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def new_nonce() -> str:
    return secrets.token_hex(4)


def temporary_dir(root: Path, iteration: int, nonce: str) -> Path:
    return root / f".tmp_{iteration_dir_name(iteration)}_{nonce}"


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_common(directory: Path, common: Dict[str, Any]) -> None:
    write_file_durably(directory / COMMON, json.dumps(common, indent=1, sort_keys=True))


def read_common(directory: Path) -> Dict[str, Any]:
    path = Path(directory) / COMMON
    if not path.is_file():
        from megatron.fsdp.mcore.trainer_checkpoints import megatron_lm_checkpoint_in_job

        raise CheckpointError(megatron_lm_checkpoint_in_job(directory) or
                              f"{directory} has no {COMMON}: not a checkpoint written with --ckpt-format fsdp_dtensor")
    try:
        with open(path) as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is damaged ({exc.__class__.__name__}); pass --ckpt-step N to load another "
                              "iteration") from None


def read_tracker(root: Path) -> Optional[int]:
    """The iteration the tracker names, or None when there is no complete checkpoint yet."""
    path = Path(root) / TRACKER
    if not path.is_file():
        return None
    text = path.read_bytes()[:64].decode("utf-8", errors="replace").strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} holds {text[:32]!r}, not an iteration number: it is damaged; pass "
                              "--ckpt-step N to load iteration N (the iter_* directories present)") from None


def write_tracker(root: Path, iteration: int) -> None:
    """Replace the tracker atomically: readers see the old iteration or the new one, never a torn file."""
    tmp = root / f".{TRACKER}.{new_nonce()}.tmp"
    write_file_durably(tmp, f"{iteration}\n")
    os.replace(tmp, root / TRACKER)
    fsync_dir(root)


def is_complete(directory: Path) -> bool:
    return (directory / ".metadata").is_file() and (directory / COMMON).is_file()


def checkpoint_dir(root: Path, iteration: int) -> Path:
    """The directory of ``iteration``; a set-aside copy if a re-save of it died between its two renames."""
    root = Path(root)
    final = root / iteration_dir_name(iteration)
    if final.is_dir():
        return final
    for old in sorted(root.glob(f".old_{final.name}_*")):
        if is_complete(old):
            return old
    raise CheckpointError(f"{root}: no checkpoint directory {final.name} (the tracker or --ckpt-step names "
                          f"iteration {iteration})")


def ensure_manifest(tmp: Path) -> None:
    """Give an ``fsdp_dtensor`` checkpoint written without a manifest (the converters) one, and mark its
    ``common.json`` as published with one, so that every checkpoint published from now on can be verified and
    a deleted manifest is noticed (``manifest.manifest_required``). A save wrote both already: nothing to do."""
    from . import manifest

    path = tmp / COMMON
    if (tmp / manifest.MANIFEST).is_file() or not path.is_file():
        return
    common = json.loads(path.read_text())
    if common.get("format") != "fsdp_dtensor":
        return
    if not common.get("manifest"):
        common["manifest"] = manifest.MANIFEST
        write_common(tmp, common)
    names = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name != OWNER)
    manifest.write_manifest(tmp, {}, extra=names)


def publish(tmp: Path, root: Path, iteration: int, rank: int = 0) -> Path:
    """Rank 0, after every rank wrote ``tmp``: rename it into place, move the tracker, clean up."""
    ensure_manifest(tmp)
    final = root / iteration_dir_name(iteration)
    if final.exists():
        os.rename(final, root / f".old_{final.name}_{new_nonce()}")
    fault_point("before_rename", iteration, rank)
    os.rename(tmp, final)
    fsync_dir(root)
    fault_point("after_rename_before_tracker", iteration, rank)
    write_tracker(root, iteration)
    fault_point("after_tracker", iteration, rank)
    remove_temporaries(root)
    return final


def _owned_by_other(tmp: Path) -> bool:
    try:
        owner = json.loads((tmp / OWNER).read_text())
    except (OSError, ValueError):
        return False
    return owner.get("pid") != os.getpid()


def remove_temporaries(root: Path) -> None:
    """Delete unfinished saves and set-aside copies; only safe once the tracker names a complete checkpoint."""
    for entry in Path(root).iterdir():
        if entry.name.startswith(".tmp_iter_") and entry.is_dir() and not is_stale(entry) and _owned_by_other(entry):
            continue  # another live job is writing it
        if entry.name.startswith((".tmp_iter_", ".old_iter_")) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.name.startswith(f".{TRACKER}.") and entry.name.endswith(".tmp"):
            entry.unlink(missing_ok=True)

"""Who owns a checkpoint temporary: an owner file with the host, pid and start time of the job writing it.

Also the lock of a ``--save`` directory (``acquire_save_lock``), which names its holder the same way, and the
owner file of a non-persistent checkpoint directory (``paths.non_persistent_owner_problem``), which names the job
whose checkpoints it holds.

Rank 0 of a saving job marks each ``.tmp_iter_*`` it creates (``write_owner``). A temporary is
stale (``is_stale``) when its owner is a dead process of this host, or, without an owner file or
from another host, when it is older than ``STALE_AFTER_S``; only stale temporaries are removed
(``paths.remove_stale_temporaries``, ``files.remove_temporaries``), so a live job's save in the
same directory is never touched. One module, so that ``files`` and ``paths`` both read the rule
without importing each other.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

OWNER = ".owner.json"
STALE_AFTER_S = 3600.0


def write_owner(tmp: Path) -> None:
    """Mark ``tmp`` as owned by this live process (rank 0 of the saving job)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale(tmp: Path, now: Optional[float] = None) -> bool:
    """No live job owns ``tmp``."""
    now = time.time() if now is None else now
    try:
        owner = json.loads((tmp / OWNER).read_text())
    except (OSError, ValueError):
        try:
            return now - tmp.stat().st_mtime > STALE_AFTER_S
        except OSError:
            return False
    if owner.get("host") == socket.gethostname():
        return owner.get("pid") != os.getpid() and not _alive(int(owner.get("pid", -1)))
    return now - float(owner.get("time", now)) > STALE_AFTER_S


# ------------------------------------------------------------------ the --save lock
# Why: two jobs given one --save both "saved" every checkpoint, each replacing the other's iter_*.
# Rank 0 of a job holds ``LOCK`` in its --save directory for the job's life: an flock (the kernel drops it when
# the holder dies, however it dies, on local file systems and NFS) on a file naming the holder. Where the file
# system has no flock, the holder's pid decides (alive on this host: held; dead: taken over). A clean exit
# removes the file; one left by a killed job is taken over with one line.
LOCK = ".save_lock.json"
_held: dict = {}  # resolved --save path -> open lock file of this process


def _process_start(pid: int) -> Optional[str]:
    """The kernel's start time of ``pid`` (so a recycled pid is not mistaken for the holder), if readable."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
            "time": time.time()}


def _describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("time", 0))))
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {started}"


def _holder_alive(holder: dict) -> bool:
    """Only decidable on the holder's host; a holder elsewhere counts as alive."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = int(holder.get("pid", -1))
    start = holder.get("pid_start")
    return pid > 0 and _alive(pid) and (start is None or _process_start(pid) in (None, start))


def _read_holder(path: Path) -> Optional[dict]:
    if path.is_symlink():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _open_lock_file(path: Path):
    """The lock file, created if missing, never through a symbolic link (``O_NOFOLLOW``): a tree copied with
    ``cp -rs`` has its lock file as a link to the original's, and writing through it would replace a file outside
    this directory (another job's lock)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    return os.fdopen(fd, "r+")


def _symlink_problem(path: Path, label: str) -> str:
    return (f"{label}: its lock file {path} is a symbolic link (to {os.readlink(path)}; a tree copied with cp -rs?): "
            "the lock is never written through a link; delete the link (the file it points to is left as it is) "
            "and start again")


def _await_holder(path: Path, patience_s: float = 2.0) -> dict:
    """The holder's record of a lock held now: it writes who it is just after it locks, so a job that starts at
    the same moment may find the file still empty; it waits a moment for the name rather than say "None"."""
    import time

    deadline = time.monotonic() + patience_s
    holder = _read_holder(path) or {}
    while not holder and time.monotonic() < deadline:
        time.sleep(0.05)
        holder = _read_holder(path) or {}
    return holder


def acquire_save_lock(root: Path, label: Optional[str] = None,
                      fix: str = "pass another --save") -> "tuple[Optional[str], Optional[str]]":
    """Rank 0 (or a converter): hold ``root``'s lock for this process; returns ``(problem, note)``: the line that
    stops start-up (another live job holds it, or the lock file is a symbolic link), and the line saying a dead
    job's lock was taken over. ``label`` names the directory in those lines (``--save ROOT``), ``fix`` says what
    to do instead of waiting."""
    import errno
    import fcntl

    root = Path(root)
    label = label or f"--save {root}"
    key = str(root.resolve())
    if key in _held:
        return None, None
    path = root / LOCK
    note = None
    for _ in range(5):
        if path.is_symlink():
            return _symlink_problem(path, label), None
        try:
            f = _open_lock_file(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # made a link between the check and the open
                return _symlink_problem(path, label), None
            raise
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            f.close()
            holder = _await_holder(path)
            return (f"{label} is in use by another job ({_describe(holder)}; lock file {path}): two jobs "
                    f"saving into one directory overwrite each other's checkpoints; wait for it to end, stop it, "
                    f"or {fix}"), None
        except OSError:  # no flock on this file system: the holder's pid decides
            locked = False
        try:
            if os.fstat(f.fileno()).st_ino != os.lstat(path).st_ino:
                f.close()  # removed and re-created by a releasing or competing job meanwhile: try again
                continue
        except FileNotFoundError:
            f.close()
            continue
        holder = _read_holder(path)
        if holder and (holder.get("host"), holder.get("pid")) != (socket.gethostname(), os.getpid()):
            if not locked and _holder_alive(holder):
                f.close()
                return (f"{label} is in use by another job ({_describe(holder)}; lock file {path}): wait for "
                        f"it to end, stop it, or {fix} (if that job is gone, delete the lock file)"), None
            note = f" took over the lock of {label} from a job that is gone ({_describe(holder)})"
        f.seek(0)
        f.truncate()
        f.write(json.dumps(_me()))
        f.flush()
        os.fsync(f.fileno())
        _held[key] = f
        return None, note
    return f"{label}: could not take its lock file {path} (it keeps being replaced)", None


def release_save_lock(root: Path) -> None:
    """Rank 0 at the end of the job: remove the lock file and drop the lock (nothing if not held here)."""
    f = _held.pop(str(Path(root).resolve()), None)
    if f is None:
        return
    try:
        (Path(root) / LOCK).unlink()
    except OSError:
        pass
    f.close()


# ------------------------------------------------------------------ who owns a non-persistent directory
# Why: a --non-persistent-global-ckpt-dir naming another run's --save deleted that run's checkpoints (its non-persistent
# saves keep only the newest), and a second job given the first one's --non-persistent-local-ckpt-dir resumed the first
# job's training. A non-persistent directory outside --save belongs to the job whose --save its owner file names
# (written when the job first saves there); only that job saves there or resumes from it (a job that only loads:
# the one whose --load it is). A directory that holds checkpoints and no owner file is no job's non-persistent one.
DIRECTORY_OWNER = ".non_persistent_owner.json"


def directory_owner(directory: Path) -> Optional[str]:
    """The ``--save`` the owner file of ``directory`` names (resolved when written), or None without one."""
    holder = _read_holder(Path(directory) / DIRECTORY_OWNER)
    return holder.get("save") if isinstance(holder, dict) else None


def claim_directory(directory: Path, save: str) -> None:
    """Name this job (its ``--save``) as the owner of ``directory`` (atomically; a link there is replaced, its
    target left as it is)."""
    path = Path(directory) / DIRECTORY_OWNER
    tmp = Path(directory) / f".{DIRECTORY_OWNER}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps({"save": os.path.realpath(save), **_me()}))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

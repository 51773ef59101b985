"""Who owns a checkpoint temporary: an owner file with the host, pid and start time of the job writing it.

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

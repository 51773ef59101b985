"""Cases about the worker pool itself (tests/engine/test_pool_hygiene.py)."""

import os
import threading

_held = threading.Event()


def pid_after_starting_threads(ctx, threads: int = 0) -> int:
    """Start ``threads`` idle threads that outlive the case (as a leaked group's threads do); return the pid."""
    for _ in range(threads):
        threading.Thread(target=_held.wait, daemon=True).start()
    return os.getpid()


def environment_after_setting(ctx, name: str, value: str) -> "str | None":
    """Return what ``name`` was when the case started, then set it to ``value`` (as a Megatron-Core model
    sets ``NVTE_*_ATTN`` for its attention backend)."""
    before = os.environ.get(name)
    os.environ[name] = value
    return before

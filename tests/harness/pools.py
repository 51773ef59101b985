"""The session's pools, one per (size, purpose): started on first use, shared by every module.

``pool_of(n)`` is the Megatron pool of ``n`` ranks (or, with ``purpose``, a pool of its
own); ``tests/conftest.py`` hands some of them out as fixtures and closes them (see its
docstring for which, and when). A pool that a case killed (a hang or a crash) is
restarted on the next request.
"""

from typing import Dict, Tuple

from .pool import WorkerPool


_pools: Dict[Tuple[int, str], WorkerPool] = {}


def pool_of(size: int, purpose: str = "") -> WorkerPool:
    key = (size, purpose)
    pool = _pools.get(key)
    if pool is None or not pool.alive:
        pool = _pools[key] = WorkerPool(size)
    return pool


def close(key: Tuple[int, str]) -> None:
    pool = _pools.pop(key, None)
    if pool is not None:
        pool.close()


def close_all_but(keep: Tuple[int, str]) -> None:
    for key in [k for k in _pools if k != keep]:
        close(key)

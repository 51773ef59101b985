"""The session's pools, one per (size, purpose): started on first use, shared by every module.

``pool_of(n)`` is the Megatron pool of ``n`` ranks (or, with ``purpose``, a pool of its
own); ``tests/conftest.py`` hands some of them out as fixtures and closes them (see its
docstring for which, and when). A pool that a case killed (a hang or a crash) is
restarted on the next request.
"""

from typing import Dict, Tuple

from megatron.fsdp.testing.pool import WorkerPool


# A spawned worker imports torch and Megatron-Core itself (~4-5 s of CPU each, and a session
# starts ~20 workers); the session's workers are forked instead from one process that
# imported these once (WorkerPool's ``preload``). Forking after these imports is safe: they
# start no thread.
PRELOAD = ("megatron.fsdp.testing.worker_setup", "torch", "torch.distributed", "torch._dynamo", "megatron.fsdp", "megatron.core.models.gpt",
           "megatron.core.optimizer", "megatron.fsdp_training.training", "megatron.fsdp.testing.pool")
_pools: Dict[Tuple[int, str], WorkerPool] = {}


def pool_of(size: int, purpose: str = "") -> WorkerPool:
    key = (size, purpose)
    pool = _pools.get(key)
    if pool is None or not pool.alive:
        pool = _pools[key] = WorkerPool(size, preload=PRELOAD)
    return pool


def close(key: Tuple[int, str]) -> None:
    pool = _pools.pop(key, None)
    if pool is not None:
        pool.close()


def close_all() -> None:
    for key in list(_pools):
        close(key)

"""A 4-rank gloo pool for the Megatron-Core cases.

``initialize_model_parallel`` creates groups over the whole world, so every Megatron
case runs on all ranks of a pool whose size is exactly ``tp * pp * cp * dp``; four
ranks cover every 2 x 2 topology. Kept apart from the 6-rank engine pool.
"""

import pytest

from tests.harness import WorkerPool

MCORE_POOL_SIZE = 4
_pool = None


@pytest.fixture
def mcore_pool():
    """The session's 4-rank pool, started on first use; restarted only after a case killed it."""
    global _pool
    if _pool is None or not _pool.alive:
        _pool = WorkerPool(MCORE_POOL_SIZE)
    yield _pool


def pytest_sessionfinish(session, exitstatus):
    if _pool is not None:
        _pool.close()

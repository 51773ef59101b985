import os

import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from tests.harness import WorkerPool  # noqa: E402

POOL_SIZE = 6  # 2 x 3 and 3 x 2 meshes need six ranks
_pool = None


@pytest.fixture
def pool():
    """The shared gloo pool; restarted only after a case killed it (a hang or a crash)."""
    global _pool
    if _pool is None or not _pool.alive:
        _pool = WorkerPool(POOL_SIZE)
    yield _pool


def pytest_sessionfinish(session, exitstatus):
    if _pool is not None:
        _pool.close()

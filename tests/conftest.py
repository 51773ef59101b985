"""Two long-lived gloo pools shared by the whole session.

``pool``: six ranks for the engine (subgroups of every size, meshes 2 x 2, 3 x 2, 2 x 3).
``mcore_pool``: four ranks for Megatron-Core cases; ``initialize_model_parallel``
creates groups over the whole world, so every Megatron case runs on all ranks of a
pool whose size is exactly ``tp * pp * cp * dp``, and four covers every 2 x 2 topology.
A pool is started on first use and restarted only after a case killed it (a hang or
a crash).
"""

import os

import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from tests.harness import WorkerPool  # noqa: E402

_pools = {}


def _pool_of(size: int) -> WorkerPool:
    pool = _pools.get(size)
    if pool is None or not pool.alive:
        pool = _pools[size] = WorkerPool(size)
    return pool


@pytest.fixture
def pool():
    yield _pool_of(6)


@pytest.fixture
def mcore_pool():
    yield _pool_of(4)


@pytest.fixture(scope="module")
def moe_pool():
    """Four ranks for MoE cases, closed after the module that uses it.

    Megatron-Core's MoE layers keep their process groups alive after the model is
    dropped, and every gloo group keeps threads polling; a pool of its own takes
    those threads away when the MoE cases are done.
    """
    pool = WorkerPool(4)
    yield pool
    pool.close()


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()

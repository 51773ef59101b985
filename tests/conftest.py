"""Long-lived gloo pools shared by the whole session: one per world size (and one for MoE).

``pool``: six ranks for the engine (subgroups of every size, meshes 2 x 2, 3 x 2, 2 x 3).
``mcore_pool``: four ranks for Megatron-Core cases; ``initialize_model_parallel``
creates groups over the whole world, so every Megatron case runs on all ranks of a
pool whose size is exactly ``tp * pp * cp * dp``, and four covers every 2 x 2 topology.
``_pool_of(n)`` gives the Megatron pool of ``n`` ranks to any module (checkpoints
resharded to 1, 2 and 3 ranks, ``pretrain_gpt`` on 2). ``moe_pool``: four ranks of
their own for the MoE cases of every module (Megatron-Core's MoE layers create
process groups of their own; keeping them out of ``mcore_pool`` keeps its workers
lean; it closes after the last test that uses it). A pool is started on first use, shared by every module that asks for the same
one, and restarted only after a case killed it (a hang or a crash). See
docs/testing.md for the time budget.
"""

import os

import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from tests.harness import WorkerPool  # noqa: E402

_pools = {}


def _pool_of(size: int, purpose: str = "") -> WorkerPool:
    key = (size, purpose)
    pool = _pools.get(key)
    if pool is None or not pool.alive:
        pool = _pools[key] = WorkerPool(size)
    return pool


@pytest.fixture
def pool():
    yield _pool_of(6)


@pytest.fixture
def mcore_pool():
    yield _pool_of(4)


_last_moe_test = []  # the last collected test that uses ``moe_pool``: the pool closes after it


def pytest_collection_modifyitems(session, config, items):
    users = [item for item in items if "moe_pool" in getattr(item, "fixturenames", ())]
    _last_moe_test[:] = users[-1:]


@pytest.fixture
def moe_pool(request):
    yield _pool_of(4, "moe")
    if _last_moe_test and request.node is _last_moe_test[0]:
        _pools.pop((4, "moe")).close()


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()

"""Long-lived gloo pools shared by the whole session: one per world size (and one for MoE).

``pool``: six ranks for the engine (subgroups of every size, meshes 2 x 2, 3 x 2, 2 x 3).
``mcore_pool``: four ranks for Megatron-Core cases; ``initialize_model_parallel``
creates groups over the whole world, so every Megatron case runs on all ranks of a
pool whose size is exactly ``tp * pp * cp * dp``, and four covers every 2 x 2 topology.
``_pool_of(n)`` gives the Megatron pool of ``n`` ranks to any module (checkpoints
resharded to 1, 2 and 3 ranks, ``pretrain_gpt`` on 2). ``moe_pool``: four ranks of
their own for the MoE cases of every module (Megatron-Core's MoE layers create
process groups of their own; keeping them out of ``mcore_pool`` keeps its workers
lean). ``pool`` closes after the last test that uses it, ``moe_pool`` after the last test
of each module that uses it: the groups Megatron-Core's MoE layers keep alive hold
hundreds of gloo threads per worker, which burn CPU even while the pool idles through
other modules (measured: 4 idle MoE workers took 1.3 of the 2 cores). A pool is
started on first use, shared by every module that asks for the same one, and
restarted only after a case killed it (a hang or a crash). See docs/testing.md for
the time budget.
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


# The pools that only fixtures hand out close after the last collected test that asks for them:
# their processes (up to ~0.5 GiB each) are not kept through the rest of the session.
_CLOSE_AFTER_LAST_USE = {"pool": (6, ""), "moe_pool": (4, "moe")}
_PER_MODULE = {"moe_pool"}  # closed after the last user of every module, not of the session
_last_users = {}  # fixture name -> ids of the tests after which its pool closes


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(session, config, items):
    for name in _CLOSE_AFTER_LAST_USE:
        last = {}
        for item in items:
            if name in getattr(item, "fixturenames", ()):
                last[item.module.__name__ if name in _PER_MODULE else ""] = item
        _last_users[name] = {id(item) for item in last.values()}


def _pool_until_last_use(request, name: str):
    pool = _pool_of(*_CLOSE_AFTER_LAST_USE[name])
    yield pool
    if id(request.node) in _last_users.get(name, ()):
        done = _pools.pop(_CLOSE_AFTER_LAST_USE[name], None)
        if done is not None:
            done.close()


@pytest.fixture
def pool(request):
    yield from _pool_until_last_use(request, "pool")


@pytest.fixture
def mcore_pool():
    yield _pool_of(4)


@pytest.fixture
def moe_pool(request):
    yield from _pool_until_last_use(request, "moe_pool")


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()

"""Long-lived gloo pools shared by the whole session: one per world size (and one for MoE).

``pool``: six ranks for the engine (subgroups of every size, meshes 2 x 2, 3 x 2, 2 x 3).
``mcore_pool``: four ranks for Megatron-Core cases; ``initialize_model_parallel``
creates groups over the whole world, so every Megatron case runs on all ranks of a
pool whose size is exactly ``tp * pp * cp * dp``, and four covers every 2 x 2 topology.
``tests.harness.pools.pool_of(n)`` gives the Megatron pool of ``n`` ranks to any module (checkpoints
resharded to 1, 2 and 3 ranks, ``pretrain_gpt`` on 2). ``moe_pool``: four ranks of
their own for the MoE cases of every module (Megatron-Core's MoE layers create
process groups of their own; keeping them out of ``mcore_pool`` keeps its workers
lean). ``pool`` closes after the last test that uses it. The MoE cases of every module run
together, as one block at the end of the session (the collection hook below moves them
there, keeping their order), on one ``moe_pool`` started for the block; every other pool
is closed when the block starts. The groups Megatron-Core's MoE layers keep alive hold
hundreds of gloo threads per worker, which burn CPU while a pool idles (measured: 4 idle
MoE workers took 1.3 of the 2 cores), so the MoE pool must never idle through other
modules, and starting it once instead of once per module saves its start-up (~20 s on a
quiet machine) for every module but one. A pool is
started on first use, shared by every module that asks for the same one, and
restarted only after a case killed it (a hang or a crash). See docs/testing.md for
the time budget.
"""

import os

import pytest
import torch  # noqa: E402

from tests.harness import pools  # noqa: E402


os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


# The pool's workers compute with one thread; references computed here, in the pytest
# process, must use the same kernels for the bitwise comparisons (a 2-thread matmul sums
# in another order), whatever OMP_NUM_THREADS the command was started with.
torch.set_num_threads(1)



# The pools that only fixtures hand out close after the last collected test that asks for them:
# their processes (up to ~0.5 GiB each) are not kept through the rest of the session.
_CLOSE_AFTER_LAST_USE = {"pool": (6, ""), "moe_pool": (4, "moe")}
_last_users = {}  # fixture name -> id of the test after which its pool closes


def _uses(item, fixture: str) -> bool:
    return fixture in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(session, config, items):
    # Stable: every other test keeps its place, the MoE cases keep their order among themselves.
    items[:] = [i for i in items if not _uses(i, "moe_pool")] + [i for i in items if _uses(i, "moe_pool")]
    for name in _CLOSE_AFTER_LAST_USE:
        users = [item for item in items if _uses(item, name)]
        _last_users[name] = {id(users[-1])} if users else set()


def _pool_until_last_use(request, name: str):
    yield pools.pool_of(*_CLOSE_AFTER_LAST_USE[name])
    if id(request.node) in _last_users.get(name, ()):
        pools.close(_CLOSE_AFTER_LAST_USE[name])


@pytest.fixture
def pool(request):
    yield from _pool_until_last_use(request, "pool")


@pytest.fixture
def mcore_pool():
    yield pools.pool_of(4)


@pytest.fixture
def moe_pool(request):
    pools.close_all_but(_CLOSE_AFTER_LAST_USE["moe_pool"])  # the MoE block ends the session: nothing else needs them
    yield from _pool_until_last_use(request, "moe_pool")


def pytest_sessionfinish(session, exitstatus):
    pools.close_all_but(None)

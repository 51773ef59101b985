"""Long-lived gloo pools shared by the whole session: one per world size.

``pool``: six ranks for the engine (subgroups of every size, meshes 2 x 2, 3 x 2, 2 x 3).
``mcore_pool``: four ranks for Megatron-Core cases, dense and MoE; ``initialize_model_parallel``
creates groups over the whole world, so every Megatron case runs on all ranks of a
pool whose size is exactly ``tp * pp * cp * dp``, and four covers every 2 x 2 topology.
``megatron.fsdp_training.testing.pools.pool_of(n)`` gives the Megatron pool of ``n`` ranks to any module (checkpoints
resharded to 1, 2 and 3 ranks, ``pretrain_gpt`` on 2). ``pool`` closes after the last test that
uses it. A pool is started on first use, shared by every module that asks for the same one, and
restarted only after a case killed it (a hang or a crash). See docs/testing.md for the time budget.
"""

import os

import pytest
import torch  # noqa: E402

from megatron.fsdp_training.testing import pools  # noqa: E402


os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


# The pool's workers compute with one thread; references computed here, in the pytest
# process, must use the same kernels for the bitwise comparisons (a 2-thread matmul sums
# in another order), whatever OMP_NUM_THREADS the command was started with.
torch.set_num_threads(1)


# The pools that only fixtures hand out close after the last collected test that asks for them:
# their processes (up to ~0.5 GiB each) are not kept through the rest of the session.
_CLOSE_AFTER_LAST_USE = {"pool": (6, "")}
_last_users = {}  # fixture name -> id of the test after which its pool closes


def _uses(item, fixture: str) -> bool:
    return fixture in getattr(item, "fixturenames", ())


# A test of something one supported Megatron-Core release has and another lacks carries
# ``@pytest.mark.mcore_only(FEATURE, why=...)``, FEATURE a constant of megatron.fsdp.mcore_releases (or
# ``"not " + constant``), and is not collected where it is false: deselected here, never skipped (a machine
# that runs the suite runs every test it collects). docs/testing.md lists each such test and why.
MCORE_ONLY = "mcore_only"


def release_has(feature: str) -> bool:
    """Whether the installed Megatron-Core has ``feature`` (``"NAME"`` or ``"not NAME"``, NAME of mcore_releases)."""
    from megatron.fsdp import mcore_releases as compat  # imported only when a collected test asks (it imports Megatron-Core)

    negated = feature.startswith("not ")
    name = feature[4:] if negated else feature
    if not isinstance(getattr(compat, name, None), bool):
        raise pytest.UsageError(f"@pytest.mark.{MCORE_ONLY}({feature!r}): megatron.fsdp.mcore_releases has no "
                                f"boolean {name}")
    return getattr(compat, name) != negated


def _deselect_other_releases(config, items) -> None:
    kept, dropped = [], []
    for item in items:
        marker = item.get_closest_marker(MCORE_ONLY)
        (kept if marker is None or release_has(marker.args[0]) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(session, config, items):
    _deselect_other_releases(config, items)
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


def pytest_sessionfinish(session, exitstatus):
    pools.close_all()

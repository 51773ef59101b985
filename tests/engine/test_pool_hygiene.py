"""The worker pool keeps its workers lean between cases (megatron/fsdp/testing/pool.py).

A case's model can outlive it through an autograd graph that leads back to it (C++ the
collector cannot see into: Megatron-Core's MoE dispatchers keep their last forward's
tensors, whose graphs hold the model and its process groups), and a worker that still
holds leaked groups past a thread limit is replaced before the next case. The groups a case destroyed are
freed before the next case, even where only a reference cycle still held them.
"""

import gc
import os
import subprocess
import sys
import threading
import weakref

import torch

from megatron.fsdp.testing.pool import _release_leftovers, releasing_new_groups
from megatron.fsdp_training.testing.pools import pool_of


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


class _Keep(torch.autograd.Function):
    """Its context holds ``owner``: owner -> output -> grad_fn (C++) -> context -> owner."""

    @staticmethod
    def forward(ctx, x, owner):
        ctx.owner = owner
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


class _Owner(torch.nn.Module):
    pass


def test_a_graph_that_leads_back_to_its_model_is_released():
    owner = _Owner()
    x = torch.ones(4, requires_grad=True)
    owner.last = _Keep.apply(x, owner)
    owner.view = _Keep.apply(x, owner)[1:]  # a view keeps its graph too; it cannot be detached in place
    alive = weakref.ref(owner)
    del owner, x
    gc.collect()
    assert alive() is not None  # what the collector alone cannot free
    _release_leftovers()
    assert alive() is None


def test_a_worker_holding_too_many_threads_is_replaced_before_the_next_case():
    pool = pool_of(2)
    first = pool.run(pid_after_starting_threads)
    pool.MAX_WORKER_THREADS = 50
    try:
        assert pool.run(pid_after_starting_threads, threads=60) == first  # the case itself runs where it was
        old_dir = pool._dir
        renewed = pool.run(pid_after_starting_threads)
        assert all(a != b for a, b in zip(renewed, first))
        assert not os.path.exists(old_dir) and os.path.isdir(pool._dir)  # the old rendezvous folder is gone
        assert pool.run(pid_after_starting_threads) == renewed  # lean again: kept
    finally:
        del pool.MAX_WORKER_THREADS


def test_a_case_starts_from_the_environment_the_pool_started_with():
    """A variable one case sets does not reach the next (CI: a default-backend model left NVTE_FLASH_ATTN=1,
    and a later ``--attention-backend fused`` model asserted on it)."""
    pool = pool_of(2)
    assert pool.run(environment_after_setting, name="MFSDP_POOL_PROBE", value="1") == [None, None]
    assert pool.run(environment_after_setting, name="MFSDP_POOL_PROBE", value="2") == [None, None]


def test_a_closed_pool_leaves_the_temp_folder_as_it_found_it(tmp_path):
    """A fresh process that starts a pool, runs a case and closes it leaves nothing in its TMPDIR
    (no ``mfsdp-pool-*`` folders behind)."""
    script = ("from megatron.fsdp.testing.pool import WorkerPool\n"
              "from tests.engine.test_pool_hygiene import pid_after_starting_threads\n"
              "pool = WorkerPool(1)\n"
              "pool.run(pid_after_starting_threads)\n"
              "pool.close()\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    temp = tmp_path / "tmp"
    temp.mkdir()
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300, cwd=root,
                   env={**os.environ, "TMPDIR": str(temp), "PYTHONPATH": root})
    assert sorted(os.listdir(temp)) == []


def groups_held_by_a_cycle(ctx, count: int) -> int:
    """``count`` gloo groups made and used inside ``releasing_new_groups``, then held only by a reference cycle
    (as a case's model holds its parallel state's groups); this process's threads before they were made."""
    import torch.distributed as dist

    before = len(os.listdir("/proc/self/task"))
    with releasing_new_groups():
        cycle = [dist.new_group(list(range(ctx.size)), backend="gloo") for _ in range(count)]
        for group in cycle:
            dist.barrier(group=group)  # connected: each group's threads run
        cycle.append(cycle)
    return before


def threads_now(ctx) -> int:
    return len(os.listdir("/proc/self/task"))


def test_the_groups_a_case_destroyed_are_freed_before_the_next_case():
    pool = pool_of(2)
    pool.run(groups_held_by_a_cycle, count=1)  # the worker's group-freeing threads start with the first
    before = pool.run(groups_held_by_a_cycle, count=12)
    assert pool.run(threads_now) == before, before

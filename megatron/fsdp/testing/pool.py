"""Start N gloo ranks once; run many test cases in them.

Starting ``torch`` in a fresh process costs seconds; a suite that launched
torchrun per assertion would not fit in its time budget. The pool keeps N
processes with an initialised default group plus one subgroup per size
``1..N``, so a case can run on the first ``k`` ranks, and the two-axis meshes
of ``MESH_SHAPES``. A case is a module-level function ``fn(ctx, **kwargs)``
(in the test modules and their helpers), passed to ``run`` itself; ``ctx`` carries the rank,
the group and its size. Results come back pickled, one per rank.

A case that does not finish within its timeout is treated as a hang: the pool
is killed (the next case gets a fresh one) and ``WorkerTimeout`` is raised, so
a test that must "fail before a hang" can assert it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import multiprocessing as mp
import os
import sys
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional, Sequence


@contextlib.contextmanager
def releasing_new_groups():
    """Destroy, on exit, every process group created inside (all ranks exit together).

    Megatron's ``initialize_model_parallel`` creates a few dozen groups per call and
    ``destroy_model_parallel`` only forgets them; each gloo group keeps its own
    threads polling. In a worker that runs many cases they would pile up by the
    hundred and eat the CPU of every later case.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    before = set(id(pg) for pg in c10d._world.pg_map)
    try:
        yield
    finally:
        new = [pg for pg in list(c10d._world.pg_map) if id(pg) not in before]
        for pg in new:
            dist.destroy_process_group(pg)
        if _in_worker:  # freed together once the case's garbage is collected (``_worker_main``)
            _destroyed_groups.extend(new)


# The groups cases destroyed, held until the worker has collected what the cases left (which still refers to
# them), then let go of all at once by ``_GroupReleaser``. Only a pool worker, which releases them after every
# case, holds them; elsewhere they are left to the collector.
_destroyed_groups: List[Any] = []
_in_worker = False


class _GroupReleaser:
    """A few long-lived threads that drop the last references to destroyed gloo groups, together.

    A gloo group's transport runs a loop thread that wakes every 10 ms; freeing the group waits for it:
    ~9 ms per group, and one Megatron-Core parallel state is a few dozen groups, so freed one after
    another by the collector they cost ~0.2 s per case per rank. Freed side by side (the frees wait
    without the GIL) they cost about one wait. Long-lived threads: each new thread would get its own
    malloc arena.
    """

    THREADS = 6

    def __init__(self):
        import queue
        import threading

        self._jobs: "queue.Queue" = queue.Queue()
        for _ in range(self.THREADS):
            threading.Thread(target=self._run, name="group-release", daemon=True).start()

    def _run(self) -> None:
        while True:
            held, done = self._jobs.get()
            held.clear()  # the last reference: the group is freed on this thread
            done.release()

    def release(self, groups: List[Any]) -> None:
        """Let go of ``groups`` (emptied) and return once every one of them is freed (or held elsewhere)."""
        import threading

        done, count = threading.Semaphore(0), len(groups)
        while groups:
            self._jobs.put(([groups.pop()], done))
        for _ in range(count):
            done.acquire()


_releaser: Optional[_GroupReleaser] = None


def _release_destroyed_groups() -> None:
    global _releaser
    if _destroyed_groups:
        _releaser = _releaser or _GroupReleaser()
        _releaser.release(_destroyed_groups)


class WorkerTimeout(RuntimeError):
    pass


class RankError(RuntimeError):
    """A case raised on at least one rank; ``errors[rank]`` is ``(type name, message, traceback)``."""

    def __init__(self, errors):
        self.errors = errors
        first = next(e for e in errors if e is not None)
        super().__init__(f"case failed on ranks {[r for r, e in enumerate(errors) if e]}:\n{first[2]}")


MESH_SHAPES = ((2, 2), (3, 2), (2, 3))  # (inner N, outer M) meshes built once at start-up


@dataclasses.dataclass
class RankContext:
    rank: int
    size: int
    group: Any
    meshes: dict  # (N, M) -> megatron.fsdp.DataParallelMesh over ranks 0..N*M-1


def _worker_main(rank: int, world: int, init_file: str, conn) -> None:
    global _in_worker
    from megatron.fsdp.testing import worker_setup  # noqa: F401  (first: settings before torch)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _in_worker = True
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    groups = {k: dist.new_group(list(range(k))) for k in range(1, world + 1)}
    from megatron.fsdp import build_mesh

    # new_group is collective over the whole world, so every mesh is built here,
    # by every rank, before any case runs on a subset of the ranks.
    meshes = {(n, m): build_mesh(outer=m, ranks=range(n * m)) for n, m in MESH_SHAPES if n * m <= world}
    gc.collect()
    _freeze_imports()
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            # Nothing is left to flush (every result has been sent), and tearing down
            # gloo groups one by one can take seconds per group: leave at once.
            conn.close()
            os._exit(0)
        target, size, kwargs = msg
        if rank >= size:
            conn.send(("idle", None, _threads()))
            continue
        modules = len(sys.modules)
        environment = dict(os.environ)
        try:
            module, _, name = target.partition(":")
            fn = getattr(importlib.import_module(module), name)
            reply = ("ok", fn(RankContext(rank, size, groups[size], meshes), **kwargs))
        except BaseException as exc:  # noqa: BLE001 - report everything back to the test
            reply = ("err", (type(exc).__name__, str(exc), traceback.format_exc()))
        # A gloo group's threads (three per group, polling) end only when it is freed: free
        # what the case left before answering, or hundreds pile up and starve every later case.
        _release_leftovers()
        _release_destroyed_groups()
        _restore_environment(environment)
        if len(sys.modules) > modules:
            _freeze_imports()
        conn.send(reply + (_threads(),))


def _restore_environment(environment: dict) -> None:
    """Give the next case the environment this one started with.

    A job run in one process per launch sets variables for itself: Megatron-Core's language model
    sets ``NVTE_{FLASH,FUSED,UNFUSED}_ATTN`` for its ``attention_backend`` and asserts that a later
    model's backend agrees with them. In a pool worker the next case is another launch, so what
    one case set must not reach it.
    """
    if os.environ != environment:
        os.environ.clear()
        os.environ.update(environment)


def _threads() -> int:
    """This process's threads (a group's gloo threads live as long as the group)."""
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0


def _release_leftovers() -> None:
    """Collect what the case left behind, cutting the autograd graphs that keep it alive.

    Megatron-Core's MoE token dispatchers keep tensors of their last forward (routing
    probabilities, permutation maps) that still carry their ``grad_fn``. The graph behind
    them is C++ that the collector cannot see into, and it leads back to the model (its
    nodes hold parameters with hooks, and the contexts of Megatron's autograd functions
    hold the process groups): a cycle no ``gc.collect()`` frees. So every MoE case left
    its model, its optimizer and all of its process groups alive, and each gloo group's
    threads keep polling: ~50 threads per case, over 800 per worker by the end of the
    MoE block, where the same cases then ran 3-5 times slower than on a fresh pool.
    Between cases nothing in a worker needs a graph: every tensor still attached to one
    is detached (in place; a view, which cannot be, is replaced by a detached copy where
    it is held), and the model becomes ordinary garbage.
    """
    import torch

    gc.collect()
    views = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which some of torch's deprecated
        # module-level objects answer with a warning
        if issubclass(type(obj), torch.Tensor) and obj.grad_fn is not None:
            if obj._is_view():
                views[id(obj)] = obj
            else:
                obj.detach_()
    if views:
        # dict's and list's own methods: a subclass may compute its items (transformers' lazy auto mappings
        # import a model class per key, and raise for one that is not installed)
        for holder in gc.get_objects():
            if issubclass(type(holder), dict):
                for key, value in list(dict.items(holder)):
                    if id(value) in views:
                        dict.__setitem__(holder, key, value.detach())
            elif issubclass(type(holder), list):
                for index, value in enumerate(list(list.__iter__(holder))):
                    if id(value) in views:
                        list.__setitem__(holder, index, value.detach())
        views.clear()
    gc.collect()


def _freeze_imports() -> None:
    """Move what the imports so far created out of the collector's reach.

    With Megatron-Core imported, a worker tracks ~440,000 objects (modules, classes,
    functions) that live as long as the process; every full collection walks them all:
    0.28 s per ``gc.collect()`` here, once per case per rank, and again whenever Python
    collects on its own inside a case. Frozen (``gc.freeze``) they are never walked again.
    Called right after a collection, when the worker is between cases, and only after
    new imports, so what a case leaves behind is still collected when it becomes garbage.
    """
    gc.freeze()


def _importable_module(case: Callable[..., Any]) -> str:
    """The name the workers import ``case``'s module by: a script's own cases (``__main__``)
    by the name its file has on ``sys.path`` (the workers start with the parent's path)."""
    if case.__module__ != "__main__":
        return case.__module__
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return spec.name  # python -m tools.x
    path = os.path.abspath(main.__file__)
    names = [os.path.relpath(path, root)[:-3].replace(os.sep, ".")
             for root in (os.path.abspath(entry or os.curdir) for entry in sys.path)
             if path.startswith(root + os.sep)]
    if not names:
        raise ValueError(f"{path}: not under any sys.path entry, so the workers cannot import its cases")
    return max(names, key=lambda name: name.count("."))  # tools.bench.x rather than x, when both import


class WorkerPool:
    CLOSE_GRACE_S = 3.0  # a worker told to stop exits at once; after this it is killed
    # A worker past this many threads is holding process groups some case leaked (a group's
    # gloo threads poll while it lives: ~0.15 of a core per 100 threads): the pool starts
    # fresh workers before its next case (~5 s) rather than slow every later case down.
    # A fresh Megatron worker has ~25 threads; one leaked Megatron-Core parallel state is ~45.
    MAX_WORKER_THREADS = 120
    # Starting takes ~5 s on a quiet 2-core machine, but a shared one under heavy load can
    # take minutes to import torch in N processes: a start is not a case, so wait generously.

    def __init__(self, world_size: int, start_timeout: float = 600.0, preload: Optional[Sequence[str]] = None):
        """``preload=None``: each worker is spawned and imports what it needs itself (it sees the
        environment as it is now: the benchmarks set glibc's variables per pool). A list of
        modules: the workers are forked from one server process (multiprocessing's forkserver)
        that imported them once; the first pool of the process fixes the list and the
        environment of every later one."""
        self.world_size = world_size
        self._start_timeout = start_timeout
        self._preload = preload
        self._start()

    def _start(self) -> None:
        """Start the workers (at creation, and again when they must be renewed)."""
        world_size, preload = self.world_size, self._preload
        self._dir = tempfile.mkdtemp(prefix="mfsdp-pool-")
        if preload is None:
            ctx = mp.get_context("spawn")
        else:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(list(preload))
        self._conns, self._procs = [], []
        init_file = os.path.join(self._dir, "rendezvous")
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, world_size, init_file, child), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect([self._conns[r] for r in range(world_size)], self._start_timeout, "start")
        self.alive = True
        self._renew = False

    def _collect(self, conns, timeout: float, what: str) -> List[Any]:
        deadline = time.monotonic() + timeout
        out: List[Optional[tuple]] = [None] * len(conns)
        pending = set(range(len(conns)))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close(kill=True)
                raise WorkerTimeout(f"{what}: ranks {sorted(pending)} did not answer within {timeout:.0f}s (hang)")
            for r in sorted(pending):
                if conns[r].poll(min(0.05, max(remaining, 0.0))):
                    try:
                        out[r] = conns[r].recv()
                    except EOFError:
                        self.close(kill=True)
                        raise RuntimeError(f"{what}: rank {r} died (exit code {self._procs[r].exitcode})")
                    pending.discard(r)
        return out

    def run(self, case: Callable[..., Any], /, size: Optional[int] = None, timeout: float = 120.0,
            **kwargs) -> List[Any]:
        """Run ``case(ctx, **kwargs)`` on ranks ``0..size-1``; return their results or raise ``RankError``.

        ``case`` is a module-level function (the workers import it by its module and name),
        passed as the function itself so that a reader (or an IDE) can follow it.
        """
        target = f"{_importable_module(case)}:{case.__qualname__}"
        if "<" in case.__qualname__:
            raise ValueError(f"{target}: a pool case must be a module-level function")
        size = self.world_size if size is None else size
        if not 1 <= size <= self.world_size:
            raise ValueError(f"size {size} outside 1..{self.world_size}")
        if self._renew:
            self.close()
            self._start()
        for conn in self._conns:
            conn.send((target, size, kwargs))
        replies = self._collect(self._conns, timeout, target)
        self._renew = max(threads for _, _, threads in replies) > self.MAX_WORKER_THREADS
        errors = [payload if status == "err" else None for status, payload, _ in replies[:size]]
        if any(errors):
            raise RankError(errors)
        return [payload for _, payload, _ in replies[:size]]

    def close(self, kill: bool = False) -> None:
        if not getattr(self, "alive", True):
            return
        self.alive = False
        for conn, proc in zip(self._conns, self._procs):
            if kill:
                proc.kill()
            else:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    proc.kill()
        deadline = time.monotonic() + (0 if kill else self.CLOSE_GRACE_S)
        for proc in self._procs:
            proc.join(timeout=max(deadline - time.monotonic(), 0.0))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        # the rendezvous directory: every closed (or renewed) pool left one in the temp folder
        shutil.rmtree(self._dir, ignore_errors=True)

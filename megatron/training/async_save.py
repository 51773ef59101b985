"""``--async-save``: checkpoints written by a background thread while training continues.

The training loop blocks only for ``save_steps.stage`` (this rank's pieces are
copied into host staging buffers kept from one save to the next, pinned on a GPU:
``megatron/fsdp/staging.py``, filled once at start-up by ``prepare``; and DCP's plan is
agreed). The write of
this rank's files (``save_steps.write_pieces``) runs on one long-lived writer
thread. Completion is agreed at a later iteration boundary: while a write is in
flight, every rank all-reduces one flag ("mine is done") after each iteration,
on the training thread (so it is ordered with every other collective of that
thread), on the default group on CPU and on an own gloo group beside NCCL (host
flags, no device synchronisation). When every rank is done, ``save_steps.finish`` runs there:
rank 0 writes the metadata, renames and moves the tracker. So the atomic
protocol is unchanged: the tracker moves only after every rank's files are
fsynced, and a crash anywhere before that leaves the previous checkpoint in
charge. The writer thread runs no collective: two threads never issue
collectives on one process group.

Why a thread: the write is file I/O and ``torch.save`` of host tensors, much of
it outside the GIL, and a thread needs neither shared-memory staging nor a process
group of its own. Measured (docs/checkpoints.md, ``tools/bench/async_save.py
--writer-compare``), a writer process slowed a Python-bound step loop less than the
thread (2.35x vs 2.98x on 2 oversubscribed cores): a process writer is the
follow-up. Why one thread for the whole process: glibc
gives each new thread its own malloc arena (~100 MiB RSS each), so a thread per
save would grow resident memory with every save.

A new save, ``--exit-interval``, the end of training and an error all wait for
the write in flight; a failed write stops the job on every rank with one error
naming the ranks, and the previous checkpoint stays the tracker's.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron.fsdp.staging import StagingArena

from . import checkpoint_files as files
from . import save_steps
from .logging_utils import print_rank_0

FAULT_POINT = "in_background_write"


@dataclasses.dataclass
class WriteJob:
    """One background write: its outcome (results or the exception) once ``done`` is set."""

    fn: Callable[[], Any]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    outcome: Any = None
    seconds: float = 0.0

    def run(self) -> None:
        start = time.perf_counter()
        try:
            self.outcome = self.fn()
        except Exception as exc:  # reported by the training thread, on every rank at once
            self.outcome = exc
        finally:
            self.seconds = time.perf_counter() - start
            self.done.set()


class BackgroundWriter:
    """One daemon thread for the life of the process, running write jobs one at a time."""

    def __init__(self):
        self._jobs: "queue.Queue[WriteJob]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._jobs.get().run()

    def submit(self, fn: Callable[[], Any]) -> WriteJob:
        job = WriteJob(fn)
        self._jobs.put(job)
        return job


_WRITER: Optional[BackgroundWriter] = None


def background_writer() -> BackgroundWriter:
    global _WRITER
    if _WRITER is None:
        _WRITER = BackgroundWriter()
    return _WRITER


@dataclasses.dataclass
class PendingSave:
    staged: save_steps.StagedSave
    job: WriteJob
    blocked: float  # seconds the training thread spent on it so far


class CheckpointSaver:
    """The training loop's saves: synchronous, or (``--async-save``) written in the background.

    ``save``, ``poll`` and ``wait`` are called by every rank at the same iteration
    boundaries (they run collectives); ``abandon`` after an error runs none.
    """

    def __init__(self, args):
        self.args = args
        self.asynchronous = bool(getattr(args, "async_save", False))
        self._pending: Optional[PendingSave] = None
        self._group = None
        self.arena: Optional[StagingArena] = None
        if self.asynchronous:
            self.arena = StagingArena(pin=torch.cuda.is_available())
            if dist.get_backend() != "gloo":
                self._group = dist.new_group(backend="gloo")  # beside NCCL: host flags, never device syncs

    def prepare(self, model, optimizer) -> None:
        """At start-up (``--async-save``): one staging round into the arena, so every save after it
        copies into host memory that is already mapped (and pinned) instead of allocating it."""
        from .checkpointing import save_state_dict

        if self.arena is None:
            return
        start = time.perf_counter()
        save_state_dict(model, optimizer, self.arena)
        print_rank_0(f" --async-save: {self.arena.nbytes / 2**20:.1f} MiB of host staging buffers on rank 0, "
                     f"reused by every save (allocated in {time.perf_counter() - start:.3f} s)")

    def save(self, iteration: int, consumed: int, model, optimizer, scheduler) -> None:
        from .checkpointing import save_checkpoint, stage_checkpoint, write_step

        if not self.asynchronous:
            save_checkpoint(self.args, iteration, consumed, model, optimizer, scheduler)
            return
        start = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - start
        staged = stage_checkpoint(self.args, iteration, consumed, model, optimizer, scheduler, self.arena)
        rank = dist.get_rank()

        def write():
            results = write_step(staged)
            files.fault_point(FAULT_POINT, iteration, rank)
            return results
        job = background_writer().submit(write)
        blocked = time.perf_counter() - start - staged.arrival_seconds
        self._pending = PendingSave(staged, job, blocked)
        print_rank_0(f" saving checkpoint at iteration {iteration:8d} in the background: training blocked "
                     f"{blocked:.3f} s (copy {staged.copy_seconds:.3f} s, plan {staged.plan_seconds:.3f} s"
                     + (f", waiting for the previous write {waited:.3f} s" if waited > 1e-3 else "")
                     + f"; before it {staged.arrival_seconds:.3f} s waiting for the slowest rank to reach the save)")

    def poll(self, iteration: int) -> None:
        """After each iteration: publish the write in flight if every rank has finished it (one tiny all-reduce)."""
        if self._pending is None:
            return
        busy = torch.tensor([0.0 if self._pending.job.done.is_set() else 1.0])
        dist.all_reduce(busy, group=self._group)
        if busy.item() == 0:
            self._publish(iteration)

    def wait(self, iteration: Optional[int] = None) -> None:
        """Block until the write in flight is written everywhere, then publish it (all ranks)."""
        if self._pending is not None:
            self._pending.job.done.wait()
            self._publish(iteration)

    def _publish(self, iteration: Optional[int]) -> None:
        pending, self._pending = self._pending, None
        start = time.perf_counter()
        final = save_steps.finish(pending.staged, pending.job.outcome, barrier=False, group=self._group)
        blocked = pending.blocked + time.perf_counter() - start
        when = f", published after iteration {iteration}" if iteration is not None else ""
        print_rank_0(f" saved checkpoint at iteration {pending.staged.iteration:8d} to {final} (async): training "
                     f"blocked {blocked:.3f} s, background write {pending.job.seconds:.2f} s{when} "
                     f"(publishing {time.perf_counter() - start:.3f} s)")

    def abandon(self, timeout: float = 600.0) -> None:
        """After an error (no collective may run): let this rank's write end, publish nothing, say so."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        finished = pending.job.done.wait(timeout)
        outcome = pending.job.outcome
        state = ("failed: " + f"{type(outcome).__name__}: {outcome}" if isinstance(outcome, Exception)
                 else "written" if finished else f"still running after {timeout:.0f} s")
        print(f"[rank {dist.get_rank()}] training stopped with the checkpoint of iteration "
              f"{pending.staged.iteration} in flight ({state}); not published: the tracker of "
              f"{pending.staged.root} still names iteration {files.read_tracker(pending.staged.root)}", flush=True)

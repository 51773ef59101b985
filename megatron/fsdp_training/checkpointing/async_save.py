"""``--async-save``: checkpoints planned, written and published by a background thread while training continues.

The training loop blocks only for ``checkpointing.snapshot``: this rank's pieces
described over host staging buffers kept from one save to the next (pinned on a GPU:
``megatron/fsdp/checkpoint/staging.py``, filled once at start-up by ``prepare``), small values
copied, and rank 0's ``common.json`` contents. No collective runs there, so no rank
waits for another while training is stopped. On CPU the big copies (fp32 main
weights, optimizer state: values only the optimizer step changes) are deferred:
the writer thread makes them first, while the next forward and backward run, and
the training thread waits for them before that step (``before_optimizer_step``;
counted as blocked time). On a GPU they are issued at once (device to pinned host,
on the training stream, so no later kernel can overtake them).

Everything else runs on one long-lived writer thread, with collectives on a gloo
process group of its own (created at start-up by every rank; two threads never
issue collectives on one group): the deferred copies, the free-space check and
the temporary directory, DCP's plan (cached: a save described like the previous
one sends empty plans), this rank's files (fsynced), then ``save_steps.finish``:
every rank's write results gathered to rank 0, which writes the metadata, renames
and moves the tracker, and tells every rank how that went. So the atomic protocol
is unchanged: the tracker moves only after every rank's files are fsynced, and a
crash anywhere before that leaves the previous checkpoint in charge.

Why all of it in the background: measured on 4 CPU ranks (docs/checkpoints.md), the
time training stood still was the copy, the free-space all-reduce, DCP's plan gather
and scatter and rank 0's publishing, the collectives mostly waiting for the other
ranks (each slowed by the others on shared cores); with the collectives moved, the
copy alone still blocked 0.6-0.75 s.

Outcomes are agreed on the training thread: while a save is in flight, every rank
all-reduces one flag ("mine is done") after each iteration (the default group on
CPU, an own gloo group beside NCCL: host flags, no device synchronisation); once
all are done, every rank reports the same outcome at the same iteration (the saved
line, or the one error of a failed write, raised on every rank).

Why a thread: the write is file I/O and ``torch.save`` of host tensors, much of
it outside the GIL, and a thread needs no shared-memory staging. Measured
(``tools/bench/async_save.py --writer-compare``), a writer process slowed a
Python-bound step loop less than the thread (2.35x vs 2.98x on 2 oversubscribed
cores). Why one thread for the whole process: glibc gives each new thread its own
malloc arena (~100 MiB RSS each), so a thread per save would grow resident memory
with every save.

A new save, ``--exit-interval`` and the end of training wait for the save in
flight; a failed save stops the job on every rank with one error naming the
ranks, and the previous checkpoint stays the tracker's.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron.fsdp.checkpoint.staging import StagingArena

from . import files
from . import save_steps
from .checkpoint_config import CheckpointConfig
from ..logs.lines import print_rank_0

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
            # without this frame (it holds the job, which holds the error: a cycle for the collector), the
            # rest of the traceback kept for the training thread's report
            self.outcome = exc.with_traceback(exc.__traceback__.tb_next)
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
    iteration: int
    root: str
    job: WriteJob  # its outcome: the published directory, or the exception (the same on every rank)
    blocked: float  # seconds the training thread spent on it so far
    copied: threading.Event  # the deferred copies are made: the optimizer may step
    gated: float = 0.0  # of ``blocked``: waiting for them before the next step


class CheckpointSaver:
    """The training loop's saves: synchronous, or (``--async-save``) planned, written and published in the
    background.

    ``save``, ``poll`` and ``wait`` are called by every rank at the same iteration
    boundaries (they run collectives); ``abandon`` after an error runs none.
    """

    def __init__(self, config: CheckpointConfig):
        self.config = config
        self.asynchronous = config.async_save
        self._pending: Optional[PendingSave] = None
        self._group = None  # the training thread's flags: the default group on CPU, gloo beside NCCL
        self._writer_group = None  # the writer thread's collectives
        self.arena: Optional[StagingArena] = None
        if self.asynchronous:
            self.arena = StagingArena(pin=torch.cuda.is_available())
            if dist.get_backend() != "gloo":
                self._group = dist.new_group(backend="gloo")  # beside NCCL: host flags, never device syncs
            self._writer_group = dist.new_group(backend="gloo")

    def prepare(self, model, optimizer) -> None:
        """At start-up (``--async-save``): one staging round into the arena, so every save after it
        copies into host memory that is already mapped (and pinned) instead of allocating it."""
        from .save_load import save_state_dict

        if self.arena is None:
            return
        start = time.perf_counter()
        save_state_dict(model, optimizer, self.arena)
        print_rank_0(f" --async-save: {self.arena.nbytes / 2**20:.1f} MiB of host staging buffers on rank 0, "
                     f"reused by every save (allocated in {time.perf_counter() - start:.3f} s)")

    def save(self, iteration: int, consumed: int, model, optimizer, scheduler) -> None:
        from .save_load import plan_snapshot, save_checkpoint, snapshot, write_step

        if not self.asynchronous:
            save_checkpoint(self.config, iteration, consumed, model, optimizer, scheduler)
            return
        start = time.perf_counter()
        self.wait()  # the arena's buffers are free again only once the previous save is written
        waited = time.perf_counter() - start
        defer = not self.arena.pin
        snap = snapshot(self.config, iteration, consumed, model, optimizer, scheduler, self.arena, defer)
        rank, config, group, arena = dist.get_rank(), self.config, self._writer_group, self.arena
        copied = threading.Event()
        deferred = arena.deferred_bytes

        def background():
            try:
                arena.copy_deferred()
            finally:
                copied.set()
            staged = plan_snapshot(config, snap, group)
            try:
                results = write_step(staged)
                files.fault_point(FAULT_POINT, iteration, rank)
            except Exception as exc:  # noqa: BLE001 - every rank learns of it in ``finish`` and raises it
                results = files.failure_as_value(exc)
            final = save_steps.finish(staged, results, barrier=True, group=group)
            return final, staged
        job = background_writer().submit(background)
        blocked = time.perf_counter() - start
        self._pending = PendingSave(iteration, config.save, job, blocked, copied)
        print_rank_0(f" saving checkpoint at iteration {iteration:8d} in the background: training blocked "
                     f"{blocked:.3f} s (snapshot {snap.copy_seconds:.3f} s"
                     + (f", {deferred / 2**20:.1f} MiB of copies left to the writer" if deferred else "")
                     + (f", waiting for the previous save {waited:.3f} s" if waited > 1e-3 else "") + ")")

    def before_optimizer_step(self) -> None:
        """Before every optimizer step: the step may change the values a save in flight still has to copy
        (``staging.py``, deferred copies); wait until they are copied (counted as blocked)."""
        pending = self._pending
        if pending is not None and not pending.copied.is_set():
            start = time.perf_counter()
            pending.copied.wait()
            pending.gated = time.perf_counter() - start
            pending.blocked += pending.gated

    def poll(self, iteration: int) -> None:
        """After each iteration: report the save in flight if every rank has finished it (one tiny all-reduce)."""
        if self._pending is None:
            return
        busy = torch.tensor([0.0 if self._pending.job.done.is_set() else 1.0])
        dist.all_reduce(busy, group=self._group)
        if busy.item() == 0:
            self._report(iteration)

    def wait(self, iteration: Optional[int] = None) -> None:
        """Block until the save in flight is published (or failed) everywhere, then report it (all ranks)."""
        if self._pending is not None:
            start = time.perf_counter()
            self._pending.job.done.wait()
            self._report(iteration, time.perf_counter() - start)

    def _report(self, iteration: Optional[int], waited: float = 0.0) -> None:
        """Every rank at the same iteration: the saved line, or the save's error (the same on every rank)."""
        pending, self._pending = self._pending, None
        outcome = pending.job.outcome
        if isinstance(outcome, BaseException):
            raise outcome
        final, staged = outcome
        when = f", published after iteration {iteration}" if iteration is not None else ""
        print_rank_0(f" saved checkpoint at iteration {pending.iteration:8d} to {final} (async): training "
                     f"blocked {pending.blocked:.3f} s, background save {pending.job.seconds:.2f} s{when} "
                     f"(plan {staged.plan_seconds:.3f} s"
                     + (f"; {pending.gated:.3f} s of the blocked time waiting for its copies before the next step"
                        if pending.gated > 1e-3 else "")
                     + (f"; then waited {waited:.3f} s for it" if waited > 1e-3 else "") + ")")

    def abandon(self, timeout: float = 600.0) -> None:
        """After an error (no collective may run): let this rank's save end, say how it ended."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        finished = pending.job.done.wait(timeout)
        outcome = pending.job.outcome
        state = ("failed: " + f"{type(outcome).__name__}: {outcome}" if isinstance(outcome, BaseException)
                 else f"published as {outcome[0]}" if finished else f"still running after {timeout:.0f} s")
        print(f"[rank {dist.get_rank()}] training stopped with the checkpoint of iteration {pending.iteration} "
              f"in flight ({state}); the tracker of {pending.root} names iteration "
              f"{files.read_tracker(pending.root)}", flush=True)

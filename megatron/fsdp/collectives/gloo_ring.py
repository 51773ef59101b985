"""A reduce-scatter for gloo that sends only what a reduce-scatter needs.

Why: gloo runs ``reduce_scatter_tensor`` as a full all-reduce (``2 (N-1)/N`` of the buffer sent
instead of ``(N-1)/N``, and slower than a plain all-reduce). This is the textbook ring from
point-to-point messages: ``N - 1`` steps, each sending one output-sized chunk to the successor and
adding the predecessor's.

Why one long-lived worker thread per process group, running its rings in issue order: each step
depends on the previous one's receive and add, which nothing in gloo would run, so ``reduce_scatter``
returns at once and compute overlaps it (``RingWork.wait()`` waits for one ring). Not a thread per
call (each new thread got its own malloc arena), not driven from the waits (ranks wait in their own
order, so a ring advanced only by its waiter would stall). Every rank issues its rings on a group in
the same order, so the workers run ring ``k`` together; rings of different groups never wait for
each other.

Why it cannot hang or cross-match: gloo matches point-to-point messages by (peer, tag) apart from
collectives; each ring takes ``N - 1`` fresh tags in ``[2**30, 2**31)`` from a counter per process
group, the same on every rank. Not a process group of its own: ``new_group`` needs every rank of the
default group, and an axis is built by its members only. ``shutdown_workers()`` (also at interpreter
exit) finishes every issued ring and joins the workers, so no thread is inside gloo while the
interpreter finalizes (``terminate called without an active exception`` otherwise).
"""

from __future__ import annotations

import atexit
import collections
import threading
import time
import weakref
from typing import Optional

import torch
import torch.distributed as dist

_TAG_BASE = 1 << 30
_TAG_SPAN = 1 << 30  # gloo tags are non-negative 32-bit ints: base + span == 2**31
_tag_counters: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_tag_lock = threading.Lock()


def take_tags(group, count: int) -> int:
    """Reserve ``count`` consecutive tags on ``group``; return the first (same on every rank)."""
    with _tag_lock:
        start = _tag_counters.get(group, 0)
        if start + count > _TAG_SPAN:  # a ring's tags must not straddle the wrap
            start = 0
        _tag_counters[group] = start + count
    return _TAG_BASE + start


def ring_wire_bytes(nbytes_full: int, size: int) -> int:
    """Bytes one rank sends in a ring reduce-scatter (or all-gather) of a ``nbytes_full`` buffer."""
    return nbytes_full // size * (size - 1)


class RingWork:
    """The work object of one ring: ``wait()`` blocks until the group's worker has run it, then re-raises its error."""

    __slots__ = ("_run", "_done", "_error")

    def __init__(self, run=None):
        self._run = run
        self._error: Optional[BaseException] = None
        self._done = threading.Event()
        if run is None:
            self._done.set()

    def _execute(self) -> None:
        try:
            with torch.no_grad():  # grad mode is per thread; the adds must not build a graph
                self._run()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self._error = exc
        finally:
            self._run = None  # drop the tensors and the group as soon as the ring is done
            self._done.set()

    def _cancel(self, reason: str) -> None:
        self._error = RuntimeError(reason)
        self._run = None
        self._done.set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        if not self._done.wait(timeout):
            raise TimeoutError(f"gloo ring reduce-scatter did not finish within {timeout:.0f}s")
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()


class _RingWorker:
    """One long-lived thread that runs one process group's rings in issue order."""

    def __init__(self, name: str):
        self._jobs: "collections.deque[RingWork]" = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: RingWork) -> RingWork:
        with self._cv:
            if self._stopping:
                raise RuntimeError("gloo ring reduce-scatter issued after its process group was shut down")
            self._jobs.append(work)
            self._cv.notify()
        return work

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stopping:
                    self._cv.wait()
                if not self._jobs:
                    return
                work = self._jobs.popleft()
            work._execute()

    def pending(self) -> int:
        with self._cv:
            return len(self._jobs)

    def stop(self) -> None:
        """Finish the rings already issued, then end the thread (does not wait)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()

    def join(self, timeout: Optional[float]) -> bool:
        """Wait for the thread to end; on timeout cancel the rings not yet started. True when it ended."""
        self._thread.join(timeout)
        if not self._thread.is_alive():
            return True
        with self._cv:
            while self._jobs:
                self._jobs.popleft()._cancel("gloo ring reduce-scatter cancelled at shutdown (a peer never took part)")
        return False


_workers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_all_workers: "weakref.WeakSet" = weakref.WeakSet()


def _worker_for(group) -> _RingWorker:
    with _tag_lock:
        worker = _workers.get(group)
        if worker is None:
            worker = _workers[group] = _RingWorker(f"mfsdp-gloo-ring-{len(_all_workers)}")
            _all_workers.add(worker)
            weakref.finalize(group, worker.stop)  # group freed: the thread ends once idle
        return worker


def submit(group, run) -> RingWork:
    """Run ``run()`` on ``group``'s worker after the rings issued before it; return its work."""
    return _worker_for(group).submit(RingWork(run))


def shutdown_workers(timeout: float = 60.0) -> bool:
    """Finish every ring already issued and end every worker thread; True when all ended in time.

    Called at interpreter exit, and by ``megatron.fsdp.shutdown()`` before the process
    groups are destroyed. A ring whose peers never take part is cancelled after
    ``timeout`` seconds (its waiter gets an error) instead of holding the exit forever.
    """
    workers = list(_all_workers)
    for worker in workers:
        worker.stop()
    with _tag_lock:
        _workers.clear()
    deadline = time.monotonic() + timeout
    return all([worker.join(max(0.0, deadline - time.monotonic())) for worker in workers])


atexit.register(shutdown_workers)


def ring_reduce_scatter(output: torch.Tensor, full: torch.Tensor, group, rank: int, size: int) -> RingWork:
    """Start ``output = sum over ranks of full[rank*n:(rank+1)*n]`` as a ring; return its work.

    ``full`` is only read (``output`` may be this rank's slice of it); neither may be
    touched by the caller until ``wait()``. Chunk ``c`` starts at rank ``c + 1`` and
    travels round the ring, so its sum is ``((x[c+1] + x[c+2]) + ...) + x[c]``: a fixed
    order, the same on every run.

    ``full`` may be narrower than ``output`` (bf16 gradients, an fp32 reduction): the sum is
    that of ``full.to(output.dtype)``, bit for bit, but only the chunk sent first is ever
    cast (1/N of the buffer, while it is on the wire) and the others are added from
    ``full`` as they are (an exact widening inside the add), so a whole widened copy of
    the buffer never exists. The ring holds ``full`` until it has finished, then drops
    it: the caller's input is released when the ring lands, not when it is waited.
    """
    n = output.numel()
    if full.numel() != n * size or (full.dtype != output.dtype
                                    and torch.promote_types(full.dtype, output.dtype) != output.dtype):
        raise ValueError(f"reduce_scatter needs full.numel() == {size} * output.numel() and an output dtype at "
                         f"least as wide; got {full.numel()} ({full.dtype}) and {n} ({output.dtype})")
    if not full.is_contiguous() or not output.is_contiguous():
        raise ValueError("reduce_scatter needs contiguous tensors")
    if n == 0:  # nothing to send; every rank sees the same sizes, so no rank draws tags
        return RingWork()
    first_tag = take_tags(group, size - 1)
    chunks = full.view(size, n)
    succ, pred = (rank + 1) % size, (rank - 1) % size

    # The last step receives straight into ``output`` and adds this rank's chunk there (the same
    # sum, bit for bit), so no receive buffer lives beside ``output`` at the end; not when
    # ``output`` is this rank's slice of ``full``, whose chunk is added after the receive.
    into_output = output.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()

    def run() -> None:
        partial = torch.empty_like(output) if size > 2 else output  # running sum sent on
        received = torch.empty_like(output) if size > 2 or not into_output else None
        outgoing = chunks[pred].to(output.dtype)  # step 0: the chunk whose sum starts at this rank
        for step in range(size - 1):
            tag = first_tag + step
            last = step == size - 2
            if last and into_output:
                received = None  # the earlier steps' receive buffer is dropped before the last one
            recv = dist.irecv(output if last and into_output else received, group=group, group_src=pred, tag=tag)
            send = dist.isend(outgoing, group=group, group_dst=succ, tag=tag)
            recv.wait()
            send.wait()  # ``partial`` is overwritten next: what it held must have left
            mine = chunks[(rank - step - 2) % size]
            if last and into_output:
                output.add_(mine)
            else:
                target = output if last else partial
                torch.add(received, mine, out=target)
                outgoing = target

    return submit(group, run)

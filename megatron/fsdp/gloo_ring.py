"""A reduce-scatter for gloo that sends only what a reduce-scatter needs.

Why: gloo runs ``reduce_scatter_tensor`` as a full all-reduce, so every rank sends
``2 (N-1)/N`` of the buffer instead of ``(N-1)/N``, and it is slower than a plain
all-reduce. This module builds the textbook ring from point-to-point messages:
``N - 1`` steps; at each step a rank sends one chunk (the size of its output) to its
successor, receives one from its predecessor and adds its own contribution; after the
last step it holds its own chunk summed over all ranks.

Why a thread: step ``s + 1`` sends what step ``s`` received plus a local add, so the
steps cannot all be posted up front, and nothing in gloo would run the adds between
them. Each call runs its ring on a short-lived thread (waits and adds release the
GIL), so ``reduce_scatter`` returns at once and the caller's compute overlaps it, as
with a native async collective. ``RingWork.wait()`` joins that thread.

Why this cannot hang or cross-match: gloo matches point-to-point messages by
(peer, tag) on its own channel, apart from collectives, so rings do not depend on how
they interleave with all-gathers or all-reduces in flight on the same group. Each
ring takes ``N - 1`` fresh tags from a counter kept per process group (not per
caller: two models over one group share it); every rank of the group issues its
collectives on that group in the same order, so every rank draws the same tags for
the same call, and concurrent rings never share a tag. Tags live in ``[2**30, 2**31)``
so they stay clear of tags other code commonly uses (0 and small numbers).

Why not a process group of its own for the rings: ``new_group`` must be called by
every rank of the default group, and an axis is built by its members only.
"""

from __future__ import annotations

import threading
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
    """The work object of one ring: ``wait()`` joins its thread and re-raises its error."""

    __slots__ = ("_thread", "_error")

    def __init__(self, run=None):
        self._error: Optional[BaseException] = None
        self._thread = None
        if run is not None:
            self._thread = threading.Thread(target=self._guarded, args=(run,), name="mfsdp-gloo-ring", daemon=True)
            self._thread.start()

    def _guarded(self, run) -> None:
        try:
            with torch.no_grad():  # grad mode is per thread; the adds must not build a graph
                run()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self._error = exc

    def wait(self) -> bool:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return True

    def is_completed(self) -> bool:
        return self._thread is None or not self._thread.is_alive()


def ring_reduce_scatter(output: torch.Tensor, full: torch.Tensor, group, rank: int, size: int) -> RingWork:
    """Start ``output = sum over ranks of full[rank*n:(rank+1)*n]`` as a ring; return its work.

    ``full`` is only read (``output`` may be this rank's slice of it); neither may be
    touched by the caller until ``wait()``. Chunk ``c`` starts at rank ``c + 1`` and
    travels round the ring, so its sum is ``((x[c+1] + x[c+2]) + ...) + x[c]``: a fixed
    order, the same on every run.
    """
    n = output.numel()
    if full.numel() != n * size or full.dtype != output.dtype:
        raise ValueError(f"reduce_scatter needs full.numel() == {size} * output.numel() and one dtype; "
                         f"got {full.numel()} ({full.dtype}) and {n} ({output.dtype})")
    if not full.is_contiguous() or not output.is_contiguous():
        raise ValueError("reduce_scatter needs contiguous tensors")
    if n == 0:  # nothing to send; every rank sees the same sizes, so no rank draws tags
        return RingWork()
    first_tag = take_tags(group, size - 1)
    chunks = full.view(size, n)
    succ, pred = (rank + 1) % size, (rank - 1) % size

    def run() -> None:
        received = torch.empty_like(output)
        partial = torch.empty_like(output) if size > 2 else output  # running sum sent on
        outgoing = chunks[pred]  # step 0: the chunk whose sum starts at this rank
        for step in range(size - 1):
            tag = first_tag + step
            recv = dist.irecv(received, group=group, group_src=pred, tag=tag)
            send = dist.isend(outgoing, group=group, group_dst=succ, tag=tag)
            recv.wait()
            send.wait()  # ``partial`` is overwritten next: what it held must have left
            target = output if step == size - 2 else partial
            torch.add(received, chunks[(rank - step - 2) % size], out=target)
            outgoing = target

    return RingWork(run)

"""Collectives of one data-parallel axis, and the ledger that counts them.

Every collective the engine issues goes through a ``CommAxis`` so the ledger
sees all traffic: tests prove the schedule with it (how many gathers per unit,
how many bytes per step) and benchmarks compare it with the theoretical
minimum. On an axis of one rank nothing is sent and nothing is recorded.

Bytes recorded are the size of the full (unsharded) buffer a collective works
on: the all-gather output, the reduce-scatter input, the all-reduce tensor; the
theory the tests compare with is written in those terms. Wire bytes are a second
count: what one rank sends, which is what a benchmark sees. They differ by
algorithm: a ring all-gather or reduce-scatter sends ``(N-1)/N`` of the buffer, a
ring all-reduce ``2 (N-1)/N``, and gloo's native reduce-scatter is an all-reduce.

On gloo, ``reduce_scatter`` therefore runs a ring of point-to-point messages
(``gloo_ring.py``) instead of the native call. ``MEGATRON_FSDP_GLOO_REDUCE_SCATTER=allreduce``
selects the native call again, to compare the two; every rank must be launched
with the same value (the two paths do not talk to each other).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import profiling
from .gloo_ring import ring_reduce_scatter, ring_wire_bytes


# torch 2.13 renamed the flat-tensor collectives; the old names warn on every call.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

GLOO_REDUCE_SCATTER_ENV = "MEGATRON_FSDP_GLOO_REDUCE_SCATTER"
GLOO_REDUCE_SCATTER_PATHS = ("ring", "allreduce")


@dataclasses.dataclass(frozen=True)
class LedgerEvent:
    kind: str
    axis: str
    nbytes: int
    tag: str
    wire: int = 0  # bytes this rank sent


class Ledger:
    """Counts calls, bytes and wire bytes per (collective kind, axis); optionally keeps every event."""

    def __init__(self):
        self.trace = False
        self.reset()

    def reset(self) -> None:
        self._calls: Dict[Tuple[str, str], int] = collections.defaultdict(int)
        self._bytes: Dict[Tuple[str, str], int] = collections.defaultdict(int)
        self._wire: Dict[Tuple[str, str], int] = collections.defaultdict(int)
        self.events: List[LedgerEvent] = []

    def record(self, kind: str, axis: str, nbytes: int, tag: str, wire: int = 0) -> None:
        self._calls[(kind, axis)] += 1
        self._bytes[(kind, axis)] += nbytes
        self._wire[(kind, axis)] += wire
        if self.trace:
            self.events.append(LedgerEvent(kind, axis, nbytes, tag, wire))
        profiling.on_collective(kind, axis, nbytes, tag)  # a timeline, when one records

    def _sum(self, table, kind, axis) -> int:
        return sum(v for (k, a), v in table.items() if kind in (None, k) and axis in (None, a))

    def calls(self, kind: Optional[str] = None, axis: Optional[str] = None) -> int:
        return self._sum(self._calls, kind, axis)

    def bytes(self, kind: Optional[str] = None, axis: Optional[str] = None) -> int:
        return self._sum(self._bytes, kind, axis)

    def wire_bytes(self, kind: Optional[str] = None, axis: Optional[str] = None) -> int:
        """Bytes this rank sent (see the module docstring for how each algorithm counts)."""
        return self._sum(self._wire, kind, axis)

    def summary(self) -> Dict[Tuple[str, str], Tuple[int, int]]:
        """``{(kind, axis): (calls, bytes)}`` in first-seen order."""
        return {key: (self._calls[key], self._bytes[key]) for key in self._calls}


class CollectiveError(RuntimeError):
    """A collective that failed or timed out, named by kind, axis and purpose (the ledger tag).

    ``call`` is the public engine call that issued it, when one is known: its message
    then says that every rank of the axis must make that call. A rank that skips a
    collective leaves its peers waiting until the process-group timeout (the job's
    ``--distributed-timeout-minutes``); this error is what they then see.
    """

    def __init__(self, kind: str, axis: str, tag: str, cause: BaseException, call: Optional[str] = None):
        self.kind, self.axis, self.tag, self.call = kind, axis, tag, call
        reason = str(cause).strip().splitlines()[0][:300] if str(cause).strip() else type(cause).__name__
        # A unit's collectives carry its module name; a bare index ("0": a child of an nn.Sequential) or the root
        # unit read as a number or nothing, so they are named as units.
        text = "" if tag is None else str(tag)
        purpose = f"FSDP unit {text}" if text.isdigit() or text == "<root>" else (text or "unnamed")
        what = f"{kind} on axis {axis} (purpose: {purpose})"
        if call:
            message = (f"{call} is a collective: every rank of {axis} must call it; {what} did not complete "
                       f"({reason})")
        else:
            message = (f"{what} did not complete ({reason}); every rank of {axis} must issue the same "
                       "collectives in the same order (a rank that skipped one, or a dead peer, leaves the others "
                       "waiting until the process-group timeout)")
        super().__init__(message)


@contextlib.contextmanager
def collective_call(name: str):
    """Name the public engine call ``name`` in a ``CollectiveError`` raised inside."""
    try:
        yield
    except CollectiveError as exc:
        if exc.call is not None:
            raise
        raise CollectiveError(exc.kind, exc.axis, exc.tag, exc.__cause__ or exc, call=name) from exc.__cause__


def collective(name: str):
    """Decorator: the function is a public collective engine call named ``name`` (see ``collective_call``)."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with collective_call(name):
                return fn(*args, **kwargs)
        return call
    return wrap


class Handle:
    """An in-flight collective plus what to run once it has landed."""

    __slots__ = ("_work", "_then", "_keep", "_what")

    def __init__(self, work=None, then=None, keep=(), what: Optional[Tuple[str, str, str]] = None):
        self._work = work
        self._then = then
        self._keep = keep  # tensors the collective reads or writes: alive until it lands
        self._what = what  # (kind, axis, tag): named in the error if the collective fails

    def is_completed(self) -> bool:
        """The collective has landed (what runs after it may not have run yet)."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._work is not None:
            work = self._work
            self._work = None
            try:
                work.wait()
            except CollectiveError:
                raise
            except Exception as exc:  # noqa: BLE001 - gloo/NCCL timeouts and peer losses are RuntimeErrors
                if self._what is None:
                    raise
                raise CollectiveError(*self._what, exc) from exc
        self._keep = ()
        if self._then is not None:
            then, self._then = self._then, None
            then()


class StagedHandle:
    """A multi-stage collective: each stage needs the previous one's result (HSDP/HFSDP and
    two-axis ZeRO-3: outer all-gather then inner all-gather; inner reduce-scatter then outer
    reduction).

    Nothing here runs by itself, on any thread: the schedule calls :meth:`advance` at fixed
    points of its hook sequence (``runtime.py``, "Multi-stage collectives"), and :meth:`wait`
    issues whatever is left. Both run on the caller's thread, so the order of collectives on
    every process group is the order of those calls, the same on every rank. A stage's
    completion work (its ``then``: a gradient addition into the accumulator, a scale, attaching
    parameters) runs when that stage is waited: inside :meth:`advance` just before the next
    stage is issued, or inside :meth:`wait`.
    """

    __slots__ = ("_current", "_rest")

    def __init__(self, first: Handle, stages: Sequence[Callable[[], Handle]] = ()):
        self._current = first
        self._rest: Deque[Callable[[], Handle]] = collections.deque(stages)

    @property
    def stages_left(self) -> int:
        """Stages not yet issued."""
        return len(self._rest)

    @property
    def current(self) -> Handle:
        """The stage issued last (the one :meth:`advance` waits for)."""
        return self._current

    def is_completed(self) -> bool:
        return not self._rest and self._current.is_completed()

    def advance(self) -> bool:
        """Wait for the current stage (running its completion work) and issue the next one.

        False, and nothing done, when every stage has been issued.
        """
        if not self._rest:
            return False
        self._current.wait()
        nxt = self._rest.popleft()()
        if isinstance(nxt, StagedHandle):  # a stage that is itself staged: its stages come next
            self._rest.extendleft(reversed(nxt._rest))
            nxt = nxt._current
        self._current = nxt
        return True

    def wait(self) -> None:
        while self.advance():
            pass
        self._current.wait()


def staged(first: Handle, *stages: Callable[[], Handle]):
    """``first`` when there is nothing after it, else a :class:`StagedHandle` of ``first`` then ``stages``."""
    return StagedHandle(first, stages) if stages else first


class CommAxis:
    """One data-parallel axis: a process group (``None``: an axis of one rank), its name, the ledger.

    ``gloo_reduce_scatter`` (``"ring"`` or ``"allreduce"``; default: the environment
    variable ``MEGATRON_FSDP_GLOO_REDUCE_SCATTER``, else ``"ring"``) picks how a gloo
    group reduce-scatters CPU tensors. Other backends always use the native call.
    """

    def __init__(self, name: str, group, ledger: Ledger, gloo_reduce_scatter: Optional[str] = None):
        self.name = name
        self.group = group
        self.ledger = ledger
        path = gloo_reduce_scatter or os.environ.get(GLOO_REDUCE_SCATTER_ENV) or "ring"
        if path not in GLOO_REDUCE_SCATTER_PATHS:
            raise ValueError(f"{GLOO_REDUCE_SCATTER_ENV}={path!r}: expected one of {GLOO_REDUCE_SCATTER_PATHS}")
        self._gloo = False
        if group is None:  # an absent axis: one rank, nothing is ever sent
            self.size, self.rank = 1, 0
        elif dist.is_available() and dist.is_initialized():
            self.size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
            self._gloo = dist.get_backend(group) == "gloo"
        else:
            raise RuntimeError("a process group was given but torch.distributed is not initialised")
        self.gloo_reduce_scatter = path if self._gloo else None

    def _record(self, kind: str, tensor: torch.Tensor, tag: str, passes: int,
                element_size: Optional[int] = None) -> None:
        """Record a collective on the full buffer ``tensor`` (elements of ``element_size`` bytes on the
        wire, default its own); ``passes`` times ``(N-1)/N`` of it leave this rank."""
        nbytes = tensor.numel() * (element_size or tensor.element_size())
        self.ledger.record(kind, self.name, nbytes, tag, passes * ring_wire_bytes(nbytes, self.size))

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, tag: str = "") -> Handle:
        """Gather equal shards into ``output``; ``shard`` may be this rank's slice of it."""
        if self.size == 1:
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard)
            return Handle()
        self._record("all_gather", output, tag, 1)
        return Handle(_ALL_GATHER(output, shard, group=self.group, async_op=True), what=("all_gather", self.name, tag))

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, tag: str = "") -> Handle:
        """Sum ``full`` over ranks and leave this rank's slice in ``output``.

        On gloo (CPU tensors) a ring of point-to-point messages, unless the native
        all-reduce was asked for; it is as asynchronous as the native call.

        ``full`` may be in another dtype than ``output`` (bf16 gradients reduced in fp32):
        the reduction is that of ``full.to(output.dtype)``, and it is recorded in
        ``output``'s dtype, the bytes that travel. Why here and not in the caller: the ring
        widens one chunk at a time, so a whole widened copy of a unit's gradient (twice
        its bf16 size) never exists, and the ring releases ``full`` when it lands; other
        paths widen the whole buffer first and keep it until the collective is waited.
        """
        if self.size == 1:
            output.copy_(full)
            return Handle()
        ring = self.gloo_reduce_scatter == "ring" and full.device.type == "cpu"
        if full.dtype != output.dtype and not (ring and torch.promote_types(full.dtype, output.dtype) == output.dtype):
            full = full.to(output.dtype)  # a narrowing, or a path that cannot widen as it goes
        if ring:
            work = ring_reduce_scatter(output, full, self.group, self.rank, self.size)  # checks sizes first
            self._record("reduce_scatter", full, tag, 1, output.element_size())
            return Handle(work, what=("reduce_scatter", self.name, tag))
        self._record("reduce_scatter", full, tag, 2 if self._gloo else 1)  # gloo: an all-reduce inside
        return Handle(_REDUCE_SCATTER(output, full, group=self.group, async_op=True), keep=(full,),
                      what=("reduce_scatter", self.name, tag))

    def broadcast(self, tensor: torch.Tensor, tag: str = "") -> Handle:
        """Overwrite ``tensor`` with rank 0's (rank 0 of this axis), in place."""
        if self.size == 1:
            return Handle()
        self._record("broadcast", tensor, tag, 1)
        src = dist.get_global_rank(self.group, 0)
        return Handle(dist.broadcast(tensor, src=src, group=self.group, async_op=True), what=("broadcast", self.name, tag))

    def all_reduce(self, tensor: torch.Tensor, tag: str = "", op: str = "sum") -> Handle:
        """Sum ``tensor`` over ranks, in place (``op="max"``: the elementwise maximum, e.g. FP8 amaxes)."""
        if self.size == 1:
            return Handle()
        self._record("all_reduce", tensor, tag, 2)
        work = dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=self.group, async_op=True)
        return Handle(work, what=("all_reduce", self.name, tag))

    def all_gather_object(self, obj, tag: str = "") -> list:
        """Every rank's ``obj`` (picklable), in rank order; blocking. For rare, small control data
        (an error message naming what differs); bytes recorded: none are known before pickling."""
        if self.size == 1:
            return [obj]
        self.ledger.record("all_gather_object", self.name, 0, tag)
        out = [None] * self.size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as exc:  # noqa: BLE001 - timeouts and peer losses are RuntimeErrors
            raise CollectiveError("all_gather_object", self.name, tag, exc) from exc
        return out

    def all_to_all(self, output: torch.Tensor, send: torch.Tensor, output_splits, input_splits,
                   tag: str = "") -> Handle:
        """Exchange variable-size chunks: ``send[input_splits[k] elements]`` goes to rank ``k`` (all-to-all-v).

        Bytes recorded: the send buffer; wire bytes: what leaves this rank (the
        chunk to itself stays local). gloo and NCCL both run it natively.
        """
        if self.size == 1:
            output.copy_(send)
            return Handle()
        size = send.element_size()
        self.ledger.record("all_to_all", self.name, send.numel() * size, tag,
                           (send.numel() - int(input_splits[self.rank])) * size)
        work = dist.all_to_all_single(output, send, list(output_splits), list(input_splits),
                                      group=self.group, async_op=True)
        return Handle(work, keep=(send, output), what=("all_to_all", self.name, tag))

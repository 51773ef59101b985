"""Named ranges and a schedule timeline for every gather, reduce, wait and install.

Two consumers, both off by default:

* ``torch.profiler``: while a profiler records, each step of the schedule runs inside a
  ``record_function`` range named ``fsdp.<kind> <unit>`` (``fsdp.all_gather blocks.0``,
  ``fsdp.wait.reduce blocks.1``, ...), and on CUDA inside an NVTX range of the same
  name, so a Chrome trace or an Nsight timeline shows the schedule next to the kernels.
* a :class:`Timeline` (``with recording() as timeline``): rows of (time, event, kind,
  unit) for the runtime's own events (a unit's forward and backward beginning and
  ending, a wait beginning and ending) and, from the ledger, every collective issued on
  an axis, attributed to the range it was issued in. ``tools/profile_schedule.py``
  prints it per unit (issued, landed, how long compute waited); tests read it to prove
  what overlaps what without timing.

When neither is active a range costs a function call and two checks, so the hooks keep
them on the hot path unconditionally.

Kinds: ``all_gather`` (a unit's weights, prefetched or on demand), ``reduce`` (a unit's
gradient reduction), ``install`` (updated weights into compute storage after the
optimizer step, with the gathers that rebuild them); a wait is ``wait.<kind>``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Iterator, List, Optional

import torch

_timeline: Optional["Timeline"] = None


@dataclasses.dataclass(frozen=True)
class TimelineEvent:
    """One row: ``event`` is "begin"/"end" (a range), "issue" (a collective), or "forward"/"backward"
    with ``kind`` "begin"/"end" (a unit's compute)."""

    t: float            # seconds since the timeline started
    event: str
    kind: str           # all_gather, reduce, install, wait.<kind>; or begin/end for compute rows
    unit: str
    axis: str = ""      # issue rows: the data-parallel axis
    nbytes: int = 0     # issue rows: the full buffer the collective works on
    collective: str = ""  # issue rows: the ledger kind (all_gather, reduce_scatter, all_reduce)
    done: bool = False  # wait "begin" rows: the collective had already landed


class Timeline:
    """Events of the schedule in the order they happened on this rank."""

    def __init__(self):
        self.start = time.perf_counter()
        self.events: List[TimelineEvent] = []
        self._open: List[tuple] = []  # (kind, unit) of the ranges entered and not yet left

    def add(self, event: str, kind: str, unit: str, **extra) -> None:
        self.events.append(TimelineEvent(time.perf_counter() - self.start, event, kind, unit, **extra))

    def issued(self, collective: str, axis: str, nbytes: int, tag: str) -> None:
        """A collective left this rank (called by the ledger): attributed to the innermost open range."""
        kind, unit = self._open[-1] if self._open else ("", tag)
        self.add("issue", kind, unit or tag, axis=axis, nbytes=nbytes, collective=collective)

    def index(self, event: str, kind: str, unit: str, axis: Optional[str] = None, nth: int = 0) -> int:
        """Position of the ``nth`` row matching (event, kind, unit[, axis]); raises if absent."""
        hits = [i for i, e in enumerate(self.events)
                if e.event == event and e.kind == kind and e.unit == unit and axis in (None, e.axis)]
        if len(hits) <= nth:
            raise LookupError(f"no {event} {kind} {unit} {axis or ''} #{nth} in the timeline")
        return hits[nth]


@contextlib.contextmanager
def recording() -> Iterator[Timeline]:
    """Record the schedule of this process into a fresh :class:`Timeline` while inside."""
    global _timeline
    previous, _timeline = _timeline, Timeline()
    try:
        yield _timeline
    finally:
        _timeline = previous


def _profiler_on() -> bool:
    return torch._C._autograd._profiler_enabled()


_cuda_present: Optional[bool] = None  # torch.cuda.is_available() is slow to ask on every range


def _nvtx_on() -> bool:
    global _cuda_present
    if _cuda_present is None:
        _cuda_present = torch.cuda.is_available()
    return _cuda_present and torch.cuda.is_initialized()


class _Range:
    """A named range: record_function + NVTX when a profiler runs, timeline rows when recording."""

    __slots__ = ("name", "kind", "unit", "_rf", "_nvtx", "_timeline")

    def __init__(self, kind: str, unit: str, waiting_on):
        self.kind, self.unit = kind, unit
        self.name = f"fsdp.{kind} {unit}"
        self._timeline = _timeline
        if self._timeline is not None:
            done = waiting_on is not None and waiting_on.is_completed()
            self._timeline.add("begin", kind, unit, done=done)
            self._timeline._open.append((kind, unit))
        self._rf = torch.autograd.profiler.record_function(self.name) if _profiler_on() else None
        self._nvtx = _nvtx_on()

    def __enter__(self):
        if self._rf is not None:
            self._rf.__enter__()
        if self._nvtx:
            torch.cuda.nvtx.range_push(self.name)
        return self

    def __exit__(self, *exc):
        if self._nvtx:
            torch.cuda.nvtx.range_pop()
        if self._rf is not None:
            self._rf.__exit__(*exc)
        if self._timeline is not None:
            self._timeline._open.pop()
            self._timeline.add("end", self.kind, self.unit)
        return False


class _Null:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL = _Null()


def span(kind: str, unit: str, waiting_on=None):
    """A range around one schedule step of ``unit``; ``waiting_on``: the handle a wait waits for
    (the timeline notes whether it had already landed)."""
    if _timeline is None and not _profiler_on() and not _nvtx_on():
        return _NULL
    return _Range(kind, unit, waiting_on)


def mark(event: str, kind: str, unit: str) -> None:
    """A compute row (``event`` forward/backward, ``kind`` begin/end) when a timeline records."""
    if _timeline is not None:
        _timeline.add(event, kind, unit)


def on_collective(collective: str, axis: str, nbytes: int, tag: str) -> None:
    """The ledger's hook: every collective issued on an axis."""
    if _timeline is not None:
        _timeline.issued(collective, axis, nbytes, tag)

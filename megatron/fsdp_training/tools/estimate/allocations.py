"""Bytes that torch allocates, live and at their peak, per phase of a step: the same count for a real run and a
simulated one.

Why not the allocator's own counters: on CPU torch keeps none, and under ``FakeTensorMode`` nothing is allocated at
all. What both runs share is the storages torch's operators create: every storage an operator returns is counted
from that call until it is freed (a weak reference's callback), at its current size (the engine releases and
re-allocates its gather buffers with ``UntypedStorage.resize_``, which is followed while this counts). An output on
an input's storage (a view, an in-place result) allocates nothing: a view of memory torch did not allocate (a NumPy
array's, an ``mmap``'s) is not counted; a tensor on the meta device (a model built there) holds no memory and is not
counted. What existed before counting began is not counted: start it before the build.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Dict, Iterator, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class AllocationCounter(TorchDispatchMode):
    """``with AllocationCounter() as counter:``; ``counter.phase(name)`` (or ``begin``/``end``) marks a phase;
    ``peaks[name]`` is the highest live count while it was the innermost phase, ``created[name]`` the bytes of
    every storage created meanwhile (what its operators wrote)."""

    def __init__(self):
        super().__init__()
        self._sizes: Dict[int, int] = {}  # storage key -> bytes counted for it now
        self._refs: Dict[int, weakref.ref] = {}
        self.live = 0
        self.peaks: Dict[str, int] = {}  # phase -> highest live bytes while it ran
        self.created: Dict[str, int] = {}  # phase -> bytes of the storages created while it ran (the writes)
        self._phases: List[str] = []
        self._resize = None

    # ------------------------------------------------------------------ counting
    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._sizes:
            return
        size = storage.nbytes()
        self._sizes[key] = size
        self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._forget(key))
        if self._phases:
            self.created[self._phases[-1]] = self.created.get(self._phases[-1], 0) + size
        self._grew(size)

    def _forget(self, key: int) -> None:
        size = self._sizes.pop(key, 0)
        self._refs.pop(key, None)
        self.live -= size

    def _grew(self, delta: int) -> None:
        self.live += delta
        if self._phases and self.live > self.peaks[self._phases[-1]]:
            self.peaks[self._phases[-1]] = self.live

    def _resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        key = storage._cdata
        if key in self._sizes:
            old, self._sizes[key] = self._sizes[key], nbytes
            self._grew(nbytes - old)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = None
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":  # a meta tensor holds no memory
                storage = t.untyped_storage()
                if storage._cdata in self._sizes:
                    continue
                if inputs is None:
                    inputs = {a.untyped_storage()._cdata for a in tree_leaves((args, kwargs))
                              if isinstance(a, torch.Tensor)}
                if storage._cdata not in inputs:  # a view or an in-place result allocates nothing
                    self._track(storage)
        return out

    # ------------------------------------------------------------------ phases
    def begin(self, name: str) -> None:
        """From now until ``end(name)``, bytes count toward ``peaks[name]`` (the innermost phase only: a phase
        begun inside another counts for itself)."""
        self._phases.append(name)
        self.peaks[name] = max(self.peaks.get(name, 0), self.live)

    def end(self, name: str) -> None:
        position = len(self._phases) - 1 - self._phases[::-1].index(name)
        del self._phases[position]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.begin(name)
        try:
            yield
        finally:
            self.end(name)

    def __enter__(self):
        counter, original = self, torch.UntypedStorage.resize_

        def resize_(storage, nbytes):  # followed while counting: the engine's release and re-allocation
            result = original(storage, nbytes)
            counter._resized(storage, int(nbytes))
            return result

        self._resize, torch.UntypedStorage.resize_ = original, resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

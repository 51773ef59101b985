"""Per-iteration timers for ``--log-timers-to-tensorboard`` (Megatron-LM's ``forward-backward``,
``optimizer`` and ``all-grads-sync``).

Host wall time around each phase, synchronising the device first on a GPU (as Megatron-LM's
timers do with ``barrier=False``). ``all-grads-sync`` wraps the schedule's
``finalize_model_grads_func``, where the data-parallel reductions of the last micro-batch
finish (under FSDP the reduce-scatters that overlap the backward pass are inside
``forward-backward`` too, as in Megatron-LM).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import OrderedDict
from typing import Dict

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class IterationTimers:
    """Accumulates milliseconds per named phase until ``take()`` (one iteration's values)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._ms: Dict[str, float] = OrderedDict()

    @contextlib.contextmanager
    def time(self, name: str):
        if not self.enabled:
            yield
            return
        _sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            _sync()
            self._ms[name] = self._ms.get(name, 0.0) + (time.perf_counter() - start) * 1000

    def wrap(self, name: str, fn):
        """``fn`` timed under ``name`` on every call (None stays None)."""
        if fn is None or not self.enabled:
            return fn

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.time(name):
                return fn(*args, **kwargs)
        return timed

    def take(self) -> Dict[str, float]:
        """Scalars ``<name>-time`` (ms) of the phases since the last call, then reset."""
        values = OrderedDict((f"{name}-time", ms) for name, ms in self._ms.items())
        self._ms.clear()
        return values

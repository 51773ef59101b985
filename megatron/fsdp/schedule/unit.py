"""One FSDP unit: its parameters' storage and the explicit state machine of its life cycle.

::

    IDLE --start_unshard--> UNSHARDING --begin_use--> FORWARD --release--> IDLE
      |                         |                       |
      +------begin_use--------------------------------> BACKWARD --release--> IDLE

``IDLE``: between uses. ``UNSHARDING``: a prefetch issued its all-gather (some stages of a
multi-stage gather may still be unissued, see ``runtime.py``). ``FORWARD``/``BACKWARD``:
the weights are in place and in use. ``begin_use`` from ``IDLE`` gathers on demand; from
either state it waits for whatever gather is pending (a prefetch, or the install after an
optimizer step) before entering the new state. ``release`` waits too, then frees the full
weights under ZeRO-3 (also ``UNSHARDING -> IDLE``: a prefetched unit that was not used;
``FORWARD -> BACKWARD``: a backward that begins before the forward released it). Any transition not in the table is a bug in the runtime and raises
at once instead of corrupting a collective schedule.

Where the weights are is the storage's ``residency`` (``buffers.Residency``: ``SHARDED``,
``GATHERING``, ``FULL``), the one source of truth: ``IDLE`` is ``SHARDED`` under ZeRO-3
(``FULL`` on other levels), ``UNSHARDING`` is ``GATHERING``, ``FORWARD`` and ``BACKWARD``
are ``FULL``.
"""

from __future__ import annotations

import enum
from typing import List, Optional, Tuple

import torch

from ..collectives import profiling
from ..sharding.buffers import UnitStorage
from ..collectives.comm import Handle


class UnitState(enum.Enum):
    IDLE = "idle"
    UNSHARDING = "unsharding"
    FORWARD = "forward"
    BACKWARD = "backward"


_TRANSITIONS = {
    UnitState.IDLE: (UnitState.UNSHARDING, UnitState.FORWARD, UnitState.BACKWARD),
    UnitState.UNSHARDING: (UnitState.FORWARD, UnitState.BACKWARD, UnitState.IDLE),
    UnitState.FORWARD: (UnitState.IDLE, UnitState.BACKWARD),
    UnitState.BACKWARD: (UnitState.IDLE,),
}


class FSDPUnit:
    """A group of parameters gathered, released and reduced together."""

    def __init__(self, index: int, name: str, module: torch.nn.Module, storage: UnitStorage, param_names: List[str]):
        self.index = index
        self.name = name or "<root>"
        self.module = module  # the unit module whose forward hooks gather, release and reduce it
        self.storage = storage
        self.param_names = param_names
        self.state = UnitState.IDLE
        self._pending: Optional[Handle] = None  # in-flight all-gather of the compute weights
        self._pending_kind = "all_gather"       # or "install": what the pending handle rebuilds
        trainable = [i for i, _ in storage.trainable_params]
        self.trainable_index = {i: k for k, i in enumerate(trainable)}
        self._grad_ready = [False] * len(trainable)
        self._ready_count = 0
        self.reduced_this_step = False  # the once-per-step reduction stage has run
        # ZeRO-3 with frozen parameters: once the unit's own gradients are in, its frozen weights may
        # still carry the gradient on to earlier units (LoRA: only adapters trainable), so its backward
        # ends when the gradients of its inputs are computed (``runtime.Schedule.inputs_done``).
        self.waits_for_input_grads = storage.releases and len(trainable) < len(storage.params)
        self.grads_pending = False   # in a backward, its gradients not yet reduced
        self.weights_needed = False  # in a backward, its weights may still be used (until its inputs' gradients)

    @property
    def num_trainable(self) -> int:
        return len(self._grad_ready)

    def transition(self, new: UnitState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"FSDP unit {self.name}: illegal transition {self.state.value} -> {new.value}")
        self.state = new

    # -------------------------------------------------------------- gather
    def start_unshard(self) -> Handle:
        """Issue the all-gather without waiting (prefetch); returns its handle (the schedule may
        advance a multi-stage gather before the unit's use waits for it)."""
        self.transition(UnitState.UNSHARDING)
        self._gather()
        return self._pending if self._pending is not None else Handle()

    def begin_use(self, state: UnitState) -> None:
        """Make the weights usable (gather them unless in flight or resident, then wait) and enter
        FORWARD or BACKWARD."""
        if self.state is UnitState.IDLE:
            self._gather()
        self.wait_weights()
        self.transition(state)

    def _gather(self) -> None:
        if self.storage.resident:
            return  # nothing to gather; an install-gather after the step may be pending
        self.wait_weights()
        with profiling.span("all_gather", self.name):
            self._pending = self.storage.unshard(tag=self.name)
        self._pending_kind = "all_gather"

    @property
    def pending(self) -> Tuple[str, Optional[Handle]]:
        """What is in flight into the compute weights: ``("all_gather" or "install", handle)``;
        the handle is None when nothing is."""
        return self._pending_kind, self._pending

    def wait_weights(self) -> None:
        if self._pending is not None:
            handle, self._pending = self._pending, None
            with profiling.span("wait." + self._pending_kind, self.name, waiting_on=handle):
                handle.wait()

    def set_pending(self, handle: Handle) -> None:
        """An install-gather after the optimizer step; waited before the next use."""
        self.wait_weights()
        self._pending = handle
        self._pending_kind = "install"

    def release(self) -> None:
        self.wait_weights()
        self.storage.reshard()
        self.transition(UnitState.IDLE)

    # ------------------------------------------------------------ gradients
    def begin_backward(self) -> None:
        self._grad_ready = [False] * self.num_trainable
        self._ready_count = 0
        self.grads_pending = True
        self.weights_needed = self.waits_for_input_grads
        self.storage.begin_grads()

    def mark_ready(self, param_index: int) -> bool:
        """Record that a parameter's grad has been accumulated; True when all have."""
        k = self.trainable_index[param_index]
        if not self._grad_ready[k]:
            self._grad_ready[k] = True
            self._ready_count += 1
        return self.all_grads_ready

    @property
    def all_grads_ready(self) -> bool:
        return self._ready_count == self.num_trainable

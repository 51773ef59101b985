"""The schedule: hooks that gather, release and reduce units around forward and backward.

Order of collectives is a pure function of the order in which units run, which
is the same on every rank for the same model code; no set or dict with
unstable order decides it. Prefetch depth is one unit in each direction, so at
most the running unit, its enclosing units, the root and one prefetched unit
hold full weights at once.
"""

from __future__ import annotations

import collections
from typing import Deque, Dict, List, Optional

import torch
from torch.utils._pytree import tree_flatten

from .comm import Handle
from .unit import FSDPUnit, UnitState

MAX_INFLIGHT_REDUCTIONS = 2


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Runtime:
    def __init__(self, units: List[FSDPUnit], root: Optional[FSDPUnit]):
        self.units = units          # registration order; root first when it has parameters
        self.root = root            # None when every parameter sits in some unit
        self.sync_grads = True
        self._scaled_this_step = False  # per-section gradient scales applied (once per step)
        self.backwards_since_step = 0
        self._order: List[FSDPUnit] = []           # forward order of this pass
        self._bwd_order: List[FSDPUnit] = []       # backward order of this pass
        self._last_next: Dict[int, FSDPUnit] = {}  # forward prefetch map from the previous pass
        self._last_bwd_next: Dict[int, FSDPUnit] = {}
        self._bwd_next: Optional[Dict[int, FSDPUnit]] = None
        # How each gather was satisfied, per phase: "prefetched" (issued before the
        # unit was needed) or "on_demand" (the unit had to wait for its own gather).
        self.gather_stats = {p: {"prefetched": 0, "on_demand": 0} for p in ("forward", "backward")}
        self._reductions: Deque[Handle] = collections.deque()
        self._callback_queued = False

    # ---------------------------------------------------------------- forward
    def root_pre_forward(self) -> None:
        if self._order:
            self._last_next = self._next_map(self._order)
        self._order = []
        self._bwd_next = None
        if self.root is not None and self.root.state in (UnitState.IDLE, UnitState.UNSHARDING):
            self.root.activate(UnitState.FORWARD)

    def root_post_forward(self, output):
        if torch.is_grad_enabled():
            self._register_pre_backward(self.root, output)
        else:
            self._release_all()
        return output

    def pre_forward(self, unit: FSDPUnit) -> None:
        if unit.state in (UnitState.FORWARD, UnitState.BACKWARD):
            return  # re-entry, or activation recompute inside backward: already resident
        if _in_backward():
            self._enter_backward(unit)
            return
        self._count_gather(unit, "forward")
        unit.activate(UnitState.FORWARD)
        self._order.append(unit)
        self._prefetch(self._last_next.get(unit.index))

    def post_forward(self, unit: FSDPUnit, output):
        if unit.state is not UnitState.FORWARD:
            return output  # recompute during backward: keep the weights for backward
        unit.release()
        if torch.is_grad_enabled():
            self._register_pre_backward(unit, output)
        return output

    def _count_gather(self, unit: FSDPUnit, phase: str) -> None:
        if unit.state is UnitState.UNSHARDING:
            self.gather_stats[phase]["prefetched"] += 1
        elif not unit.storage.resident:
            self.gather_stats[phase]["on_demand"] += 1

    def _next_map(self, order: List[FSDPUnit]) -> Dict[int, FSDPUnit]:
        return {u.index: v for u, v in zip(order, order[1:])}

    def _prefetch(self, unit: Optional[FSDPUnit]) -> None:
        if unit is not None and unit.state is UnitState.IDLE and not unit.storage.resident:
            unit.start_unshard()

    # --------------------------------------------------------------- backward
    def _register_pre_backward(self, unit: FSDPUnit, output) -> None:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda _grads: self._pre_backward(unit), mode="any")

    def _pre_backward(self, unit: Optional[FSDPUnit]) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if unit is None or unit.state is UnitState.BACKWARD:
            return
        if unit is not self.root:
            self._count_gather(unit, "backward")
        self._enter_backward(unit)
        if unit is self.root:
            return
        if self._bwd_next is None:  # the previous backward's order, or reversed forward order at first
            self._bwd_next = self._last_bwd_next or self._next_map(self._order[::-1])
            self._bwd_order = []
        self._bwd_order.append(unit)
        self._prefetch(self._bwd_next.get(unit.index))

    def _enter_backward(self, unit: FSDPUnit) -> None:
        if unit.state is UnitState.FORWARD:
            unit.transition(UnitState.BACKWARD)
        else:
            unit.activate(UnitState.BACKWARD)
        unit.begin_backward()

    def on_grad(self, unit: FSDPUnit, param_index: int) -> None:
        if unit.state is not UnitState.BACKWARD:
            raise RuntimeError(
                f"parameter {unit.param_names[param_index]!r} of FSDP unit {unit.name} received a gradient "
                "outside that unit's backward; call the unit module itself (its forward hooks gather and "
                "reduce it) instead of calling its submodules or parameters directly")
        if unit.mark_ready(param_index):
            self._post_backward(unit)

    def _post_backward(self, unit: FSDPUnit) -> None:
        storage = unit.storage
        if unit.num_trainable:
            if storage.levels.inner.keeps_full_grads:
                storage.accumulate_local()
                if self.sync_grads:
                    self._reduce_step(unit)
            else:
                with_step = self.sync_grads and storage.has_step_stage
                self._enqueue(storage.reduce_microbatch(tag=unit.name, then_step=with_step))
                unit.reduced_this_step |= with_step
        storage.end_grads()
        unit.release()

    def _reduce_step(self, unit: FSDPUnit) -> None:
        self._enqueue(unit.storage.reduce_step(tag=unit.name))
        unit.reduced_this_step = True

    def _enqueue(self, handle: Handle) -> None:
        self._reductions.append(handle)
        while len(self._reductions) > MAX_INFLIGHT_REDUCTIONS:
            self._reductions.popleft().wait()

    def _drain(self) -> None:
        while self._reductions:
            self._reductions.popleft().wait()

    def _end_of_backward(self) -> None:
        """Runs once after the whole backward pass: flush units whose params got no grad."""
        self._callback_queued = False
        for unit in self._order[::-1] + [u for u in self.units if u not in self._order]:
            if unit.state is UnitState.BACKWARD:
                self._post_backward(unit)
        self._release_all()
        if self.sync_grads:
            self._reduce_unreduced()
        self._drain()
        if self._bwd_order:
            self._last_bwd_next = self._next_map(self._bwd_order)
        self.backwards_since_step += 1

    def _release_all(self) -> None:
        for unit in self.units:
            if unit.state is not UnitState.IDLE:
                unit.release()

    def _reduce_unreduced(self) -> None:
        """Run the once-per-step stage of every unit the last micro-batch did not (deterministic order)."""
        for unit in self.units:
            if unit.num_trainable and unit.storage.has_step_stage and not unit.reduced_this_step:
                self._reduce_step(unit)

    # ------------------------------------------------------------ step hooks
    def start_grad_sync(self) -> None:
        """Issue the once-per-step reductions not yet issued; they complete in ``finish_grad_sync``."""
        self._reduce_unreduced()

    def finish_grad_sync(self) -> None:
        """Complete all gradient reductions of this step (also after a forgotten no_sync).

        Idempotent within a step: Megatron's schedule finishes the sync in
        ``finalize_model_grads`` and the optimizer finishes it again.
        """
        self._reduce_unreduced()
        self._drain()
        if not self._scaled_this_step:
            self._scaled_this_step = True
            for unit in self.units:
                if unit.storage.grad_scale != 1.0 and unit.num_trainable:
                    unit.storage.grad_accum.mul_(unit.storage.grad_scale)

    def after_step(self) -> None:
        """Install updated weights; the gathers overlap with the next forward."""
        self.backwards_since_step = 0
        self._scaled_this_step = False
        first = [self.root] if self.root is not None else []
        order = first + self._order + [u for u in self.units if u is not self.root and u not in self._order]
        for unit in order:
            unit.reduced_this_step = False
            unit.set_pending(unit.storage.install_main_weights(tag=unit.name))

    def zero_grads(self) -> None:
        self._scaled_this_step = False
        for unit in self.units:
            unit.storage.zero_grads()

    def wait_weights(self) -> None:
        for unit in self.units:
            unit.wait_weights()

    def wait_all(self) -> None:
        """Nothing of this model in flight afterwards: reductions drained, install gathers landed."""
        self._drain()
        self.wait_weights()

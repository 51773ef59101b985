"""The schedule: hooks that gather, release and reduce units around forward and backward.

Why one module: the order of collectives must be a pure function of the order in which
units run (the same on every rank for the same model code; no set, dict order, thread or
timing decides it), so every gather, release, reduction and multi-stage advance is issued
from these hooks at fixed points. How far it runs ahead is an :class:`Overlap`. The rules
(passes, direct calls, prefetch order, the held last unit, reductions in flight) are in
docs/engine.md, "Schedule"; the multi-stage points of two-axis meshes in docs/mesh.md,
"What overlaps".
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..collectives import profiling
from ..collectives.comm import Handle, StagedHandle
from .unit import FSDPUnit, UnitState


@dataclasses.dataclass(frozen=True)
class Overlap:
    """How far communication runs ahead of compute.

    ``forward_prefetch`` / ``backward_prefetch``: units whose all-gather is issued
    ahead of their use (0: every gather on demand); each one more costs one unit's
    full weights in memory. ``reductions_in_flight``: gradient reductions issued and
    not yet waited (0: each is waited as soon as it is issued); each one more keeps
    one unit's reduction buffers alive a little longer. ``None`` (the default): one,
    or two while the newest reduction has a later stage to issue (HSDP, HFSDP,
    ZeRO-3 x ZeRO-3), so that stage is issued at the next compute end and lands
    during the backward after it instead of being waited as soon as it is issued.
    ``double_buffer=True``: ZeRO-3 units gather into persistent buffers allocated once (two per
    section and nesting depth, or the prefetch depth + 1) instead of allocating at every gather
    (``gather_buffers.py``; Megatron-LM's ``--fsdp-double-buffer``).
    ``reduce_in_backward=False``: the once-per-step reductions (the full-gradient levels' and the outer
    axis's) wait for ``start_grad_sync`` / ``finish_grad_sync`` instead of running in the backward of the
    first micro-batch outside ``no_sync``: Megatron-Core's DDP without ``--overlap-grad-reduce``, whose
    schedule then calls no ``no_sync``. Grad-sharded levels still reduce-scatter every micro-batch.
    """

    forward_prefetch: int = 1
    backward_prefetch: int = 1
    reductions_in_flight: Optional[int] = None
    double_buffer: bool = False
    reduce_in_backward: bool = True

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in ("bool", bool):
                if not isinstance(value, bool):
                    raise ValueError(f"{field.name} must be True or False, got {value!r}")
                continue
            if value is None and field.name == "reductions_in_flight":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{field.name} must be an integer >= 0, got {value!r}")


GATHER_OUTCOMES = ("prefetched", "on_demand", "held")  # how a unit's weights were there when it ran


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


_IN_USE = (UnitState.FORWARD, UnitState.BACKWARD)


def _stages_left(handle: Optional[Handle]) -> bool:
    """``handle`` is a multi-stage collective with stages not yet issued."""
    return isinstance(handle, StagedHandle) and handle.stages_left > 0


class Schedule:
    """The hooks' side of the schedule: what each forward/backward hook gathers, releases, reduces and
    advances, and the step hooks (``start_grad_sync``, ``finish_grad_sync``, ``after_step``)."""

    def __init__(self, units: List[FSDPUnit], root: Optional[FSDPUnit], overlap: Overlap = Overlap()):
        self.units = units          # registration order; root first when it has parameters
        self.root = root            # None when every parameter sits in some unit
        self.overlap = overlap
        self.sync_grads = True
        self._scaled_this_step = False  # per-section gradient scales applied (once per step)
        self.backwards_since_step = 0
        self._order: List[FSDPUnit] = []           # forward order of this pass
        self._fwd_ends: List[FSDPUnit] = []        # order in which this pass's forwards ended
        self._bwd_order: List[FSDPUnit] = []       # backward order of this pass
        # Prefetch plans: the order of the previous pass (registration order before the first).
        self._fwd_plan = _Plan([u for u in units if u is not root])
        self._last_bwd_plan: Optional[_Plan] = None
        self._bwd_plan: Optional[_Plan] = None     # this backward's plan, fixed at its first unit
        # How each gather was satisfied, per phase: "prefetched" (issued before the
        # unit was needed) or "on_demand" (the unit had to wait for its own gather).
        # "held": a unit whose backward found it still gathered from its forward (``_held_for_backward``).
        self.gather_stats = {p: dict.fromkeys(GATHER_OUTCOMES, 0) for p in ("forward", "backward")}
        # The unit whose forward ended last in the previous pass: the backward starts with it, so it
        # stays gathered from its forward into its backward (None until a pass has shown the order).
        self._held_for_backward: Optional[FSDPUnit] = None
        self._reductions: Deque[Tuple[str, Handle]] = collections.deque()
        # Multi-stage collectives with stages not yet issued, in issue order: (kind, unit, handle).
        self._staged: List[Tuple[str, str, StagedHandle]] = []
        self._callback_queued = False
        self._root_calls = 0      # calls of the root module in progress (nested: more than one)
        self._pass_open = False   # between root_pre_forward and root_post_forward
        # Calls of modules that gathered units for themselves (``direct_call_begins``), innermost last:
        # (module, the units that call gathered).
        self._direct: List[Tuple[torch.nn.Module, List[FSDPUnit]]] = []
        # Called with a unit's name once that unit's backward is done (its gradient reduction
        # issued, its weights released): a place for a caller's per-unit policy, such as the job
        # handing freed activation memory back to the OS (megatron/fsdp_training/allocator.py).
        self.post_backward_hooks: Dict[int, Callable[[str], None]] = collections.OrderedDict()  # weak-referable

    # ---------------------------------------------------------------- forward
    def enter_root_module(self) -> bool:
        """The root module's forward begins (the root module's pre-hook); the outermost call opens the
        pass. True when this call opened it."""
        self._root_calls += 1
        if self._root_calls > 1:
            return False
        self.root_pre_forward()
        return True

    def leave_root_module(self, output):
        """The root module's forward returned, or raised (its post-hook runs either way); the outermost
        call closes the pass."""
        self._root_calls = max(0, self._root_calls - 1)
        return self.root_post_forward(output) if self._root_calls == 0 else output

    def root_pre_forward(self) -> None:
        # A unit still gathered from the last forward (kept for a backward that did not come): released,
        # so this forward gathers, hooks and records it like every other unit.
        self._release_all()
        if self._order:
            self._fwd_plan = _Plan(self._order)
        if self._fwd_ends:
            self._held_for_backward = self._fwd_ends[-1]
        self._order = []
        self._fwd_ends = []
        self._bwd_plan = None
        self._pass_open = True
        root = self.root
        if root is not None and root.state is UnitState.IDLE and not root.storage.resident:
            self._track_staged("all_gather", root, root.start_unshard())
        self._prefetch(self._fwd_plan.first(self.overlap.forward_prefetch))
        if root is not None and _stages_left(root.pending[1]):
            # The root is about to wait for a multi-stage gather (or install) of its own, so
            # this is a compute boundary: every multi-stage collective in flight moves one
            # stage on first, and the first units' next stages land during the root's compute
            # instead of being issued inside their waits.
            self._advance_staged()
        if root is not None and root.state in (UnitState.IDLE, UnitState.UNSHARDING):
            root.begin_use(UnitState.FORWARD)
        if root is not None:
            profiling.mark("forward", "begin", root.name)

    def root_post_forward(self, output):
        self._pass_open = False
        if self.root is not None:
            profiling.mark("forward", "end", self.root.name)
        if torch.is_grad_enabled():
            self._register_pre_backward(self.root, output)
        else:
            self._release_all()
        return output

    def pre_forward(self, unit: FSDPUnit, args: tuple = (), kwargs: Optional[dict] = None):
        """A unit module's forward begins (its pre-hook, with the call's ``args`` and ``kwargs``). Returns
        None, or the inputs to call it with instead (``_watch_inputs``)."""
        if unit.state in (UnitState.FORWARD, UnitState.BACKWARD):
            return None  # re-entry, or activation recompute inside backward: already resident
        if _in_backward():
            self._enter_backward(unit)  # a reentrant recompute: the inner backward is this unit's
            return self._watch_inputs(unit, args, kwargs)
        self._count_gather(unit, "forward")
        ahead: List[FSDPUnit] = []  # a unit called outside a pass: nothing of a pass to record or prefetch
        if self._pass_open:
            self._order.append(unit)
            ahead = self._fwd_plan.after(unit, self.overlap.forward_prefetch)
        self._gather_then_prefetch(unit, ahead)
        unit.begin_use(UnitState.FORWARD)
        profiling.mark("forward", "begin", unit.name)
        return self._watch_inputs(unit, args, kwargs)

    def _watch_inputs(self, unit: FSDPUnit, args: tuple, kwargs: Optional[dict]):
        """A unit that ``waits_for_input_grads``: its inputs that require grad pass through an identity
        autograd function whose backward runs once their gradients from this unit's compute are summed,
        before they flow on to earlier units: there ``inputs_done`` ends the unit's backward."""
        if not unit.waits_for_input_grads or not torch.is_grad_enabled():
            return None
        flat, spec = tree_flatten((args, kwargs or {}))
        where = [k for k, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not where:
            return None
        for k, t in zip(where, _InputsDone.apply(functools.partial(self.inputs_done, unit), *(flat[k] for k in where))):
            flat[k] = t
        return tree_unflatten(flat, spec)

    def post_forward(self, unit: FSDPUnit, output):
        if unit.state is not UnitState.FORWARD:
            return output  # recompute during backward: keep the weights for backward
        self._advance_staged()
        profiling.mark("forward", "end", unit.name)
        if self._pass_open:
            self._fwd_ends.append(unit)
        if torch.is_grad_enabled():
            if unit is not self._held_for_backward or not self._pass_open:
                unit.release()
            self._register_pre_backward(unit, output, in_pass=self._pass_open)
        else:
            unit.release()
        return output

    # ----------------------------------------------------- modules called on their own
    def direct_call_begins(self, module: torch.nn.Module, units: List[FSDPUnit]) -> None:
        """``module``'s pre-hook: its forward uses parameters of ``units`` and it is not their unit
        module. Those not gathered now (``module`` called on its own, not inside their unit's forward)
        are gathered for this call, in the order given (the same on every rank)."""
        if not self._direct and self._pass_open and all(u.state in _IN_USE for u in units):
            return  # inside its units' forwards (or backwards): the training path, nothing to do
        gathered: List[FSDPUnit] = []
        self._direct.append((module, gathered))
        for unit in units:
            if unit.state in _IN_USE:
                continue
            if unit is not self.root:
                self.pre_forward(unit)
            elif _in_backward():
                self._enter_backward(unit)
            else:
                unit.begin_use(UnitState.FORWARD)
            gathered.append(unit)

    def direct_call_ends(self, module: torch.nn.Module, output):
        """``module``'s post-hook (it runs when the forward raised, too): what its call gathered is
        released, a unit's backward hooked on the output as after its own forward."""
        if not self._direct or self._direct[-1][0] is not module:
            return output
        _, gathered = self._direct.pop()
        for unit in reversed(gathered):
            if unit is not self.root:
                self.post_forward(unit, output)
            elif unit.state is UnitState.FORWARD:  # (not in a recompute, where it stays for the backward)
                unit.release()
                if torch.is_grad_enabled():
                    self._register_pre_backward(unit, output, in_pass=False)
        return output

    def _count_gather(self, unit: FSDPUnit, phase: str) -> None:
        if unit.state is UnitState.FORWARD:
            self.gather_stats[phase]["held"] += 1
        elif unit.state is UnitState.UNSHARDING:
            self.gather_stats[phase]["prefetched"] += 1
        elif not unit.storage.resident:
            self.gather_stats[phase]["on_demand"] += 1

    def _prefetch(self, units: List[FSDPUnit]) -> None:
        for unit in units:
            if unit.state is UnitState.IDLE and not unit.storage.resident:
                self._track_staged("all_gather", unit, unit.start_unshard())

    def _gather_then_prefetch(self, unit: FSDPUnit, ahead: List[FSDPUnit]) -> None:
        """A unit's pre-hook, before it waits for its weights: its gather issued (on demand, if no
        prefetch did), every stage of it still unissued issued now (its input has had the compute
        before this hook to land), then the prefetch of the units ``ahead``, so the last stage
        lands while those are issued. Only the first unit of a pass has stages left here (later
        ones were advanced at the previous unit's compute end; the backward's first unit is
        usually still gathered from its forward)."""
        self._prefetch([unit])
        kind, handle = unit.pending
        while _stages_left(handle):
            self._advance_one(kind, unit.name, handle)
        self._prefetch(ahead)

    # ------------------------------------------------------ multi-stage collectives
    def _track_staged(self, kind: str, unit: FSDPUnit, handle: Handle) -> None:
        if _stages_left(handle):
            self._staged.append((kind, unit.name, handle))

    def _advance_staged(self) -> None:
        """A compute boundary: every multi-stage collective issued before now moves one stage on.

        In issue order, on this thread: the same collectives in the same order on every rank.
        """
        staged, self._staged = self._staged, []
        for kind, name, handle in staged:
            if not handle.stages_left:
                continue  # waited (all stages issued) since
            self._advance_one(kind, name, handle)
            if handle.stages_left:
                self._staged.append((kind, name, handle))

    def _issue_every_stage(self) -> None:
        """No more compute follows (the end of the backward, ``finish_grad_sync``): issue every
        stage still unissued, one round per stage in issue order, before anything is waited, so
        the last stages of the last reductions travel together instead of one wait at a time."""
        while self._staged:
            self._advance_staged()

    @staticmethod
    def _advance_one(kind: str, name: str, handle: StagedHandle) -> None:
        with profiling.span("stage." + kind, name, waiting_on=handle.current):
            handle.advance()

    # --------------------------------------------------------------- backward
    def _register_pre_backward(self, unit: FSDPUnit, output, in_pass: bool = True) -> None:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda _grads: self._pre_backward(unit, in_pass), mode="any")

    def _backward_plan(self) -> "_Plan":
        """The previous backward's order; at first, the reverse of the order in which forwards ended
        (a unit's backward begins when the gradient of its output arrives: an enclosing unit first)."""
        if self._bwd_plan is None:
            self._bwd_plan = self._last_bwd_plan or _Plan(self._fwd_ends[::-1])
            self._bwd_order = []
        return self._bwd_plan

    def _pre_backward(self, unit: Optional[FSDPUnit], in_pass: bool = True) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if unit is None or unit.state is UnitState.BACKWARD:
            return
        if not in_pass:  # the backward of a call outside a pass: gathered on demand, no plan recorded
            if unit is not self.root:
                self._count_gather(unit, "backward")
            self._enter_backward(unit)
            return
        depth = self.overlap.backward_prefetch
        if unit is self.root:  # the backward starts in the root: prefetch the first units of its plan
            self._enter_backward(unit)
            self._prefetch(self._backward_plan().first(depth))
            return
        self._count_gather(unit, "backward")
        plan = self._backward_plan()
        self._bwd_order.append(unit)
        self._gather_then_prefetch(unit, plan.after(unit, depth))
        self._enter_backward(unit)

    def _enter_backward(self, unit: FSDPUnit) -> None:
        if unit.state is UnitState.FORWARD:
            unit.transition(UnitState.BACKWARD)
        else:
            unit.begin_use(UnitState.BACKWARD)
        unit.begin_backward()
        profiling.mark("backward", "begin", unit.name)

    def on_grad(self, unit: FSDPUnit, param_index: int) -> None:
        if unit.state is not UnitState.BACKWARD or not unit.grads_pending:
            raise RuntimeError(
                f"parameter {unit.param_names[param_index]!r} of FSDP unit {unit.name} received a gradient "
                "outside that unit's backward: it was used outside any module call (read directly); use it "
                "through the module that holds it (that call's hooks gather and reduce the unit)")
        unit.storage.take_grad(param_index)
        if unit.mark_ready(param_index):
            if unit.weights_needed:
                self._reduce_grads(unit)  # its frozen weights may still pass the gradient on: released later
            else:
                self._post_backward(unit)

    def inputs_done(self, unit: FSDPUnit) -> None:
        """The gradients of a unit's inputs are computed (``_watch_inputs``): its weights are not used
        again in this backward. Its backward ends now if its own gradients are all in, else at the last."""
        if unit.state is not UnitState.BACKWARD:
            return
        unit.weights_needed = False
        if unit.all_grads_ready:
            self._post_backward(unit)

    def _post_backward(self, unit: FSDPUnit) -> None:
        """A unit's backward is over: its gradients reduced (unless they were already), its weights released."""
        if unit.grads_pending:
            self._reduce_grads(unit)
        profiling.mark("backward", "end", unit.name)
        unit.release()
        for hook in tuple(self.post_backward_hooks.values()):
            hook(unit.name)

    def _reduce_grads(self, unit: FSDPUnit) -> None:
        """Every gradient of the unit is in (a compute end): its reduction is issued, its flat gradient dropped."""
        unit.grads_pending = False
        self._advance_staged()
        storage = unit.storage
        if unit.num_trainable and unit.reduced_this_step and storage.step_stage_crosses_ranks:
            # Its once-per-step reduction ran already: adding this micro-batch to reduced gradients would count the
            # earlier micro-batches again (Megatron-Core's DDP refuses the same: "Cannot set grad twice").
            raise RuntimeError(
                f"FSDP unit {unit.name} received another micro-batch's gradients after this step's reduction of its "
                "gradients ran: run every micro-batch but the last under model.no_sync() (Megatron's schedule: "
                "config.no_sync_func), or defer the reductions to finish_grad_sync "
                "(Overlap(reduce_in_backward=False))")
        sync = self.sync_grads and self.overlap.reduce_in_backward
        if unit.num_trainable:
            if storage.levels.inner.keeps_full_grads:
                storage.accumulate_local()
                if sync:
                    self._reduce_step(unit)
            else:
                with_step = sync and storage.has_step_stage
                with profiling.span("reduce", unit.name):
                    handle = storage.reduce_microbatch(tag=unit.name, then_step=with_step)
                self._enqueue(unit, handle)
                unit.reduced_this_step |= with_step
        storage.end_grads()

    def _reduce_step(self, unit: FSDPUnit) -> None:
        with profiling.span("reduce", unit.name):
            handle = unit.storage.reduce_step(tag=unit.name)
        self._enqueue(unit, handle)
        unit.reduced_this_step = True

    def _enqueue(self, unit: FSDPUnit, handle: Handle) -> None:
        self._track_staged("reduce", unit, handle)
        self._reductions.append((unit.name, handle))
        limit = self.overlap.reductions_in_flight
        if limit is None:
            limit = 2 if _stages_left(handle) else 1
        while len(self._reductions) > limit:
            self._wait_oldest_reduction()

    def _wait_oldest_reduction(self) -> None:
        name, handle = self._reductions.popleft()
        with profiling.span("wait.reduce", name, waiting_on=handle):
            handle.wait()

    def _drain(self) -> None:
        while self._reductions:
            self._wait_oldest_reduction()

    def _end_of_backward(self) -> None:
        """Runs once after the whole backward pass: flush units whose params got no grad."""
        self._callback_queued = False
        for unit in self._order[::-1] + [u for u in self.units if u not in self._order]:
            if unit.state is UnitState.BACKWARD:
                self._post_backward(unit)
        self._release_all()
        if self.sync_grads and self.overlap.reduce_in_backward:
            self._reduce_unreduced()
        self._issue_every_stage()
        self._drain()
        if self._bwd_order:
            self._last_bwd_plan = _Plan(self._bwd_order)
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
        self._issue_every_stage()
        self._drain()
        for unit in self.units:  # a unit that got no gradient this step has a zero one
            unit.storage.ensure_grads()
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
            with profiling.span("install", unit.name):
                handle = unit.storage.install_main_weights(tag=unit.name, step=True)
            unit.set_pending(handle)
            self._track_staged("install", unit, handle)

    def zero_grads(self, set_to_none: bool = False) -> None:
        self._scaled_this_step = False
        for unit in self.units:
            unit.reduced_this_step = False  # nothing reduced is left to count twice
            unit.storage.zero_grads(set_to_none)

    def wait_weights(self) -> None:
        for unit in self.units:
            unit.wait_weights()

    def wait_all(self) -> None:
        """Nothing of this model in flight afterwards: reductions drained, install gathers landed."""
        self._drain()
        self.wait_weights()


class _InputsDone(torch.autograd.Function):
    """Identity on a unit's inputs; its backward, which runs once their gradients from the unit are summed
    and before those flow on, calls ``done`` (FSDP2's post-backward hook works the same way)."""

    @staticmethod
    def forward(ctx, done, *inputs):
        ctx.done = done
        ctx.set_materialize_grads(False)
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.done()
        return (None,) + grads


class _Plan:
    """An order of units to prefetch in: who comes first, who comes after a given unit."""

    __slots__ = ("units", "_position")

    def __init__(self, units: List[FSDPUnit]):
        self.units = list(units)
        self._position: Dict[int, int] = {}
        for k, unit in enumerate(self.units):
            self._position.setdefault(unit.index, k)

    def first(self, depth: int) -> List[FSDPUnit]:
        return self.units[:depth]

    def after(self, unit: FSDPUnit, depth: int) -> List[FSDPUnit]:
        k = self._position.get(unit.index)
        return [] if k is None or depth == 0 else self.units[k + 1:k + 1 + depth]


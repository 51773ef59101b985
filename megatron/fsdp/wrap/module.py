"""``FullyShardedModule``: the wrapped model a user calls, and the public methods on it.

``fully_shard`` (``build.py``) returns one. Its methods are the whole surface the optimizer,
the checkpoint code and the Megatron adapter use: forward and ``no_sync``, the step hooks
(``start_grad_sync``, ``finish_grad_sync``, ``install_updated_weights``), inspection (units,
ledger, overlap, gather statistics, ``memory_report``) and the state dicts, which delegate
to ``checkpoint/state_dict.py`` (DCP pieces) and ``full_state.py`` (full tensors).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from typing import Callable, Dict, List, Optional

import torch
from torch.utils._pytree import tree_map
from torch.utils.hooks import RemovableHandle

from ..checkpoint.state_dict import load_model_state_dict, model_state_dict
from ..collectives.comm import Ledger, collective
from ..sharding.experts import DENSE, Section
from ..checkpoint.full_state import broadcast_params, full_state_dict, load_full_state_dict
from ..precision.mixed_precision import MixedPrecision
from ..schedule.runtime import Overlap, Schedule
from ..sharding.strategy import MeshStrategy, ShardingStrategy
from ..schedule.unit import FSDPUnit


@dataclasses.dataclass(frozen=True)
class PersistentMemory:
    """Bytes this rank keeps between steps, by kind."""

    compute_weights: int
    main_weights: int
    main_grads: int
    optimizer_state: int = 0

    @property
    def total(self) -> int:
        return self.compute_weights + self.main_weights + self.main_grads + self.optimizer_state


@dataclasses.dataclass(frozen=True, repr=False)
class PersistentMemoryWithoutOptimizer(PersistentMemory):
    """``memory_report()`` called without the optimizer: its state is not counted, so ``optimizer_state``
    is 0 by omission, not because the optimizer keeps nothing; the repr says so."""

    note = "optimizer_state is 0: no optimizer was passed; memory_report(optimizer) counts its state"

    def __repr__(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"PersistentMemory({fields}) ({self.note})"


def _cast_inputs(mp: MixedPrecision, args, kwargs):
    """The root module's floating-point inputs in ``param_dtype`` (``cast_forward_inputs``); None: as they are."""
    if mp.param_dtype is None or not mp.cast_forward_inputs:
        return None
    cast = lambda t: t.to(mp.param_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    return tree_map(cast, args), tree_map(cast, kwargs)


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


def _check_conversion(units: List[FSDPUnit], fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Raise unless ``fn`` (what ``.to()``, ``.half()``, ``.float()``, ``.cuda()`` ... apply to every tensor)
    leaves each unit's parameters where and in the dtype they are sharded in: one it keeps, its compute
    dtype or (trainable ones) its main dtype. Probed on an empty tensor of each."""
    for unit in units:
        storage = unit.storage
        device = storage.full.device
        dtypes = [storage.compute_dtype] + ([storage.main_dtype] if storage.trainable_params else [])
        with torch.no_grad():
            applied = [fn(torch.empty(0, dtype=d, device=device)) for d in dtypes]
        moved = next((t.device for t in applied if t.device != device), None)
        if moved is not None:
            raise RuntimeError(
                f"a model wrapped by fully_shard cannot move its parameters from {device} to {moved} (.to(), .cuda(), "
                "...): its flat buffers, optimizer state and process groups stay where fully_shard built them; move "
                "the module before fully_shard, or build it on the meta device and pass "
                "fully_shard(..., meta_init=MetaInit(device=...))")
        if all(t.dtype != d for t, d in zip(applied, dtypes)):
            target = applied[0].dtype
            raise RuntimeError(
                f"a model wrapped by fully_shard cannot convert its parameters from {storage.compute_dtype} to {target} "
                "(.to(dtype), .half(), .bfloat16(), .float(), .double()): its flat buffers and optimizer state keep "
                f"the dtype they were sharded in; to compute in {target}, pass mixed_precision="
                f"MixedPrecision(param_dtype={target}) to fully_shard (or convert the module before fully_shard)")


def _guarded_apply(units: List[FSDPUnit], module: torch.nn.Module, fn, recurse: bool = True):
    """The wrapped root module's ``_apply`` (through which ``.to()``, ``.half()``, ``.float()``, ``.cuda()`` ... of
    the wrapper and of the module act): a call that would change where or in which dtype the parameters are
    sharded raises (``_check_conversion``); any other applies to the buffers as on the unwrapped module and
    leaves the parameters, views of the units' flat storage, as they are."""
    _check_conversion(units, fn)
    sharded = {id(p) for unit in units for p in unit.storage.params}
    hidden = []
    try:
        for m in module.modules():
            params = m.__dict__["_parameters"]
            if any(p is not None and id(p) in sharded for p in params.values()):
                hidden.append((m, params))
                m.__dict__["_parameters"] = {k: p for k, p in params.items() if p is None or id(p) not in sharded}
        return type(module)._apply(module, fn, recurse)
    finally:
        for m, params in hidden:
            m.__dict__["_parameters"] = params


class FullyShardedModule(torch.nn.Module):
    """The wrapped model: call it like the original; its parameters live in flat unit buffers."""

    def __init__(self, module: torch.nn.Module, runtime: Schedule, units: List[FSDPUnit],
                 sections: Dict[str, Section], mixed_precision: MixedPrecision):
        super().__init__()
        # "dense" always; "expert" when fully_shard got ``experts``: axes, levels, gradient rule of each
        # (the one place the axes are kept: ``sections["dense"].inner`` is the data-parallel group).
        self.sections = sections
        self.module = module
        self._runtime = runtime
        self._units = units
        levels = sections[DENSE].levels
        self.levels: MeshStrategy = levels
        self.strategy: ShardingStrategy = levels.inner
        self.mixed_precision = mixed_precision
        self._slot_of = {name: (unit, slot) for unit in units
                         for name, slot in zip(unit.param_names, unit.storage.layout.slots)}
        self._name_of = {id(p): name for unit in units for name, p in zip(unit.param_names, unit.storage.params)}
        # The pass opens and closes in the root module's own hooks, so every call of it is one:
        # ``model(...)``, ``model.module(...)``, and the module's own methods that call it
        # (``generate()``). Lambdas, not bound methods: a deepcopy of the module must not copy the wrapper.
        module.register_forward_pre_hook(
            lambda _m, args, kwargs: _cast_inputs(mixed_precision, args, kwargs) if runtime.enter_root_module() else None,
            prepend=True, with_kwargs=True)
        module.register_forward_hook(lambda _m, _a, out: runtime.leave_root_module(out), always_call=True)
        # ``.to()``, ``.half()``, ``.cuda()`` ... of the wrapper and of ``module``: a bound method, so a deepcopy of
        # the module binds its copy and shares ``units`` (the partial) instead of copying the wrapper.
        module._apply = types.MethodType(functools.partial(_guarded_apply, units), module)

    # ------------------------------------------------------------------ use
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)  # the pass: the root module's hooks (above)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the reduction happens on the first backward outside.

        Under ``optim_grads`` and ``optim_grads_params`` gradients are sharded, so
        they are still reduce-scattered every micro-batch; ``no_sync`` changes
        nothing there. If a step is taken while still inside, ``optimizer.step()``
        performs the pending reduction itself, so no gradient is ever skipped.
        """
        previous = self._runtime.sync_grads
        self._runtime.sync_grads = False
        try:
            yield
        finally:
            self._runtime.sync_grads = previous

    # ------------------------------------------------------------ inspection
    @property
    def units(self) -> List[FSDPUnit]:
        return list(self._units)

    @property
    def overlap(self) -> Overlap:
        """Prefetch depths and reductions in flight (``fully_shard``'s arguments)."""
        return self._runtime.overlap

    @property
    def ledger(self) -> Ledger:
        return self.sections[DENSE].inner.ledger

    @property
    def process_group(self):
        return self.sections[DENSE].inner.group

    @property
    def gather_stats(self) -> Dict[str, Dict[str, int]]:
        """Per phase, how many gathers were prefetched and how many waited on demand (since the wrap)."""
        return self._runtime.gather_stats

    @property
    def backwards_since_step(self) -> int:
        """Backward passes run since the last optimizer step (0: no gradient to step on)."""
        return self._runtime.backwards_since_step

    @property
    def root_unit(self) -> Optional[FSDPUnit]:
        """The unit of the parameters outside every unit module (None when there are none)."""
        return self._runtime.root

    def register_post_backward_hook(self, hook: Callable[[str], None]) -> RemovableHandle:
        """Call ``hook(unit_name)`` after each unit's backward, once its reduction is issued and its
        weights released; returns a handle whose ``remove()`` unregisters it.

        Why: a per-unit point in the backward for the caller's own policy, which the engine
        leaves alone: the training job returns the heap's freed activation pages to the OS
        there (``megatron/fsdp_training/allocator.py``), since a process-wide allocator setting is
        the job's decision, not the engine's.
        """
        handle = RemovableHandle(self._runtime.post_backward_hooks)
        self._runtime.post_backward_hooks[handle.id] = hook
        return handle

    def wait_weights(self) -> None:
        """Wait for every gather in flight (the install after a step, prefetches)."""
        self._runtime.wait_weights()

    def install_updated_weights(self) -> None:
        """After the optimizer updated the main weights: rebuild compute weights (gathers in flight)."""
        self._runtime.after_step()

    def zero_grad_buffers(self, set_to_none: bool = False) -> None:
        """Zero the flat gradient accumulators in place, or (``set_to_none``) release them until
        the next backward's first reduction allocates them zeroed."""
        self._runtime.zero_grads(set_to_none)

    def start_grad_sync(self) -> None:
        """Issue every once-per-step reduction not yet issued (no waiting)."""
        self._runtime.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Complete every gradient reduction of this step."""
        self._runtime.finish_grad_sync()

    def scale_gradients(self, factor: float) -> None:
        """Multiply the accumulated gradients by ``factor`` (e.g. 1 / number of tokens)."""
        for unit in self._units:
            if unit.storage.grads_allocated:  # a released accumulator holds zeros
                unit.storage.grad_accum.mul_(factor)

    def param_name(self, param: torch.nn.Parameter) -> str:
        """The name under which ``param`` is sharded (its first name in the module)."""
        return self._name_of[id(param)]

    @collective("broadcast_params")
    def broadcast_params(self) -> None:
        """Make replicas equal to rank 0 of every axis whose level keeps them replicated (a collective;
        ``full_state.py``)."""
        broadcast_params(self)

    def main_grad_piece(self, name: str) -> torch.Tensor:
        """This rank's piece of parameter ``name`` in the optimizer's gradient (flat; may be empty).

        Ranks with the same layout (e.g. tensor-parallel peers) get pieces that
        cover the same elements, so a collective over the pieces is elementwise.
        """
        unit, slot = self._slot_of[name]
        s = unit.storage
        a, b = s.regions.main
        lo, hi = max(a, slot.start), min(b, slot.end)
        return s.grad_slice(lo - a, hi - a) if lo < hi else s.grad_slice(0, 0)

    def main_weight_piece(self, name: str) -> torch.Tensor:
        """This rank's piece of parameter ``name`` in the fp32 main weights (as ``main_grad_piece``)."""
        unit, slot = self._slot_of[name]
        s = unit.storage
        a, b = s.regions.main
        lo, hi = max(a, slot.start), min(b, slot.end)
        return s.main[lo - a:hi - a] if lo < hi else s.main[0:0]

    def memory_report(self, optimizer=None) -> PersistentMemory:
        compute = main = grads = 0
        for unit in self._units:
            s = unit.storage
            compute += _nbytes(s.shard) if s.releases else _nbytes(s.full)
            main += 0 if s.shares_main else _nbytes(s.main)
            grads += _nbytes(s.grad_accum)
        buffers = {id(u.storage.gather_buffer): u.storage.gather_buffer for u in self._units
                   if u.storage.gather_buffer is not None}
        compute += sum(b.nbytes for b in buffers.values())  # persistent gather buffers (double_buffer)
        if optimizer is None:
            return PersistentMemoryWithoutOptimizer(compute, main, grads, 0)
        return PersistentMemory(compute, main, grads, optimizer.state_bytes())

    # ------------------------------------------------------------ state dict
    def state_dict(self, *args, **kwargs) -> Dict[str, object]:
        """This rank's pieces as DTensors of each parameter's global shape, ready for ``torch.distributed.checkpoint``.

        Layout-, level- and mesh-independent (see ``checkpoint/state_dict.py``); no
        collective; the values are copies. ``full_state_dict`` gives full tensors.
        """
        return model_state_dict(self)

    @collective("load_state_dict")
    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a ``state_dict()`` filled by ``dcp.load``: validates first, then rebuilds compute weights (a collective)."""
        return load_model_state_dict(self, state_dict, strict=strict)

    @collective("full_state_dict")
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Full, unsharded tensors by parameter name (main precision for trainable ones; ``full_state.py``).

        A collective on sharded levels: every rank must call it. Buffers of the
        module are included as they are.
        """
        return full_state_dict(self)

    @collective("load_full_state_dict")
    def load_full_state_dict(self, state_dict: Dict[str, torch.Tensor], strict: bool = True):
        """Load full tensors (as produced by ``full_state_dict``); every rank takes its own piece."""
        load_full_state_dict(self, state_dict, strict)

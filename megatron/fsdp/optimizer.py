"""``FullyShardedOptimizer``: any elementwise torch optimizer over the local fp32 shards.

The inner optimizer sees a few long flat tensors (one run per unit and weight
decay class), not one tensor per parameter, so its per-tensor overhead does not
grow with the parameter count. Gradient norm and clipping use the true global
norm: every gradient element is owned by exactly one rank of each axis whose
level shards optimizer state (or by every rank of an axis that does not, where
it is counted once) and is counted once.

One optimizer may drive several wrapped models that share a mesh (the model
chunks of virtual pipeline parallelism).
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .module import FullyShardedModule

Models = Union[FullyShardedModule, Sequence[FullyShardedModule]]


class FullyShardedOptimizer:
    """Wraps ``optimizer_cls`` over the main-weight shards of ``models``.

    ``counts_in_norm(name, param)`` says whether a parameter's gradient counts in the
    global norm on this rank (default: all); ``norm_groups`` are further
    process groups the squared norm is summed over (e.g. tensor and pipeline
    model parallel groups, whose ranks hold different parameters).
    """

    def __init__(self, models: Models, optimizer_cls: Callable = torch.optim.AdamW, clip_grad: float = 0.0,
                 no_weight_decay: Optional[Callable] = None, counts_in_norm: Optional[Callable] = None,
                 norm_groups: Sequence = (), **optimizer_kwargs):
        self.models: List[FullyShardedModule] = [models] if isinstance(models, FullyShardedModule) else list(models)
        if not self.models or not all(isinstance(m, FullyShardedModule) for m in self.models):
            raise TypeError("FullyShardedOptimizer needs the model(s) returned by megatron.fsdp.fully_shard")
        first = self.models[0]
        for m in self.models[1:]:
            if m.levels != first.levels or (m.inner_axis.size, m.outer_axis.size) != (first.inner_axis.size, first.outer_axis.size):
                raise ValueError("all models of one FullyShardedOptimizer must share the same mesh and levels")
        self.model = first
        self.clip_grad = float(clip_grad)
        self.norm_groups = [g for g in norm_groups if g is not None and dist.get_world_size(g) > 1]
        weight_decay = optimizer_kwargs.get("weight_decay", 0.0)
        groups = {False: [], True: []}
        self._grads: List[torch.Tensor] = []
        self._norm_grads: List[torch.Tensor] = []
        for model in self.models:
            for unit in model.units:
                s = unit.storage
                flags = [self._no_decay(no_weight_decay, slot.spec) for slot in s.layout.slots]
                lo, hi = s.regions.main
                for a, b, nwd in s.layout.runs(lo, hi, flags):
                    weight = s.main[a - lo:b - lo]
                    weight.grad = s.main_grad[a - lo:b - lo]
                    groups[nwd].append(weight)
                    self._grads.append(weight.grad)
                if counts_in_norm is not None:
                    for name, slot, param in zip(unit.param_names, s.layout.slots, s.params):
                        if slot.spec.trainable and counts_in_norm(name, param):
                            piece = model.main_grad_piece(name)
                            if piece.numel():
                                self._norm_grads.append(piece)
        if counts_in_norm is None:
            self._norm_grads = self._grads
        device = first.units[0].storage.full.device if first.units else torch.device("cpu")
        param_groups = []
        for nwd in (False, True):
            params = groups[nwd]
            if not params:  # keep the same groups on every rank, even one that owns nothing
                empty = torch.zeros(0, device=device)
                empty.grad = torch.zeros(0, device=device)
                params = [empty]
            param_groups.append({"params": params, "weight_decay": 0.0 if nwd else weight_decay})
        self.optimizer = optimizer_cls(param_groups, **optimizer_kwargs)

    @staticmethod
    def _no_decay(rule: Optional[Callable], spec) -> bool:
        """The decay class of one parameter; a custom rule sees a meta tensor of the true shape
        (a ZeRO-3 parameter is an empty placeholder between uses)."""
        if rule is None:
            return spec.no_weight_decay
        return bool(rule(spec.name, torch.nn.Parameter(torch.empty(spec.shape, device="meta"), spec.trainable)))

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_bytes(self) -> int:
        return sum(v.untyped_storage().nbytes() for st in self.optimizer.state.values()
                   for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)

    def grad_norm(self) -> float:
        """Global L2 norm of the averaged gradients (each element counted once)."""
        device = self._norm_grads[0].device if self._norm_grads else torch.device("cpu")
        sq = torch.zeros(1, dtype=torch.float32, device=device)
        if self._norm_grads:
            sq += torch.stack([g.float().pow(2).sum() for g in self._norm_grads]).sum()
        # Sum over the axes whose level shards optimizer state; replicas along the
        # other axes hold identical gradients and must not be counted twice.
        if self.model.levels.inner.shard_optim:
            self.model.inner_axis.all_reduce(sq, tag="grad_norm").wait()
        if self.model.levels.outer.shard_optim:
            self.model.outer_axis.all_reduce(sq, tag="grad_norm").wait()
        for group in self.norm_groups:
            dist.all_reduce(sq, group=group)
        return math.sqrt(float(sq.item()))

    def finish_grad_sync(self) -> None:
        """Complete every gradient reduction of this step; raise if no backward ran."""
        for model in self.models:
            if model._runtime.backwards_since_step == 0:
                raise RuntimeError("optimizer.step() called without a backward pass since the last step; "
                                   "run loss.backward() on the wrapped model first")
        for model in self.models:
            model._runtime.finish_grad_sync()

    def clip_grads(self, norm: float) -> None:
        if self.clip_grad > 0.0 and math.isfinite(norm):
            coef = self.clip_grad / (norm + 1.0e-6)
            if coef < 1.0:
                torch._foreach_mul_(self._grads, coef)

    @torch.no_grad()
    def step_with_ready_grads(self) -> None:
        """Update the shards and install the new weights (gathers overlap the next forward)."""
        self.optimizer.step()
        for model in self.models:
            model._runtime.after_step()

    @torch.no_grad()
    def step(self) -> float:
        """Finish gradient sync, clip, update the shards, install the new weights.

        Returns the global gradient norm before clipping.
        """
        self.finish_grad_sync()
        norm = self.grad_norm()
        self.clip_grads(norm)
        self.step_with_ready_grads()
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient accumulators (they are reused, never set to None)."""
        for model in self.models:
            model._runtime.zero_grads()

"""``FullyShardedOptimizer``: any elementwise torch optimizer over the local fp32 shards.

The inner optimizer sees a few long flat tensors (one run per unit and weight
decay class), not one tensor per parameter, so its per-tensor overhead does not
grow with the parameter count. Gradient norm and clipping use the true global
norm: every gradient element is owned by exactly one rank of the axis (or by
every rank, under ``no_shard``) and is counted once.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from .module import FullyShardedModule


class FullyShardedOptimizer:
    def __init__(self, model: FullyShardedModule, optimizer_cls: Callable = torch.optim.AdamW,
                 clip_grad: float = 0.0, no_weight_decay: Optional[Callable] = None, **optimizer_kwargs):
        if not isinstance(model, FullyShardedModule):
            raise TypeError("FullyShardedOptimizer needs the model returned by megatron.fsdp.fully_shard")
        self.model = model
        self.clip_grad = float(clip_grad)
        weight_decay = optimizer_kwargs.get("weight_decay", 0.0)
        groups = {False: [], True: []}
        self._grads = []
        for unit in model.units:
            s = unit.storage
            flags = [self._no_decay(no_weight_decay, slot.spec) for slot in s.layout.slots]
            lo, hi = s.regions.main
            for a, b, nwd in s.layout.runs(lo, hi, flags):
                weight = s.main[a - lo:b - lo]
                weight.grad = s.main_grad[a - lo:b - lo]
                groups[nwd].append(weight)
                self._grads.append(weight.grad)
        device = model.units[0].storage.full.device if model.units else torch.device("cpu")
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
        if self._grads:
            sq = torch.stack([g.float().pow(2).sum() for g in self._grads]).sum().reshape(1)
        else:
            sq = torch.zeros(1)
        # Sum over the axes whose level shards optimizer state; replicas along the
        # other axes hold identical gradients and must not be counted twice.
        if self.model.levels.inner.shard_optim:
            self.model.inner_axis.all_reduce(sq, tag="grad_norm").wait()
        if self.model.levels.outer.shard_optim:
            self.model.outer_axis.all_reduce(sq, tag="grad_norm").wait()
        return math.sqrt(float(sq.item()))

    @torch.no_grad()
    def step(self) -> float:
        """Finish gradient sync, clip, update the shards, install the new weights.

        Returns the global gradient norm before clipping.
        """
        runtime = self.model._runtime
        if runtime.backwards_since_step == 0:
            raise RuntimeError("optimizer.step() called without a backward pass since the last step; "
                               "run loss.backward() on the wrapped model first")
        runtime.finish_grad_sync()
        norm = self.grad_norm()
        if self.clip_grad > 0.0 and math.isfinite(norm):
            coef = self.clip_grad / (norm + 1.0e-6)
            if coef < 1.0:
                torch._foreach_mul_(self._grads, coef)
        self.optimizer.step()
        runtime.after_step()
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient accumulators (they are reused, never set to None)."""
        self.model._runtime.zero_grads()

"""Flat storage of one unit: compute weights, fp32 main weights, gradient accumulators.

Parameters are views into ``full`` (the unit's compute buffer), so collectives
read and write parameters in place. What exists per level (P = padded buffer,
S = one rank's shard, [a, b) = the trainable elements this rank updates):

=====================  ==============  ===================  ==============================
level                  compute         main weights         gradient accumulator
=====================  ==============  ===================  ==============================
no_shard               full P          [0, T)               full P, reduced once per step
optim                  full P          own slice [a, b)     full P, reduce-scattered once
optim_grads            full P          own slice [a, b)     shard [a, b), every micro-batch
optim_grads_params     shard S         own slice [a, b)     shard [a, b), every micro-batch
=====================  ==============  ===================  ==============================

When the compute dtype equals the main dtype (an fp32 model), main weights are
views into the compute storage: the optimizer updates the parameters in place
and no second copy exists.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .comm import CommAxis, Handle
from .layout import FlatLayout
from .strategy import ShardingStrategy


def _free(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def _alloc(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


class UnitStorage:
    def __init__(
        self,
        layout: FlatLayout,
        params: List[torch.nn.Parameter],
        strategy: ShardingStrategy,
        axis: CommAxis,
        compute_dtype: torch.dtype,
        main_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        device: torch.device,
    ):
        assert len(params) == len(layout.slots)
        self.layout, self.params, self.strategy, self.axis = layout, params, strategy, axis
        self.compute_dtype, self.main_dtype, self.reduce_dtype = compute_dtype, main_dtype, reduce_dtype
        self.shares_main = compute_dtype == main_dtype
        P, S = layout.padded_size, layout.shard_size
        self.lo, self.hi = layout.shard_range(axis.rank)
        if strategy.shard_optim:
            self.a, self.b = layout.owned_trainable(axis.rank)
        else:
            self.a, self.b = 0, layout.trainable_end

        originals = [p.detach() for p in params]
        self.trainable_params = [(i, p) for i, p in enumerate(params) if layout.slots[i].spec.trainable]
        self.full = torch.zeros(P, dtype=compute_dtype, device=device)
        self.views = [self.full[s.start:s.end].view(s.spec.shape) for s in layout.slots]
        # ``full.data`` has its own version counter: gathers write through it so
        # autograd never sees the refill of a released buffer as an in-place edit.
        self._full_io = self.full.data
        self.shard: Optional[torch.Tensor] = None
        if strategy.shard_params:
            self.shard = torch.zeros(S, dtype=compute_dtype, device=device)
            for piece in layout.pieces(axis.rank):
                src = originals[piece.slot_index].reshape(-1)
                self.shard[piece.shard_offset:piece.shard_offset + piece.length].copy_(
                    src[piece.param_offset:piece.param_offset + piece.length])
        else:
            for view, src in zip(self.views, originals):
                view.copy_(src)

        # Main weights over [a, b): a view of the compute storage, or its own fp32 copy.
        if self.shares_main:
            self.main = self._compute_slice(self.a, self.b)
        else:
            self.main = torch.zeros(self.b - self.a, dtype=main_dtype, device=device)
            for slot, src in zip(layout.slots, originals):
                a, b = max(slot.start, self.a), min(slot.end, self.b)
                if a < b:
                    self.main[a - self.a:b - self.a].copy_(src.reshape(-1)[a - slot.start:b - slot.start])

        # Gradient accumulator in main dtype.
        if strategy.keeps_full_grads:
            self.grad_accum = torch.zeros(P, dtype=main_dtype, device=device)
            self.main_grad = self.grad_accum[self.a:self.b]
        else:
            self.grad_accum = torch.zeros(self.b - self.a, dtype=main_dtype, device=device)
            self.main_grad = self.grad_accum
        # Autograd accumulates straight into the persistent accumulator when dtypes
        # allow; otherwise into a transient per-micro-batch buffer in compute dtype.
        self.grads_in_place = strategy.keeps_full_grads and compute_dtype == main_dtype
        self.grad_full: Optional[torch.Tensor] = None
        self.grad_views: Optional[List[torch.Tensor]] = None
        if self.grads_in_place:
            self.grad_full = self.grad_accum
            self.grad_views = self._views_of(self.grad_accum)
        self.resident = not strategy.shard_params
        if strategy.shard_params:
            _free(self.full)
            self._detach_params()
        else:
            self._attach_params()

    # ----------------------------------------------------------------- helpers
    def _views_of(self, flat: torch.Tensor) -> List[torch.Tensor]:
        return [flat[s.start:s.end].view(s.spec.shape) for s in self.layout.slots]

    def _compute_slice(self, a: int, b: int) -> torch.Tensor:
        """Compute storage of buffer range [a, b) that lives on this rank permanently."""
        if self.shard is not None:
            return self.shard[a - self.lo:b - self.lo]
        return self.full[a:b]

    def _attach_params(self) -> None:
        for p, view in zip(self.params, self.views):
            p.data = view

    def _detach_params(self) -> None:
        # A released parameter is an empty tensor, never a view of freed memory:
        # reading it outside forward/backward gives an empty result, not a crash.
        empty = torch.empty(0, dtype=self.compute_dtype, device=self.full.device)
        for p in self.params:
            p.data = empty

    # ----------------------------------------------------------- parameters
    def unshard(self, tag: str) -> Handle:
        """Materialise the full compute weights (ZeRO-3: all-gather the shards)."""
        if self.resident:
            return Handle()
        _alloc(self.full)
        self.resident = True
        return Handle(self.axis.all_gather(self._full_io, self.shard, tag), then=self._attach_params)

    def reshard(self) -> None:
        """Release the full compute weights (ZeRO-3 only; other levels keep them)."""
        if not self.strategy.shard_params or not self.resident:
            return
        self._detach_params()
        _free(self.full)
        self.resident = False

    def install_main_weights(self, tag: str) -> Handle:
        """Copy updated main weights into compute weights; gather them where needed."""
        if not self.shares_main:
            self._compute_slice(self.a, self.b).copy_(self.main)
        if self.strategy.shard_optim and not self.strategy.shard_params:
            return self.axis.all_gather(self._full_io, self._full_io[self.lo:self.hi], tag)
        return Handle()

    # ------------------------------------------------------------- gradients
    def begin_grads(self) -> None:
        """Point every trainable ``param.grad`` at this micro-batch's flat gradient."""
        if not self.trainable_params:
            return
        if not self.grads_in_place and self.grad_full is None:
            self.grad_full = torch.zeros(self.layout.padded_size, dtype=self.compute_dtype, device=self.full.device)
            self.grad_views = self._views_of(self.grad_full)
        for i, p in self.trainable_params:
            p.grad = self.grad_views[i]

    def end_grads(self) -> None:
        """Drop the transient gradient (its content has been reduced or accumulated)."""
        if self.grads_in_place:
            return
        for _, p in self.trainable_params:
            p.grad = None
        self.grad_full = None
        self.grad_views = None

    def _scaled(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.axis.size == 1 else tensor.mul_(1.0 / self.axis.size)

    def accumulate_local(self) -> None:
        """Full-grad levels with a transient buffer: add this micro-batch into the accumulator."""
        if not self.grads_in_place and self.grad_full is not None:
            self.grad_accum.add_(self.grad_full)

    def reduce_full(self, tag: str) -> Handle:
        """no_shard / optim: average the accumulated full gradient over the axis, once per step."""
        accum = self.grad_accum
        if self.axis.size == 1:
            return Handle()
        wire = accum if accum.dtype == self.reduce_dtype else accum.to(self.reduce_dtype)
        if not self.strategy.shard_optim:
            def done():
                if wire is not accum:
                    accum.copy_(wire)
                self._scaled(accum)
            return Handle(self.axis.all_reduce(wire, tag), then=done)
        out = torch.empty(self.layout.shard_size, dtype=self.reduce_dtype, device=accum.device)

        def done_scatter():
            self.main_grad.copy_(self._scaled(out[: self.b - self.a]))
        return Handle(self.axis.reduce_scatter(out, wire, tag), then=done_scatter, keep=(wire,))

    def reduce_scatter_microbatch(self, tag: str) -> Handle:
        """optim_grads / optim_grads_params: reduce-scatter this micro-batch into the shard accumulator."""
        grad = self.grad_full
        n = self.b - self.a
        if self.axis.size == 1:
            self.grad_accum.add_(grad[self.a:self.b])
            return Handle()
        wire = grad if grad.dtype == self.reduce_dtype else grad.to(self.reduce_dtype)
        out = torch.empty(self.layout.shard_size, dtype=self.reduce_dtype, device=grad.device)

        def done():
            self.grad_accum.add_(self._scaled(out[:n]))
        return Handle(self.axis.reduce_scatter(out, wire, tag), then=done, keep=(wire,))

    def zero_grads(self) -> None:
        self.grad_accum.zero_()

"""Flat storage of one unit on a two-axis mesh, and the data movement on it.

Parameters are views into ``full`` (the unit's compute buffer), so collectives
read and write parameters in place. ``regions.py`` decides which buffer range
each kind of state covers on this rank; this module owns the tensors and the
collectives that move data between the ranges:

* gather (ZeRO-3): compute piece --outer all-gather--> inner shard --inner all-gather--> full;
* reduce: full gradient --inner reduce-scatter or all-reduce--> inner shard
  --outer reduce-scatter or all-reduce--> piece. Stages whose level shards
  gradients run every micro-batch; the others run once per step;
* install (after the optimizer step): main weights --cast--> compute storage,
  then the gathers that rebuild persistent compute weights from the shards the
  optimizer updated.

When the compute dtype equals the main dtype (an fp32 model), main weights are
views into the compute storage: the optimizer updates the parameters in place
and no second copy exists.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch

from .comm import CommAxis, Handle
from .layout import FlatLayout
from .regions import UnitRegions, unit_regions
from .strategy import MeshStrategy


def _free(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def _alloc(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def chain(first: Handle, *stages: Callable[[], Handle]) -> Handle:
    """Run ``stages`` one after another once ``first`` has landed (each needs the previous result)."""
    if not stages:
        return first

    def rest():
        for stage in stages:
            stage().wait()
    return Handle(first, then=rest)


class UnitStorage:
    def __init__(self, layout: FlatLayout, params: List[torch.nn.Parameter], levels: MeshStrategy,
                 inner: CommAxis, outer: CommAxis, compute_dtype: torch.dtype, main_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, device: torch.device, average_grads: bool = True,
                 section: str = "dense", grad_scale: float = 1.0):
        assert len(params) == len(layout.slots)
        self.layout, self.params, self.levels = layout, params, levels
        self.inner, self.outer = inner, outer
        self.compute_dtype, self.main_dtype, self.reduce_dtype = compute_dtype, main_dtype, reduce_dtype
        self.average_grads = average_grads
        self.section = section          # "dense" or "expert": which mesh and norm groups it belongs to
        self.grad_scale = grad_scale    # applied once per step after the reductions (experts.py)
        self.shares_main = compute_dtype == main_dtype
        self.regions: UnitRegions = unit_regions(layout, levels, inner.rank, outer.rank, outer.size)
        R = self.regions
        originals = [p.detach() for p in params]
        self.trainable_params = [(i, p) for i, p in enumerate(params) if layout.slots[i].spec.trainable]

        self.full = torch.zeros(layout.padded_size, dtype=compute_dtype, device=device)
        self.views = self._views_of(self.full)
        # ``full.data`` has its own version counter: gathers write through it so
        # autograd never sees the refill of a released buffer as an in-place edit.
        self._full_io = self.full.data
        # Persistent compute weights: the full buffer, or (ZeRO-3, where the full
        # buffer is released between uses) a shard of it. On a mesh of one rank the
        # shard is the whole buffer: keep it resident and never gather or release.
        self.releases = levels.inner.shard_params and (inner.size > 1 or outer.size > 1)
        self.shard: Optional[torch.Tensor] = None
        if self.releases:
            self.shard = torch.zeros(R.size(R.compute), dtype=compute_dtype, device=device)
            for piece in layout.pieces_in(*R.compute):
                src = originals[piece.slot_index].reshape(-1)
                self.shard[piece.shard_offset:piece.shard_offset + piece.length].copy_(
                    src[piece.param_offset:piece.param_offset + piece.length])
        else:
            for view, src in zip(self.views, originals):
                view.copy_(src)

        a, b = R.main
        if self.shares_main:
            self.main = self._compute_slice(a, b)
        else:
            self.main = torch.zeros(b - a, dtype=main_dtype, device=device)
            for piece in layout.pieces_in(a, b):
                src = originals[piece.slot_index].reshape(-1)
                self.main[piece.shard_offset:piece.shard_offset + piece.length].copy_(
                    src[piece.param_offset:piece.param_offset + piece.length])

        accum_size = R.size(R.accum) if self.trainable_params else 0
        self.grad_accum = torch.zeros(accum_size, dtype=main_dtype, device=device)
        self.main_grad = self.grad_accum[a - R.accum[0]:b - R.accum[0]] if self.trainable_params else self.grad_accum
        # Autograd accumulates straight into the persistent accumulator when it is
        # the full buffer in compute dtype; otherwise into a transient buffer.
        self.grads_in_place = levels.inner.keeps_full_grads and compute_dtype == main_dtype
        self.grad_full: Optional[torch.Tensor] = None
        self.grad_views: Optional[List[torch.Tensor]] = None
        if self.grads_in_place and self.trainable_params:
            self.grad_full = self.grad_accum
            self.grad_views = self._views_of(self.grad_accum)
        self.resident = not self.releases
        if self.releases:
            _free(self.full)
            self._detach_params()
        else:
            self._attach_params()

    # ----------------------------------------------------------------- helpers
    @property
    def has_step_stage(self) -> bool:
        """Some reduction runs once per step (not every micro-batch)."""
        return self.levels.inner.keeps_full_grads or not self.levels.outer.shard_grads

    def _views_of(self, flat: torch.Tensor) -> List[torch.Tensor]:
        return [flat[s.start:s.end].view(s.spec.shape) for s in self.layout.slots]

    def _compute_slice(self, a: int, b: int) -> torch.Tensor:
        """Persistent compute storage of buffer range [a, b)."""
        if self.shard is None:
            return self.full[a:b]
        lo = self.regions.compute[0]
        return self.shard[a - lo:b - lo]

    def _attach_params(self) -> None:
        for p, view in zip(self.params, self.views):
            p.data = view

    def _detach_params(self) -> None:
        # A released parameter is an empty tensor, never a view of freed memory:
        # reading it outside forward/backward gives an empty result, not a crash.
        empty = torch.empty(0, dtype=self.compute_dtype, device=self.full.device)
        for p in self.params:
            p.data = empty

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.dtype == self.reduce_dtype else tensor.to(self.reduce_dtype)

    def _scale(self, tensor: torch.Tensor, axis: CommAxis) -> torch.Tensor:
        """Turn a sum over ``axis`` into a mean (unless gradients are to be summed)."""
        return tensor if axis.size == 1 or not self.average_grads else tensor.mul_(1.0 / axis.size)

    # ----------------------------------------------------------- parameters
    def unshard(self, tag: str) -> Handle:
        """ZeRO-3: materialise the full compute weights from the persistent shard."""
        if self.resident:
            return Handle()
        _alloc(self.full)
        self.resident = True
        lo, hi = self.regions.inner
        io = self._full_io
        if self.levels.outer.shard_params:
            first = self.outer.all_gather(io[lo:hi], self.shard, tag)
            return chain(first, lambda: Handle(self.inner.all_gather(io, io[lo:hi], tag), then=self._attach_params))
        return Handle(self.inner.all_gather(io, self.shard, tag), then=self._attach_params)

    def reshard(self) -> None:
        """Release the full compute weights (ZeRO-3 only; other levels keep them)."""
        if not self.releases or not self.resident:
            return
        self._detach_params()
        _free(self.full)
        self.resident = False

    def install_main_weights(self, tag: str) -> Handle:
        """Copy updated main weights into compute weights and rebuild what is persistent."""
        a, b = self.regions.main
        if not self.shares_main:
            self._compute_slice(a, b).copy_(self.main)
        stages = []
        lo, hi = self.regions.inner
        plo, phi = self.regions.piece
        if self.levels.outer.shard_optim and not self.levels.outer.shard_params:
            target = self._compute_slice(lo, hi).data
            stages.append(lambda: self.outer.all_gather(target, target[plo - lo:phi - lo], tag))
        if self.levels.inner.shard_optim and not self.levels.inner.shard_params:
            io = self._full_io
            stages.append(lambda: self.inner.all_gather(io, io[lo:hi], tag))
        if not stages:
            return Handle()
        return chain(stages[0](), *stages[1:])

    # ------------------------------------------------------------- gradients
    def begin_grads(self) -> None:
        """Point every trainable ``param.grad`` at this micro-batch's flat gradient."""
        if not self.trainable_params:
            return
        if self.grad_full is None:
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

    def accumulate_local(self) -> None:
        """Full-grad inner levels with a transient buffer: add this micro-batch into the accumulator."""
        if not self.grads_in_place and self.grad_full is not None:
            self.grad_accum.add_(self.grad_full)

    def reduce_microbatch(self, tag: str, then_step: bool) -> Handle:
        """Grad-sharded inner levels: reduce this micro-batch's full gradient into the accumulator.

        Inner reduce-scatter always; outer reduce-scatter too when the outer level
        shards grads. ``then_step`` chains the once-per-step stage behind it.
        """
        R = self.regions
        lo, hi = R.inner
        plo, phi = R.piece
        step = [lambda: self.reduce_step(tag)] if then_step else []
        if self.inner.size == 1 and self.outer.size == 1:
            self.grad_accum.add_(self.grad_full[R.accum[0]:R.accum[1]])
            return chain(Handle(), *step)
        wire = self._wire(self.grad_full)
        inner_out = wire[lo:hi] if self.inner.size == 1 else torch.empty(hi - lo, dtype=wire.dtype, device=wire.device)
        first = self.inner.reduce_scatter(inner_out, wire, tag) if self.inner.size > 1 else Handle()
        if not self.levels.outer.shard_grads:
            def add_inner():
                self.grad_accum.add_(self._scale(inner_out, self.inner))
            return chain(Handle(first, then=add_inner, keep=(wire,)), *step)
        piece_out = torch.empty(phi - plo, dtype=wire.dtype, device=wire.device)

        def outer_stage() -> Handle:
            def add_piece():
                self.grad_accum.add_(self._scale(self._scale(piece_out, self.inner), self.outer))
            return Handle(self.outer.reduce_scatter(piece_out, inner_out, tag), then=add_piece, keep=(inner_out,))
        return chain(Handle(first, keep=(wire,)), outer_stage, *step)

    def reduce_step(self, tag: str) -> Handle:
        """The once-per-step stages: whatever the levels did not reduce every micro-batch."""
        if not self.trainable_params:
            return Handle()
        stages = []
        R = self.regions
        accum = self.grad_accum
        base = R.accum[0]
        if self.levels.inner.keeps_full_grads:
            stages.append(lambda: self._reduce_region(accum, self.inner, (0, accum.numel()),
                                                      R.inner if self.levels.inner.shard_optim else None, tag))
        if not self.levels.outer.shard_grads:
            region = (R.inner[0] - base, R.inner[1] - base)
            piece = (R.piece[0] - base, R.piece[1] - base) if self.levels.outer.shard_optim else None
            stages.append(lambda: self._reduce_region(accum, self.outer, region, piece, tag))
        return chain(stages[0](), *stages[1:])

    def _reduce_region(self, accum: torch.Tensor, axis: CommAxis, region, piece, tag: str) -> Handle:
        """Average ``accum[region]`` over ``axis``: all-reduce it, or reduce-scatter it into ``accum[piece]``."""
        if axis.size == 1:
            return Handle()
        src = accum[region[0]:region[1]]
        wire = self._wire(src)
        if piece is None:
            def done_all():
                if wire is not src:
                    src.copy_(wire)
                self._scale(src, axis)
            return Handle(axis.all_reduce(wire, tag), then=done_all, keep=(wire,))
        out = torch.empty(piece[1] - piece[0], dtype=wire.dtype, device=wire.device)

        def done_scatter():
            accum[piece[0]:piece[1]].copy_(self._scale(out, axis))
        return Handle(axis.reduce_scatter(out, wire, tag), then=done_scatter, keep=(wire,))

    def zero_grads(self) -> None:
        self.grad_accum.zero_()

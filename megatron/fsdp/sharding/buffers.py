"""Flat storage of one unit on a two-axis mesh, and the data movement on it.

Parameters are views into ``full`` (the unit's compute buffer), so collectives
read and write parameters in place. ``regions.py`` decides which buffer range
each kind of state covers on this rank; this module owns the tensors and the
collectives that move data between the ranges:

* gather (ZeRO-3): compute piece --outer all-gather--> inner shard --inner all-gather--> full.
  Under mixed precision the compute piece is not kept between uses: each gather
  casts this rank's main shard into its own slice of ``full`` (1/N of the unit,
  as FSDP2 does) and gathers in place, so persistent memory is main weights,
  gradients and optimizer state only. Frozen parameters, which have no main
  weights, keep their compute-dtype piece. Exception: an outer level that shards
  optimizer state but not parameters (HFSDP) keeps the inner compute shard, so a
  gather never needs the outer axis (the outer all-gather runs once per step);
* reduce: full gradient --inner reduce-scatter or all-reduce--> inner shard
  --outer reduce-scatter or all-reduce--> piece. Stages whose level shards
  gradients run every micro-batch; the others run once per step. The accumulator
  holds no frozen parameter's range (``regions.py``): a reduce-scatter that needs
  it reads zeros there;
* install (after the optimizer step): main weights --cast--> compute storage,
  then the gathers that rebuild persistent compute weights from the shards the
  optimizer updated.

When the compute dtype equals the main dtype (an fp32 model), main weights are
views into the compute storage: the optimizer updates the parameters in place
and no second copy exists.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Dict, List, Optional, Sequence

import torch

from ..collectives.comm import CommAxis, Handle, staged
from ..precision.mixed_precision import UnitDtypes
from ..precision.param_gather import QuantizedParamGather
from .experts import Section
from .layout import FlatLayout
from .quantized_gather import QuantizedGather
from .regions import UnitRegions, trainable_part, unit_regions


def _free(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def _alloc(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def _freed(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``numel`` elements whose storage is released (``_alloc`` brings it back)."""
    tensor = torch.empty(numel, dtype=dtype, device=device)  # pages never touched: not resident
    _free(tensor)
    return tensor


@contextlib.contextmanager
def _addressable(tensor: torch.Tensor):
    """Let views of a released ``tensor`` be taken (torch checks a view against its storage's size).

    The storage is re-allocated uninitialised for the duration and released again; views
    taken inside stay valid for every later allocation of the same storage (they point into
    the storage, not at its memory) and must not be read while it is released.
    """
    released = tensor.untyped_storage().nbytes() == 0 and tensor.numel() > 0
    if released:
        _alloc(tensor)
    try:
        yield tensor
    finally:
        if released:
            _free(tensor)


class Residency(enum.Enum):
    """Where a unit's compute weights are: the one source of truth for ZeRO-3 residency.

    Levels that do not shard parameters (and a mesh of one rank) are always ``FULL``.
    """

    SHARDED = "sharded"      # ZeRO-3 between uses: only the shard; full buffer freed, parameters empty
    GATHERING = "gathering"  # full buffer allocated, its all-gather in flight; parameters still empty
    FULL = "full"            # full weights in place, parameters are views of them


class UnitStorage:
    """``section``: the mesh axes, levels and gradient rule of the unit's section (``experts.py``);
    ``dtypes``: its compute, main and reduce dtypes; ``param_gather`` gathers the layout slots
    ``quantized`` in FP8."""

    def __init__(self, layout: FlatLayout, params: List[torch.nn.Parameter], section: Section, dtypes: UnitDtypes,
                 device: torch.device, param_gather: Optional[QuantizedParamGather] = None,
                 quantized: Sequence[int] = ()):
        assert len(params) == len(layout.slots)
        levels, inner, outer = section.levels, section.inner, section.outer
        compute_dtype, main_dtype = dtypes.compute, dtypes.main
        self.layout, self.params, self.levels = layout, params, levels
        self.inner, self.outer = inner, outer
        self.compute_dtype, self.main_dtype, self.reduce_dtype = compute_dtype, main_dtype, dtypes.reduce
        self.average_grads = section.average_grads
        self.section = section.name     # "dense" or "expert": which mesh and norm groups it belongs to
        self.grad_scale = section.grad_scale  # applied once per step after the reductions (experts.py)
        # FP8 gathers (``param_gather``, the layout slots ``quantized``) write dequantized weights into the
        # compute buffer: the main weights must be a copy of their own, also for an fp32 model.
        quantizes = param_gather is not None and len(quantized) > 0
        self.shares_main = compute_dtype == main_dtype and not quantizes
        self.regions: UnitRegions = unit_regions(layout, levels, inner.rank, outer.rank, outer.size)
        regions = self.regions
        self.trainable_params = [(i, p) for i, p in enumerate(params) if layout.slots[i].spec.trainable]

        # Persistent compute weights: the full buffer, or (ZeRO-3, where the full
        # buffer is released between uses) a shard of it. On a mesh of one rank the
        # shard is the whole buffer: keep it resident and never gather or release.
        self.releases = levels.inner.shard_params and (inner.size > 1 or outer.size > 1)
        self.full = (torch.empty if self.releases else torch.zeros)(layout.padded_size, dtype=compute_dtype,
                                                                     device=device)
        self.views = self._views_of(self.full)
        if self.releases:  # released untouched (each gather allocates it): never resident at build time
            _free(self.full)
        # ``full.data`` has its own version counter: gathers write through it so
        # autograd never sees the refill of a released buffer as an in-place edit.
        self._full_out = self.full.data
        # ZeRO-3 under mixed precision where the main shard covers the trainable part of
        # the compute range: gathers cast main weights; only frozen elements keep a shard.
        self.casts_main = (self.releases and not self.shares_main
                           and regions.main == trainable_part(regions.compute, layout.trainable_end))
        # ZeRO-3 keeps compute-dtype weights only for frozen parameters when gathers cast (or quantize) main weights.
        self._frozen_only_kept = self.casts_main or quantizes
        self.kept = self._kept_range() if self.releases else (0, layout.padded_size)
        self.shard: Optional[torch.Tensor] = None
        if self.releases:
            self.shard = torch.zeros(regions.size(self.kept), dtype=compute_dtype, device=device)
        a, b = regions.main
        if self.shares_main:
            self.main = self.compute_slice(a, b)
        else:
            self.main = torch.zeros(b - a, dtype=main_dtype, device=device)

        accum_size = regions.size(regions.accum) if self.trainable_params else 0
        # Allocated at the first reduction into it, freed by ``zero_grads(set_to_none=True)``.
        self._bind_grads(_freed(accum_size, main_dtype, device))
        self.residency = Residency.SHARDED if self.releases else Residency.FULL
        self.gather_buffer = None  # a persistent buffer for ``full`` (gather_buffers.py), or per-gather allocation
        self._gather_name = ""
        # A parameter on the meta device gets its value later, one at a time (``adopt``, meta_init.py).
        self._pieces: Optional[List[list]] = None  # adopt's pieces per slot
        for index, param in enumerate(params):
            if not param.is_meta:
                self.adopt(index, param.detach())
        # The FP8 gather; its first quantization is an install, issued by ``fully_shard`` (a collective).
        self.fp8: Optional[QuantizedGather] = QuantizedGather(self, param_gather, quantized) if quantizes else None

    def adopt(self, index: int, value: torch.Tensor) -> None:
        """Copy ``value`` (parameter ``index``'s full value) into the persistent storage that holds it on this
        rank, then make the parameter what the level keeps between uses: a view of ``full``, or (ZeRO-3) empty.

        One parameter at a time, so a meta-device build holds one submodule's parameters beside the shards
        instead of a whole unit (``init/meta_init.py``)."""
        if self._pieces is None:  # ("shard" or "main", piece) of every slot, found once
            self._pieces = [[] for _ in self.layout.slots]
            kept = self.layout.pieces_in(*self.kept) if self.shard is not None else ()
            main = self.layout.pieces_in(*self.regions.main) if not self.shares_main else ()
            for target, pieces in (("shard", kept), ("main", main)):
                for piece in pieces:
                    self._pieces[piece.slot_index].append((target, piece))
        flat = value.reshape(-1)
        for target, piece in self._pieces[index]:
            getattr(self, target)[piece.shard_offset:piece.shard_offset + piece.length].copy_(
                flat[piece.param_offset:piece.param_offset + piece.length])
        param = self.params[index]
        if self.releases:
            param.data = torch.empty(0, dtype=self.compute_dtype, device=self.full.device)
        else:
            self.views[index].copy_(value.view(self.layout.slots[index].spec.shape))
            param.data = self.views[index]

    def use_gather_buffer(self, buffer, name: str) -> None:
        """Gather into ``buffer`` (a ``GatherBuffer``) from now on instead of allocating per gather.

        Called once, while the unit is sharded: ``full`` and the parameter views become views
        of the buffer, at the address every later gather of this unit reuses.
        """
        if not self.releases or self.residency is not Residency.SHARDED:
            raise RuntimeError("a gather buffer is for a ZeRO-3 unit between uses")
        self.gather_buffer, self._gather_name = buffer, name
        self.full = buffer.view(self.layout.padded_size)
        self._full_out = self.full.data
        self.views = self._views_of(self.full)

    def _bind_grads(self, accum: torch.Tensor) -> None:
        """Make ``accum`` the gradient accumulator, ``main_grad`` its optimizer range, and decide
        where autograd writes: straight into the accumulator when it is the full buffer in
        compute dtype, otherwise into a transient buffer per backward."""
        regions = self.regions
        a, b = regions.main
        self.grad_accum = accum
        self.grads_in_place = self.levels.inner.keeps_full_grads and self.compute_dtype == accum.dtype
        self.grad_full: Optional[torch.Tensor] = None
        self.grad_views: Optional[List[torch.Tensor]] = None
        self._unwritten: Optional[Dict[int, torch.nn.Parameter]] = None  # begin_grads..finish_grads
        self._trainable_indices = {i for i, _ in self.trainable_params}
        with _addressable(accum):
            self.main_grad = accum[a - regions.accum[0]:b - regions.accum[0]] if self.trainable_params else accum
            if self.grads_in_place and self.trainable_params:
                self.grad_full = accum
                self.grad_views = self._grad_views_of(accum)

    def set_main_grads_dtype(self, dtype: torch.dtype) -> None:
        """Keep the gradient accumulator in ``dtype`` (e.g. bf16 main grads); its values are kept (cast)."""
        if dtype == self.grad_accum.dtype:
            return
        if self.grad_full is not None and not self.grads_in_place:
            raise RuntimeError("the gradient dtype cannot change during a backward pass")
        for _, p in self.trainable_params:
            p.grad = None
        accum = self.grad_accum
        self._bind_grads(accum.to(dtype) if self.grads_allocated
                         else _freed(accum.numel(), dtype, accum.device))

    # ------------------------------------------------------ gradient lifetime
    # The accumulator exists from the first gradient reduced (or written) into it until
    # ``zero_grads(set_to_none=True)`` after the optimizer step, as FSDP2's sharded
    # gradients and torch optimizers' ``zero_grad()`` do: between steps a rank keeps
    # main weights and optimizer state only. A released accumulator reads as zeros: it is
    # allocated zeroed, so accumulation over micro-batches and the reduction arithmetic
    # are those of an accumulator zeroed in place.
    @property
    def grads_allocated(self) -> bool:
        return self.grad_accum.numel() == 0 or self.grad_accum.untyped_storage().nbytes() > 0

    def ensure_grads(self) -> torch.Tensor:
        """The accumulator, allocated and zeroed if it was released; returns it."""
        accum = self.grad_accum
        if not self.grads_allocated:
            _alloc(accum)
            accum.zero_()
        return accum

    def _accumulator_as_output(self) -> Optional[torch.Tensor]:
        """The released accumulator, allocated, when the inner reduction would be its first
        write and covers it whole (one-axis sharded gradients): the reduce-scatter then lands
        in it directly, with no output buffer beside it and no copy."""
        accum = self.grad_accum
        if (self.grads_allocated or self.levels.outer.shard_grads or accum.dtype != self.reduce_dtype
                or tuple(self.regions.accum) != tuple(self.regions.inner)):
            return None
        _alloc(accum)
        return accum

    def _accumulate(self, grads: torch.Tensor) -> None:
        """Add ``grads`` into the accumulator; the first one after a release is written, not
        added to a zero-filled buffer (the same values; the accumulator is never zero-filled)."""
        accum = self.grad_accum
        if self.grads_allocated:
            accum.add_(grads)
        else:
            _alloc(accum)
            accum.copy_(grads)

    def grad_slice(self, lo: int, hi: int) -> torch.Tensor:
        """A view of ``main_grad[lo:hi]``, valid whenever the accumulator is allocated
        (it may be taken while it is released)."""
        with _addressable(self.grad_accum):
            return self.main_grad[lo:hi]

    # ----------------------------------------------------------------- helpers
    @property
    def has_step_stage(self) -> bool:
        """Some reduction runs once per step (not every micro-batch)."""
        return self.levels.inner.keeps_full_grads or not self.levels.outer.shard_grads

    @property
    def step_stage_crosses_ranks(self) -> bool:
        """The once-per-step stage moves data between ranks: a micro-batch added after it ran would be
        averaged with the others' already-reduced sum, counting them twice (on one-rank axes it is a no-op)."""
        return (self.levels.inner.keeps_full_grads and self.inner.size > 1
                or not self.levels.outer.shard_grads and self.outer.size > 1)

    def _kept_range(self) -> tuple:
        """ZeRO-3: the buffer range whose compute weights persist between uses.

        The whole compute range, or under ``casts_main`` (and FP8 gathers) only the part holding
        frozen parameters (from the first frozen parameter on; empty when there is none).
        """
        lo, hi = self.regions.compute
        if not self._frozen_only_kept:
            return lo, hi
        frozen = [slot for slot in self.layout.slots if not slot.spec.trainable]
        if not frozen:
            return hi, hi
        start = min(max(lo, frozen[0].start), hi)
        return start, max(start, min(hi, self.layout.used_end))

    def _views_of(self, flat: torch.Tensor) -> List[torch.Tensor]:
        return [flat[s.start:s.end].view(s.spec.shape) for s in self.layout.slots]

    def _grad_views_of(self, flat: torch.Tensor) -> List[Optional[torch.Tensor]]:
        """The trainable parameters' views of a flat gradient (None for frozen ones: ``flat`` may end before them)."""
        return [flat[s.start:s.end].view(s.spec.shape) if s.spec.trainable else None for s in self.layout.slots]

    def _accum_part(self, grads: torch.Tensor, region) -> torch.Tensor:
        """The part of ``grads`` (buffer range ``region``) that the accumulator holds."""
        a, b = self.regions.accum
        return grads[a - region[0]:b - region[0]]

    def compute_slice(self, a: int, b: int) -> torch.Tensor:
        """Persistent compute storage of buffer range [a, b) (checkpoints and full state dicts read it)."""
        if self.shard is None:
            return self.full[a:b]
        lo, hi = self.kept
        if a >= b:  # an empty piece (a parameter this rank owns none of)
            return self.shard[0:0]
        if a < lo or b > hi:
            raise RuntimeError(f"buffer range [{a}, {b}) has no persistent compute weights (kept: [{lo}, {hi}))")
        return self.shard[a - lo:b - lo]


    @property
    def resident(self) -> bool:
        """The full buffer is allocated: it holds the weights or an all-gather is filling it."""
        return self.residency is not Residency.SHARDED

    def _attach_params(self) -> None:
        for p, view in zip(self.params, self.views):
            p.data = view
        self.residency = Residency.FULL

    def _detach_params(self) -> None:
        # A released parameter is an empty tensor, never a view of freed memory:
        # reading it outside forward/backward gives an empty result, not a crash.
        empty = torch.empty(0, dtype=self.compute_dtype, device=self.full.device)
        for p in self.params:
            p.data = empty

    def _in_reduce_dtype(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.dtype == self.reduce_dtype else tensor.to(self.reduce_dtype)

    def _scale(self, tensor: torch.Tensor, axis: CommAxis) -> torch.Tensor:
        """Turn a sum over ``axis`` into a mean (unless gradients are to be summed)."""
        return tensor if axis.size == 1 or not self.average_grads else tensor.mul_(1.0 / axis.size)

    # ----------------------------------------------------------- parameters
    def unshard(self, tag: str) -> Handle:
        """ZeRO-3: materialise the full compute weights from the persistent shard."""
        if self.resident:
            return Handle()
        if self.gather_buffer is not None:
            self.gather_buffer.claim(self._gather_name)
        else:
            _alloc(self.full)
        self.residency = Residency.GATHERING  # FULL once the last stage has landed (_attach_params)
        lo, hi = self.regions.inner
        gather_buf = self._full_out
        if self.fp8 is not None:
            return self.fp8.unshard(tag, gather_buf, then=self._attach_params)
        own = self.shard
        if self.casts_main:
            own = self._cast_into(gather_buf)
        if self.levels.outer.shard_params:
            first = self.outer.all_gather(gather_buf[lo:hi], own, tag)
            return staged(first, lambda: Handle(self.inner.all_gather(gather_buf, gather_buf[lo:hi], tag),
                                                then=self._attach_params))
        return Handle(self.inner.all_gather(gather_buf, own, tag), then=self._attach_params)

    def _cast_into(self, gather_buf: torch.Tensor) -> torch.Tensor:
        """Fill this rank's compute range of ``gather_buf``: main weights cast, then padding, then frozen weights.

        Returns that slice: the input of the in-place all-gather.
        """
        lo, hi = self.regions.compute
        a, b = self.regions.main
        k0, k1 = self.kept
        if b > a:
            gather_buf[a:b].copy_(self.main)
        if k0 > b:
            gather_buf[b:k0].zero_()
        if k1 > k0:
            gather_buf[k0:k1].copy_(self.shard)
        if hi > max(b, k1):
            gather_buf[max(b, k1):hi].zero_()
        return gather_buf[lo:hi]

    def reshard(self) -> None:
        """Release the full compute weights (ZeRO-3 only; other levels keep them)."""
        if self.residency is not Residency.FULL or not self.releases:
            return
        self._detach_params()
        if self.fp8 is not None:
            self.fp8.release()
        if self.gather_buffer is not None:
            self.gather_buffer.release(self._gather_name)
        else:
            _free(self.full)
        self.residency = Residency.SHARDED

    def install_main_weights(self, tag: str, step: bool = False) -> Handle:
        """Copy updated main weights into compute weights and rebuild what is persistent.

        Nothing to do under ``casts_main``: the next gather casts the main weights. FP8 gathers
        quantize the new weights instead (``quantized_gather.py``); ``step``: they come from an
        optimizer step, so delayed scaling moves its amax history on (a load re-installs without).
        """
        if self.fp8 is not None:
            return self.fp8.install(tag, step)
        if self.casts_main:
            return Handle()
        a, b = self.regions.main
        if not self.shares_main:
            self.compute_slice(a, b).copy_(self.main)
        stages = []
        lo, hi = self.regions.inner
        piece_lo, piece_hi = self.regions.piece
        if self.levels.outer.shard_optim and not self.levels.outer.shard_params:
            target = self.compute_slice(lo, hi).data
            stages.append(lambda: self.outer.all_gather(target, target[piece_lo - lo:piece_hi - lo], tag))
        if self.levels.inner.shard_optim and not self.levels.inner.shard_params:
            gather_buf = self._full_out
            stages.append(lambda: self.inner.all_gather(gather_buf, gather_buf[lo:hi], tag))
        if not stages:
            return Handle()
        return staged(stages[0](), *stages[1:])

    # ------------------------------------------------------------- gradients
    def begin_grads(self) -> None:
        """Point every trainable ``param.grad`` at this micro-batch's flat gradient."""
        if not self.trainable_params:
            return
        if self.grads_in_place:
            self.ensure_grads()
        if self.grad_full is None:
            # Not zero-filled up front (its pages would all be resident from the unit's first
            # gradient on): each parameter's gradient is written into its view when autograd
            # delivers it (``take_grad``), and what got none is zeroed when the unit's backward
            # ends (``finish_grads``).
            self.grad_full = torch.empty(self.layout.padded_size, dtype=self.compute_dtype, device=self.full.device)
            self.grad_views = self._grad_views_of(self.grad_full)
            self._unwritten = dict(self.trainable_params)
            for _, p in self.trainable_params:
                p.grad = None
            return
        for i, p in self.trainable_params:
            p.grad = self.grad_views[i]

    def take_grad(self, index: int) -> None:
        """Parameter ``index``'s gradient has been accumulated: move it into its view of the flat
        gradient, which later contributions (a second use, a recomputed backward) add to in place."""
        param = self._unwritten.pop(index, None) if self._unwritten is not None else None
        if param is not None:
            view = self.grad_views[index]
            view.copy_(param.grad)
            param.grad = view

    def finish_grads(self) -> None:
        """Zero what no gradient was written to: padding, frozen parameters, parameters without one."""
        if self._unwritten is None:
            return
        written = sorted((s.start, s.end) for i, s in enumerate(self.layout.slots)
                         if i in self._trainable_indices and i not in self._unwritten)
        end = 0
        for start, stop in written + [(self.grad_full.numel(), self.grad_full.numel())]:
            if start > end:
                self.grad_full[end:start].zero_()
            end = max(end, stop)
        for index, param in self._unwritten.items():
            param.grad = self.grad_views[index]
        self._unwritten = None

    def end_grads(self) -> None:
        """Drop the transient gradient (its content has been reduced or accumulated)."""
        if self.grads_in_place:
            return
        for _, p in self.trainable_params:
            p.grad = None
        self.grad_full = None
        self.grad_views = None
        self._unwritten = None

    def accumulate_local(self) -> None:
        """Full-grad inner levels with a transient buffer: add this micro-batch into the accumulator."""
        if not self.grads_in_place and self.grad_full is not None:
            self.finish_grads()
            self._accumulate(self._accum_part(self.grad_full, (0, self.layout.padded_size)))

    def reduce_microbatch(self, tag: str, then_step: bool) -> Handle:
        """Grad-sharded inner levels: reduce this micro-batch's full gradient into the accumulator.

        Inner reduce-scatter always; outer reduce-scatter too when the outer level
        shards grads. ``then_step`` chains the once-per-step stage behind it.
        """
        self.finish_grads()
        regions = self.regions
        lo, hi = regions.inner
        piece_lo, piece_hi = regions.piece
        # The once-per-step stage moves data only across an outer axis of more than one rank.
        step = [lambda: self.reduce_step(tag)] if then_step and self.outer.size > 1 else []
        if self.inner.size == 1 and self.outer.size == 1:
            self._accumulate(self.grad_full[regions.accum[0]:regions.accum[1]])
            return staged(Handle(), *step)
        device = self.grad_full.device
        if self.inner.size > 1:
            # The compute-dtype gradient goes to the collective as it is: the axis widens it to
            # the reduce dtype (comm.CommAxis.reduce_scatter; on the gloo ring one chunk at a
            # time) and keeps it only until the collective lands.
            inner_out = self._accumulator_as_output()
            if inner_out is None:
                inner_out = torch.empty(hi - lo, dtype=self.reduce_dtype, device=device)
            first = self.inner.reduce_scatter(inner_out, self.grad_full, tag)
        else:
            inner_out, first = self._in_reduce_dtype(self.grad_full)[lo:hi], Handle()
        if not self.levels.outer.shard_grads:
            def add_inner():
                if inner_out is self.grad_accum:
                    self._scale(inner_out, self.inner)  # reduced straight into the accumulator: the mean in place
                else:
                    self._accumulate(self._scale(self._accum_part(inner_out, regions.inner), self.inner))
            return staged(Handle(first, then=add_inner), *step)
        piece_out = torch.empty(piece_hi - piece_lo, dtype=self.reduce_dtype, device=device)

        def outer_stage() -> Handle:
            def add_piece():
                own = self._accum_part(piece_out, regions.piece)
                self._accumulate(self._scale(self._scale(own, self.inner), self.outer))
            return Handle(self.outer.reduce_scatter(piece_out, inner_out, tag), then=add_piece, keep=(inner_out,))
        return staged(first, outer_stage, *step)

    def reduce_step(self, tag: str) -> Handle:
        """The once-per-step stages: whatever the levels did not reduce every micro-batch."""
        if not self.trainable_params:
            return Handle()
        stages = []
        regions = self.regions
        accum = self.ensure_grads()
        if self.levels.inner.keeps_full_grads:
            stages.append(lambda: self._reduce_region(accum, self.inner, (0, self.layout.padded_size),
                                                      regions.inner if self.levels.inner.shard_optim else None, tag))
        if not self.levels.outer.shard_grads:
            piece = regions.piece if self.levels.outer.shard_optim else None
            stages.append(lambda: self._reduce_region(accum, self.outer, regions.inner, piece, tag))
        return staged(stages[0](), *stages[1:])

    def _reduce_region(self, accum: torch.Tensor, axis: CommAxis, region, piece, tag: str) -> Handle:
        """Average the gradient of buffer range ``region`` over ``axis``: all-reduce it, or reduce-scatter
        it into buffer range ``piece``. The accumulator holds buffer range ``regions.accum``; past its end
        (frozen parameters) the gradient is zero: an all-reduce leaves that out (every rank of the axis
        holds the same range), a reduce-scatter, which needs the whole region, reads zeros there."""
        if axis.size == 1:
            return Handle()
        base = self.regions.accum[0]
        lo = max(region[0], base)
        held = (lo, max(lo, min(region[1], base + accum.numel())))
        src = accum[held[0] - base:held[1] - base]
        if piece is None:
            if src.numel() == 0:
                return Handle()
            wire = self._in_reduce_dtype(src)

            def done_all():
                if wire is not src:
                    src.copy_(wire)
                self._scale(src, axis)
            return Handle(axis.all_reduce(wire, tag), then=done_all, keep=(wire,))
        if held == tuple(region):
            wire = self._in_reduce_dtype(src)
        else:
            wire = torch.zeros(region[1] - region[0], dtype=self.reduce_dtype, device=accum.device)
            wire[held[0] - region[0]:held[1] - region[0]].copy_(src)
        out = torch.empty(piece[1] - piece[0], dtype=wire.dtype, device=wire.device)

        def done_scatter():
            lo, hi = max(piece[0], base), min(piece[1], base + accum.numel())
            if hi > lo:
                accum[lo - base:hi - base].copy_(self._scale(out[lo - piece[0]:hi - piece[0]], axis))
        return Handle(axis.reduce_scatter(out, wire, tag), then=done_scatter, keep=(wire,))

    def zero_grads(self, set_to_none: bool = False) -> None:
        """Zero the accumulated gradients: in place, or (``set_to_none``) by releasing the
        accumulator, whose next use allocates it zeroed. A released accumulator stays released."""
        if not self.grads_allocated:
            return
        if not set_to_none:
            self.grad_accum.zero_()
            return
        if self.grads_in_place:
            for _, p in self.trainable_params:
                p.grad = None
        _free(self.grad_accum)

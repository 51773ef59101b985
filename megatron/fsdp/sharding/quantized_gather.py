"""The FP8 parameter gather of one unit: quantize this rank's main shard, all-gather bytes, dequantize.

With ``MixedPrecision(param_gather=QuantizedParamGather(...))`` a unit's selected weights travel
as FP8 instead of the compute dtype. Everything else about the unit stays: its flat layout (under
MXFP8 every parameter start and shard boundary is a multiple of 32 elements, so a shard never
splits a block), its gradient path (the gradient of the dequantized compute weight is reduced into
the fp32 main gradient as before), its residency and prefetch.

Why one module: the wire layout (``WirePlan``, a pure function of the flat layout), when weights are
quantized, and the delayed-scaling state must agree on every rank and level, so the FP8 bytes equal
``fp8.py``'s functions applied to the full main weight. The rules: docs/precision.md, "The engine's FP8
gather"; the API: docs/engine.md, "FP8 parameter gathers".
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..collectives.comm import Handle, staged
from ..precision import fp8
from ..precision.param_gather import QuantizedParamGather
from .layout import FlatLayout

WIRE_ALIGN = 16  # bytes: each piece's wire starts aligned (its compute-dtype part is viewed in place)
AMAX_HISTORY_KEY, SCALE_KEY = "._fp8_amax_history", "._fp8_scale"  # state dict keys: parameter name + suffix


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run ``[lo, hi)`` of buffer elements inside one piece, at byte ``offset`` of the piece's wire.

    ``quantized``: index of the quantized parameter it belongs to (``-1``: compute-dtype elements);
    ``scale_offset``: MXFP8, where its block scales sit in the piece's wire.
    """

    lo: int
    hi: int
    offset: int
    quantized: int = -1
    scale_offset: int = -1


@dataclasses.dataclass(frozen=True)
class WirePlan:
    pieces: Tuple[Tuple[int, int], ...]
    segments: Tuple[Tuple[Segment, ...], ...]  # per piece
    piece_bytes: int
    quantized: Tuple[int, ...]  # layout slot index of each quantized parameter
    block: int  # 32 under MXFP8, else 0

    @property
    def nbytes(self) -> int:
        """Bytes of the whole gathered wire (what the ledger records for a gather)."""
        return self.piece_bytes * len(self.pieces)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def wire_plan(layout: FlatLayout, quantized: Sequence[int], num_pieces: int, itemsize: int, block: int) -> WirePlan:
    """The wire of every piece (module docstring); a pure function of the layout."""
    size = layout.padded_size
    if size % num_pieces:
        raise ValueError(f"a buffer of {size} elements does not split into {num_pieces} pieces")
    width = size // num_pieces
    spans = sorted((layout.slots[i].start, layout.slots[i].end, q) for q, i in enumerate(quantized))
    pieces, segments, totals = [], [], []
    for k in range(num_pieces):
        lo, hi = k * width, (k + 1) * width
        raw, quant, cursor = [], [], lo
        for start, end, q in spans:
            a, b = max(lo, start), min(hi, end)
            if a >= b:
                continue
            if block and ((a - start) % block or (b - a) % block):
                raise ValueError(f"piece [{lo}, {hi}) splits a {block}-block of quantized parameter {q}: "
                                 "the layout is not aligned to the block")
            if a > cursor:
                raw.append((cursor, a))
            quant.append((a, b, q))
            cursor = b
        if cursor < hi:
            raw.append((cursor, hi))
        offset, out = 0, []
        for a, b in raw:
            out.append(Segment(a, b, offset))
            offset += (b - a) * itemsize
        q_offsets = []
        for a, b, _ in quant:
            q_offsets.append(offset)
            offset += b - a
        for (a, b, q), q_offset in zip(quant, q_offsets):
            scale_offset = -1
            if block:
                scale_offset, offset = offset, offset + (b - a) // block
            out.append(Segment(a, b, q_offset, q, scale_offset))
        pieces.append((lo, hi))
        segments.append(tuple(out))
        totals.append(offset)
    return WirePlan(tuple(pieces), tuple(segments), _round_up(max(totals), WIRE_ALIGN), tuple(quantized), block)


class QuantizedGather:
    """The FP8 side of one ``UnitStorage``: scales, delayed-scaling history, wire and FP8 bytes."""

    def __init__(self, storage, config: QuantizedParamGather, quantized: Sequence[int]):
        s = storage
        self.storage, self.config, self.format = s, config, config.format
        levels = s.levels
        self._outer_pieces = s.outer.size if levels.outer.shard_optim else 1
        inner_pieces = s.inner.size if levels.inner.shard_optim else 1
        self.plan = wire_plan(s.layout, quantized, inner_pieces * self._outer_pieces,
                              s.compute_dtype.itemsize, config.block)
        self._inner_first = (s.inner.rank if levels.inner.shard_optim else 0) * self._outer_pieces
        self.own = self._inner_first + (s.outer.rank if levels.outer.shard_optim else 0)
        if self.plan.pieces[self.own] != tuple(s.regions.owned):
            raise AssertionError(f"wire piece {self.plan.pieces[self.own]} is not the owned range {s.regions.owned}")
        # ZeRO-3 whose compute range is its own piece: each gather quantizes the main shard again.
        self.encodes_at_gather = s.releases and tuple(s.regions.compute) == tuple(s.regions.owned)
        device = s.full.device
        n = len(quantized)
        self.scales = torch.ones(n, dtype=torch.float32, device=device)
        self.scale_invs = torch.ones(n, dtype=torch.float32, device=device)
        self.history_in: Optional[fp8.AmaxHistory] = None  # delayed: what the current weights were quantized with
        self.history: Optional[fp8.AmaxHistory] = None     # history_in with the current weights' amax recorded
        if config.recipe == "delayed":
            self.history_in = self.history = fp8.AmaxHistory.new(config.amax_history_len, config.amax_compute_algo,
                                                                 (n,), device=device)
        width = self.plan.pieces[0][1] - self.plan.pieces[0][0]
        self._kept_first = s.regions.compute[0] // width  # first piece of the compute range
        kept_pieces = (s.regions.compute[1] - s.regions.compute[0]) // width
        # HFSDP: the FP8 wire of the inner compute shard, rebuilt by each install's outer gather.
        self.kept_wire = (torch.zeros(kept_pieces * self.plan.piece_bytes, dtype=torch.uint8, device=device)
                          if s.releases and not self.encodes_at_gather else None)
        self.data: Optional[torch.Tensor] = None          # FP8 bytes of the whole buffer while gathered
        self.block_scales: Optional[torch.Tensor] = None  # MXFP8: E8M0 bytes, one per 32 buffer elements
        if not s.releases:
            self._allocate_gathered()
        for q, index in enumerate(self.plan.quantized):
            s.params[index]._mfsdp_fp8 = (weakref.ref(self), q)

    # ----------------------------------------------------------------- inspection
    @property
    def names(self) -> List[str]:
        return [self.storage.layout.slots[i].spec.name for i in self.plan.quantized]

    @property
    def gathered(self) -> bool:
        """The FP8 bytes of the whole unit are here (ZeRO-3: from a gather's decode to the release)."""
        return self.data is not None

    def persistent_bytes(self) -> int:
        """FP8 bytes kept between uses: the gathered bytes of a unit that stays gathered, or HFSDP's kept wire."""
        if self.storage.releases:
            return 0 if self.kept_wire is None else self.kept_wire.numel()
        return self.data.numel() + (self.block_scales.numel() if self.block_scales is not None else 0)

    def weight(self, q: int) -> fp8.QuantizedWeight:
        """Quantized parameter ``q`` as the gathered bytes (views: valid while the unit is gathered)."""
        slot = self.storage.layout.slots[self.plan.quantized[q]]
        shape = slot.spec.shape
        data = self.data[slot.start:slot.end].view(self.format.dtype).view(shape)
        if self.config.per_tensor:
            return fp8.QuantizedWeight(data, self.scale_invs[q], self.format.name, self.config.recipe)
        block = self.plan.block
        scales = self.block_scales[slot.start // block:slot.end // block].view(torch.float8_e8m0fnu)
        return fp8.QuantizedWeight(data, scales.view(*shape[:-1], shape[-1] // block), self.format.name, "mxfp8",
                                   len(shape) - 1)

    # ------------------------------------------------------------------- install
    def install(self, tag: str, step: bool) -> Handle:
        """Quantize the current main weights (a new version after an optimizer ``step``) and rebuild
        what the level keeps: scales, the kept FP8 shard, or the gathered and dequantized weights."""
        s, config = self.storage, self.config
        if config.recipe == "delayed" and step:
            self.history_in = self.history.advance(self.format, config.margin)
        calls: List[Callable[[], Handle]] = []
        if config.per_tensor:
            amax = self._local_amax()
            for axis, level in ((s.inner, s.levels.inner), (s.outer, s.levels.outer)):
                if level.shard_optim and axis.size > 1:
                    calls.append(lambda axis=axis: axis.all_reduce(amax, tag=f"{tag}.fp8_amax", op="max"))

            def scale_then_gather() -> Handle:
                self._set_scales(amax)
                return self._install_gathers(tag)
            calls.append(scale_then_gather)
        else:
            calls.append(lambda: self._install_gathers(tag))
        return staged(calls[0](), *calls[1:])

    def _local_amax(self) -> torch.Tensor:
        s = self.storage
        a, b = s.regions.main
        amax = torch.zeros(len(self.plan.quantized), dtype=torch.float32, device=s.main.device)
        for q, index in enumerate(self.plan.quantized):
            slot = s.layout.slots[index]
            lo, hi = max(a, slot.start), min(b, slot.end)
            if lo < hi:
                amax[q] = fp8.amax(s.main[lo - a:hi - a])
        return amax

    def _set_scales(self, amax: torch.Tensor) -> None:
        config = self.config
        if config.recipe == "delayed":
            self.scales = self.history_in.scale.clone()
            self.history = self.history_in.record(amax)
        else:
            self.scales = fp8.scale_from_amax(amax, self.format, config.margin)
        self.scale_invs = torch.reciprocal(self.scales)

    def _install_gathers(self, tag: str) -> Handle:
        s = self.storage
        if self.encodes_at_gather:
            return Handle()  # each gather quantizes the main shard with the scales just set
        width = self.plan.piece_bytes
        if s.releases:
            target, first = self.kept_wire, self._kept_first
        else:
            target, first = torch.empty(self.plan.nbytes, dtype=torch.uint8, device=s.full.device), 0
        own = target[(self.own - first) * width:(self.own - first + 1) * width]
        self._encode(own)
        inner_lo = (self._inner_first - first) * width
        inner_slice = target[inner_lo:inner_lo + self._outer_pieces * width]
        stages: List[Callable[[], Handle]] = []
        if s.levels.outer.shard_optim and not s.levels.outer.shard_params:
            stages.append(lambda: s.outer.all_gather(inner_slice, own, tag))
        if s.levels.inner.shard_optim and not s.levels.inner.shard_params:
            stages.append(lambda: s.inner.all_gather(target, inner_slice, tag))
        finish = None if s.releases else (lambda: self._decode(target, s.full.data))
        if not stages:
            if finish is not None:
                finish()
            return Handle()
        last = stages.pop()
        stages.append(lambda: Handle(last(), then=finish))
        return staged(stages[0](), *stages[1:])

    # -------------------------------------------------------------------- gather
    def unshard(self, tag: str, gather_buf: torch.Tensor, then: Callable[[], None]) -> Handle:
        """ZeRO-3: gather the FP8 wire, then dequantize into ``gather_buf`` (the unit's full buffer)."""
        s = self.storage
        width = self.plan.piece_bytes
        wire = torch.empty(self.plan.nbytes, dtype=torch.uint8, device=gather_buf.device)
        inner_slice = wire[self._inner_first * width:(self._inner_first + self._outer_pieces) * width]

        def finish():
            self._allocate_gathered()
            self._decode(wire, gather_buf)
            then()
        if not self.encodes_at_gather:  # HFSDP: the kept inner shard's wire
            return Handle(s.inner.all_gather(wire, self.kept_wire, tag), then=finish)
        own = wire[self.own * width:(self.own + 1) * width]
        self._encode(own)
        if s.levels.outer.shard_params:
            first = s.outer.all_gather(inner_slice, own, tag)
            return staged(first, lambda: Handle(s.inner.all_gather(wire, inner_slice, tag), then=finish))
        return Handle(s.inner.all_gather(wire, own, tag), then=finish)

    def release(self) -> None:
        """ZeRO-3 after use: drop the gathered FP8 bytes (the full buffer goes with the storage)."""
        if self.storage.releases:
            self.data = self.block_scales = None

    def _allocate_gathered(self) -> None:
        device = self.storage.full.device
        size = self.storage.layout.padded_size
        self.data = torch.zeros(size, dtype=torch.uint8, device=device)
        if self.plan.block:
            self.block_scales = torch.zeros(size // self.plan.block, dtype=torch.uint8, device=device)

    # ----------------------------------------------------------- encode / decode
    def _encode(self, out: torch.Tensor) -> None:
        """This rank's piece as wire bytes: compute-dtype elements, FP8 elements, block scales."""
        s = self.storage
        a = s.regions.main[0]
        out.zero_()
        config = self.config
        for seg in self.plan.segments[self.own]:
            n = seg.hi - seg.lo
            if seg.quantized < 0:
                self._fill_compute(seg.lo, seg.hi, out[seg.offset:seg.offset + n * s.compute_dtype.itemsize]
                                   .view(s.compute_dtype))
                continue
            x = s.main[seg.lo - a:seg.hi - a]  # quantized parameters are trainable: in the main weights
            if config.per_tensor:
                data = fp8.quantize_per_tensor(x, self.scales[seg.quantized], self.format, config.recipe).data
            else:
                q = fp8.quantize_mxfp8(x.view(-1, self.plan.block), self.format)
                data = q.data
                out[seg.scale_offset:seg.scale_offset + n // self.plan.block].copy_(q.scale_inv.view(torch.uint8).reshape(-1))
            out[seg.offset:seg.offset + n].copy_(data.reshape(-1).view(torch.uint8))

    def _fill_compute(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """Buffer range ``[lo, hi)`` in the compute dtype: main weights cast, kept (frozen) weights, zero padding."""
        s = self.storage
        a, b = s.regions.main
        if max(a, lo) < min(b, hi):
            out[max(a, lo) - lo:min(b, hi) - lo].copy_(s.main[max(a, lo) - a:min(b, hi) - a])
        k0, k1 = s.kept
        frozen_lo, frozen_hi = max(lo, k0, s.layout.trainable_end), min(hi, k1, s.layout.used_end)
        if frozen_lo < frozen_hi:
            out[frozen_lo - lo:frozen_hi - lo].copy_(s.compute_slice(frozen_lo, frozen_hi))

    def _decode(self, wire: torch.Tensor, full: torch.Tensor) -> None:
        """Every piece's wire into the full compute buffer and the FP8 bytes; quantized weights dequantized."""
        s = self.storage
        itemsize = s.compute_dtype.itemsize
        block = self.plan.block
        for k, segments in enumerate(self.plan.segments):
            base = k * self.plan.piece_bytes
            for seg in segments:
                n = seg.hi - seg.lo
                at = base + seg.offset
                if seg.quantized < 0:
                    full[seg.lo:seg.hi].copy_(wire[at:at + n * itemsize].view(s.compute_dtype))
                    continue
                self.data[seg.lo:seg.hi].copy_(wire[at:at + n])
                if block:
                    at = base + seg.scale_offset
                    self.block_scales[seg.lo // block:seg.hi // block].copy_(wire[at:at + n // block])
        for q, index in enumerate(self.plan.quantized):
            slot = s.layout.slots[index]
            full[slot.start:slot.end].copy_(self.weight(q).dequantize(s.compute_dtype).reshape(-1))

    # --------------------------------------------------------------- state dict
    def state(self) -> dict:
        """Delayed scaling's per-parameter state: ``{<name>._fp8_amax_history: [L], <name>._fp8_scale: []}``."""
        if self.history_in is None:
            return {}
        out = {}
        for q, name in enumerate(self.names):
            out[name + AMAX_HISTORY_KEY] = self.history_in.amaxes[:, q]
            out[name + SCALE_KEY] = self.history_in.scale[q]
        return out

    def load_state(self, values: dict) -> None:
        """Take ``state()``-shaped values (all present, shapes checked by the caller); the next install uses them."""
        if self.history_in is None:
            return
        amaxes = self.history_in.amaxes.clone()
        scale = self.history_in.scale.clone()
        for q, name in enumerate(self.names):
            if name + AMAX_HISTORY_KEY in values:
                amaxes[:, q] = values[name + AMAX_HISTORY_KEY]
                scale[q] = values[name + SCALE_KEY]
        self.history_in = self.history = fp8.AmaxHistory(amaxes, scale, self.history_in.algo)


def quantized_weight(param: torch.nn.Parameter) -> Optional[fp8.QuantizedWeight]:
    """The FP8 form of ``param`` while its unit is gathered (its bytes and scales: views, valid until the
    unit is released), or None: not gathered, or not a parameter the unit's ``param_gather`` quantizes.

    Bitwise what ``fp8.py`` gives for the full fp32 main weight under the same recipe; ``param`` itself
    holds its dequantization in the compute dtype.
    """
    ref = getattr(param, "_mfsdp_fp8", None)
    gather = ref[0]() if ref is not None else None
    if gather is None or not gather.gathered:
        return None
    return gather.weight(ref[1])

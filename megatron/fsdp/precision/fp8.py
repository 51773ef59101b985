"""FP8 numbers: formats, scales, amax histories and the quantizers of each recipe (pure torch).

One truth for how a tensor becomes FP8, shared by the engine's quantized parameter gather and the
training job's FP8 layers: a sharded model and an unsharded one quantize a weight with these
functions, so the FP8 bytes they compute with are bitwise equal. No process groups here; the
engine reduces amaxes over shards itself and hands the global value in.

API (stable: names and signatures are only ever added to)::

    E4M3, E5M2                       # Fp8Format(name, dtype, max): 448 and 57344
    fp8_format("e4m3" | "e5m2")      # -> Fp8Format
    RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")
    MX_BLOCK = 32; BLOCK = 128

    amax(x) -> fp32 0-d                # max |x| (0 for an empty tensor)
    scale_from_amax(amax, fmt, margin=0, previous=None) -> fp32 tensor
    quantize_per_tensor(x, scale, fmt, recipe="tensorwise") -> QuantizedWeight
    quantize_tensorwise(x, fmt, margin=0) -> QuantizedWeight          # current scaling: scale from amax(x)
    quantize_delayed(x, history, fmt) -> (QuantizedWeight, AmaxHistory)  # history.scale; records amax(x)
    quantize_mxfp8(x, fmt="e4m3", dim=-1) -> QuantizedWeight           # 32-blocks along dim, E8M0 scales
    quantize_blockwise(x, fmt="e4m3", power_of_two=True) -> QuantizedWeight  # 2-D tiles
    dequantize(q, dtype=torch.float32)                                 # == q.dequantize(dtype)
    decode(data) -> fp32                                               # == data.to(float32), by lookup
    mx_block_scales(block_amax, fmt) -> float8_e8m0fnu                 # the E8M0 rule alone

    AmaxHistory.new(length, algo="max", shape=())  # frozen: amaxes [length, *shape], scale [*shape]
    history.record(amax) -> AmaxHistory            # slot 0 = max(slot 0, amax)
    history.advance(fmt, margin=0) -> AmaxHistory  # next scale from the window, then roll
    QuantizedWeight(data, scale_inv, fmt, recipe, block_dim=None)  # frozen

The conventions (Transformer Engine's: saturating casts, the scale from an amax, delayed scaling's
window, MXFP8's E8M0 rule, blockwise tiles) are in docs/precision.md, "FP8 numbers".
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")
AMAX_ALGOS = ("max", "most_recent")
MX_BLOCK = 32  # elements per MXFP8 block
BLOCK = 128  # rows and columns of a blockwise tile
_FP32_MAX = torch.finfo(torch.float32).max


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """One FP8 element format: its name, torch dtype and largest finite value."""

    name: str
    dtype: torch.dtype
    max: float


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0)
FORMATS = {E4M3.name: E4M3, E5M2.name: E5M2}


def fp8_format(fmt) -> Fp8Format:
    """``"e4m3"``/``"e5m2"`` (or an ``Fp8Format``) -> the format; anything else is a ValueError."""
    if isinstance(fmt, Fp8Format):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}: use one of {sorted(FORMATS)}")
    return FORMATS[fmt]


def check_recipe(recipe: str) -> str:
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}: use one of {list(RECIPES)}")
    return recipe


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A tensor in FP8 and what dequantizes it.

    ``data``: the FP8 elements, the tensor's shape, dtype ``fp8_format(fmt).dtype``.
    ``scale_inv``: what ``data`` is multiplied by to dequantize (``torch._scaled_mm``'s
    ``scale_a``/``scale_b``): per-tensor recipes an fp32 0-d tensor; ``mxfp8`` a
    ``float8_e8m0fnu`` tensor of the tensor's shape with ``block_dim``'s size divided by 32;
    ``blockwise`` fp32 ``[ceil(rows / 128), ceil(cols / 128)]``.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    fmt: str
    recipe: str
    block_dim: Optional[int] = None  # mxfp8: the dimension the 32-element blocks run along

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the elements plus the scales (what a gather of this tensor moves)."""
        return self.data.numel() * self.data.element_size() + self.scale_inv.numel() * self.scale_inv.element_size()


def amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as an fp32 0-d tensor; 0 for an empty tensor (a shard may hold none of a weight)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().to(torch.float32)


def scale_from_amax(amax: torch.Tensor, fmt, margin: int = 0, previous: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TE's scale rule: ``(max / amax) / 2**margin``, the previous scale where amax is 0 or not finite."""
    fmt = fp8_format(fmt)
    amax = torch.as_tensor(amax, dtype=torch.float32)
    if previous is None:
        previous = torch.ones_like(amax)
    previous = torch.as_tensor(previous, dtype=torch.float32, device=amax.device)
    scale = (torch.tensor(fmt.max, dtype=torch.float32, device=amax.device) / amax) / float(2 ** margin)
    keep = (amax <= 0) | ~torch.isfinite(amax)
    scale = torch.where(keep, previous, scale)
    return torch.where(torch.isinf(scale), torch.full_like(scale, _FP32_MAX), scale)


def _saturating_cast(scaled: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    return scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype)


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor, fmt, recipe: str = "tensorwise") -> QuantizedWeight:
    """``x`` in FP8 with a given fp32 scale (the saturating cast of the module docstring)."""
    fmt = fp8_format(fmt)
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(())
    data = _saturating_cast(x.detach().to(torch.float32) * scale, fmt)
    return QuantizedWeight(data, torch.reciprocal(scale), fmt.name, check_recipe(recipe))


def quantize_tensorwise(x: torch.Tensor, fmt, margin: int = 0) -> QuantizedWeight:
    """Current scaling: the scale from this tensor's own amax (the engine passes the global amax instead)."""
    return quantize_per_tensor(x, scale_from_amax(amax(x), fmt, margin), fmt, "tensorwise")


@dataclasses.dataclass(frozen=True)
class AmaxHistory:
    """Delayed scaling's state for one tensor (``shape=()``) or a batch of them (``shape=(n,)``).

    ``amaxes[0]`` is the current step's slot, ``amaxes[1:]`` the previous steps' (oldest first,
    TE's layout); ``scale`` is what the current step quantizes with. Values are never changed in
    place: ``record`` and ``advance`` return new histories.
    """

    amaxes: torch.Tensor  # fp32 [length, *shape]
    scale: torch.Tensor  # fp32 [*shape]
    algo: str = "max"

    def __post_init__(self):
        if self.algo not in AMAX_ALGOS:
            raise ValueError(f"unknown amax_compute_algo {self.algo!r}: use one of {list(AMAX_ALGOS)}")
        if self.amaxes.dim() < 1 or self.amaxes.shape[0] < 1:
            raise ValueError(f"an amax history needs length >= 1, got amaxes of shape {tuple(self.amaxes.shape)}")

    @classmethod
    def new(cls, length: int, algo: str = "max", shape: Tuple[int, ...] = (), device=None) -> "AmaxHistory":
        if int(length) < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {length}")
        return cls(torch.zeros((int(length), *shape), dtype=torch.float32, device=device),
                   torch.ones(shape, dtype=torch.float32, device=device), algo)

    @property
    def length(self) -> int:
        return self.amaxes.shape[0]

    def record(self, amax: torch.Tensor) -> "AmaxHistory":
        """This step's amax into slot 0 (the max with what the step recorded before)."""
        amaxes = self.amaxes.clone()
        amaxes[0] = torch.maximum(amaxes[0], torch.as_tensor(amax, dtype=torch.float32, device=amaxes.device))
        return AmaxHistory(amaxes, self.scale, self.algo)

    def advance(self, fmt, margin: int = 0) -> "AmaxHistory":
        """End of a step: the next step's scale from the window, then roll it and clear slot 0."""
        window = self.amaxes.amax(dim=0) if self.algo == "max" else self.amaxes[0]
        scale = scale_from_amax(window, fmt, margin, previous=self.scale)
        amaxes = torch.roll(self.amaxes, -1, 0) if self.length > 1 else self.amaxes.clone()
        amaxes[0] = 0
        return AmaxHistory(amaxes, scale, self.algo)


def quantize_delayed(x: torch.Tensor, history: AmaxHistory, fmt) -> Tuple[QuantizedWeight, AmaxHistory]:
    """``x`` with the history's current scale; the history with ``amax(x)`` recorded (advance it once per step)."""
    return quantize_per_tensor(x, history.scale, fmt, "delayed"), history.record(amax(x))


def _e8m0_round_up(value: torch.Tensor) -> torch.Tensor:
    """TE's ``float_to_e8m0``: the biased fp32 exponent of ``value`` (>= 0), plus one when its mantissa is not 0."""
    bits = value.to(torch.float32).contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    exponent = exponent + up.to(torch.int32)
    exponent = torch.where(torch.isinf(value), torch.full_like(exponent, 0xFE), exponent)
    exponent = torch.where(torch.isnan(value), torch.full_like(exponent, 0xFF), exponent)
    return exponent.to(torch.uint8)


def mx_block_scales(block_amax: torch.Tensor, fmt="e4m3") -> torch.Tensor:
    """E8M0 scales (dequantization factors) of blocks with these amaxes: ``2**ceil_exp(amax / max)``."""
    fmt = fp8_format(fmt)
    reciprocal_max = torch.reciprocal(torch.tensor(fmt.max, dtype=torch.float32))
    return _e8m0_round_up(block_amax.to(torch.float32) * reciprocal_max.to(block_amax.device)).view(torch.float8_e8m0fnu)


def _mx_quantize_factor(scales: torch.Tensor) -> torch.Tensor:
    """What elements are multiplied by before the cast: ``2**(127 - e)`` (TE's ``exp2f_rcp``; 1 where e = 0)."""
    exponent = scales.view(torch.uint8).to(torch.int32)
    factor = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), 127 - exponent)
    return torch.where(exponent == 0, torch.ones_like(factor), factor)


def _blocks_last(x: torch.Tensor, dim: int, block: int) -> Tuple[torch.Tensor, int]:
    """``x`` with ``dim`` moved last and split into ``[..., n / block, block]``; the normalised dim."""
    dim = dim % x.dim()
    if x.shape[dim] % block:
        raise ValueError(f"MXFP8 needs dimension {dim} (size {x.shape[dim]}) of a {tuple(x.shape)} tensor to be a "
                         f"multiple of {block}: pad it, or leave this tensor out of the FP8 recipe")
    moved = x.movedim(dim, -1)
    return moved.reshape(*moved.shape[:-1], moved.shape[-1] // block, block), dim


def quantize_mxfp8(x: torch.Tensor, fmt="e4m3", dim: int = -1) -> QuantizedWeight:
    """MXFP8: 32-element blocks along ``dim``, one E8M0 scale each (module docstring)."""
    fmt = fp8_format(fmt)
    if x.dim() == 0:
        raise ValueError("MXFP8 quantizes tensors with at least one dimension")
    blocks, dim = _blocks_last(x.detach().to(torch.float32), dim, MX_BLOCK)
    scales = mx_block_scales(blocks.abs().amax(dim=-1), fmt)
    data = _saturating_cast(blocks * _mx_quantize_factor(scales).unsqueeze(-1), fmt)
    data = data.reshape(*blocks.shape[:-2], -1).movedim(-1, dim)
    return QuantizedWeight(data.contiguous(), scales.movedim(-1, dim).contiguous(), fmt.name, "mxfp8", dim)


def _tiles(x: torch.Tensor, block: int) -> torch.Tensor:
    """A 2-D tensor padded with zeros to whole tiles, as ``[row tiles, block, col tiles, block]``."""
    rows, cols = x.shape
    r, c = -(-rows // block), -(-cols // block)
    padded = torch.zeros((r * block, c * block), dtype=x.dtype, device=x.device)
    padded[:rows, :cols] = x
    return padded.view(r, block, c, block)


def quantize_blockwise(x: torch.Tensor, fmt="e4m3", power_of_two: bool = True) -> QuantizedWeight:
    """128 x 128 tiles of a 2-D tensor, an fp32 scale per tile (module docstring)."""
    fmt = fp8_format(fmt)
    if x.dim() != 2:
        raise ValueError(f"blockwise FP8 quantizes 2-D weights, got shape {tuple(x.shape)}")
    tiles = _tiles(x.detach().to(torch.float32), BLOCK)
    tile_amax = tiles.abs().amax(dim=(1, 3))
    scale = scale_from_amax(tile_amax, fmt)
    if power_of_two:
        scale = torch.ldexp(torch.ones_like(scale), torch.floor(torch.log2(scale)).to(torch.int32))
    data = _saturating_cast(tiles * scale[:, None, :, None], fmt).view(tiles.shape[0] * BLOCK, -1)
    return QuantizedWeight(data[: x.shape[0], : x.shape[1]].contiguous(), torch.reciprocal(scale), fmt.name, "blockwise")


_DECODE_TABLES: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}


def decode(data: torch.Tensor) -> torch.Tensor:
    """FP8 elements as fp32, bitwise ``data.to(torch.float32)``: each byte looked up in its format's 256 values.

    Why: torch's CPU cast from FP8 converts element by element (17 ms for the 3.1M elements of a hidden-512
    block's GEMM weights on an Intel Xeon), the lookup takes 3 ms; ZeRO-3's FP8 gather decodes every weight
    twice a step. The table is the cast itself, applied once to every code (NaN codes included).
    """
    key = (data.dtype, data.device)
    table = _DECODE_TABLES.get(key)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32, device=data.device).to(torch.uint8)
        table = _DECODE_TABLES[key] = codes.view(data.dtype).to(torch.float32)
    flat = data.reshape(-1).view(torch.uint8).to(torch.int32)
    return torch.index_select(table, 0, flat).view(data.shape)


def dequantize(q: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``q`` stands for, computed in fp32 and returned in ``dtype``."""
    data = decode(q.data)
    if q.recipe == "mxfp8":
        scales = q.scale_inv.to(torch.float32).repeat_interleave(MX_BLOCK, dim=q.block_dim)
        return (data * scales).to(dtype)
    if q.recipe == "blockwise":
        rows, cols = data.shape
        expanded = q.scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
        return (data * expanded).to(dtype)
    return (data * q.scale_inv).to(dtype)

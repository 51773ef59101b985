"""FP8 GEMMs of a linear layer without Transformer Engine: the recipe's operands, quantized as it does.

``Fp8Recipe`` is the job's ``--fp8-*`` flags as a value. ``Fp8Linear`` is the autograd function
of ``y = x W^T + b`` with each GEMM's operands in FP8, quantized by ``megatron.fsdp.precision.fp8``
(the one place FP8 numbers are defined, shared with the engine's quantized parameter gather):

========================  =================  ========================  ==========================
GEMM                      operands           per-tensor recipes        mxfp8 (32-blocks along)
========================  =================  ========================  ==========================
forward   ``x W^T``       x, W               E4M3, E4M3                K, K
dgrad     ``dy W``        dy, W              E5M2 (hybrid), E4M3       N, N
wgrad     ``dy^T x``      dy, x              E5M2 (hybrid), E4M3       M, M (tokens; zero-padded)
========================  =================  ========================  ==========================

Per-tensor recipes (``tensorwise``: the scale from the tensor's own amax; ``delayed``: from an amax
history, ``Fp8Scales``) multiply through ``torch._scaled_mm``, the call cuBLAS-backed H100 kernels
take (row-major ``a``, column-major ``b``, fp32 dequantization scales), which torch 2.13 also runs
on CPU (with oneDNN off for the call: ``_without_onednn``). MXFP8 has no CPU kernel (block-scaled
``_scaled_mm`` is CUDA-only): its operands are dequantized (exactly: the scales are powers of two) and multiplied in fp32. Every GEMM accumulates
in fp32; the bias is added in fp32 and the output rounded once to the input's dtype, as Transformer
Engine's GEMM epilogue does. ``wgrad=False`` (Megatron-LM's ``--no-fp8-wgrad``) computes ``dy^T x``
in the compute dtype.

The weight operand comes from ``weight_source(weight, dim)``: the engine's quantized gather under
``--fp8-param-gather``, the layer's own quantization of its compute weight otherwise (``fp8_linears.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional

import torch

from megatron.fsdp.precision import fp8

INPUT, WEIGHT, GRAD = "input", "weight", "grad"


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """Megatron-LM's FP8 settings as the CPU layers run them (``megatron/fsdp_training/arguments/precision_flags.py``)."""

    format: str = "hybrid"  # --fp8-format: e4m3 everywhere, or hybrid (gradients in e5m2)
    recipe: str = "delayed"  # --fp8-recipe: tensorwise | delayed | mxfp8
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    wgrad: bool = True  # False: --no-fp8-wgrad, the weight gradient in the compute dtype
    param_gather: bool = False  # weights from megatron.fsdp's quantized gather (--fp8-param-gather)
    layers_at_start_in_bf16: int = 0  # --first-last-layers-bf16
    layers_at_end_in_bf16: int = 0

    def __post_init__(self):
        if self.format not in ("e4m3", "hybrid"):
            raise ValueError(f"FP8 format {self.format!r}: use e4m3 or hybrid")
        if self.recipe not in ("tensorwise", "delayed", "mxfp8"):
            raise ValueError(f"FP8 recipe {self.recipe!r}: the CPU layers build tensorwise, delayed and mxfp8")
        if self.amax_compute_algo not in fp8.AMAX_ALGOS:
            raise ValueError(f"amax compute algo {self.amax_compute_algo!r}: use one of {list(fp8.AMAX_ALGOS)}")

    def format_of(self, role: str) -> str:
        """E4M3 for inputs and weights; gradients E5M2 under hybrid (Transformer Engine's Format.HYBRID)."""
        return "e5m2" if role == GRAD and self.format == "hybrid" else "e4m3"

    @property
    def per_tensor(self) -> bool:
        return self.recipe in ("tensorwise", "delayed")

    def in_fp8(self, layer_index: int, num_layers: int) -> bool:
        """Whether global layer ``layer_index`` (0-based) runs in FP8 (Megatron-Core's ``is_first_last_bf16_layer``)."""
        return self.layers_at_start_in_bf16 <= layer_index < num_layers - self.layers_at_end_in_bf16

    def describe(self, num_layers: int) -> str:
        """What the start-up line says: formats, scaling, the GEMM path, the layers, the weights' source."""
        grads = "E5M2" if self.format == "hybrid" else "E4M3"
        scaling = {"tensorwise": "per-tensor scales from each tensor's amax",
                   "delayed": f"per-tensor scales from a {self.amax_history_len}-step amax history "
                              f"({self.amax_compute_algo}), advanced once per optimizer step",
                   "mxfp8": "32-element blocks with E8M0 scales"}[self.recipe]
        gemm = ("GEMMs through torch._scaled_mm" if self.per_tensor else
                "GEMMs on the dequantized operands in fp32 (no block-scaled CPU kernel)")
        first, last = self.layers_at_start_in_bf16 + 1, num_layers - self.layers_at_end_in_bf16
        layers = f"layers {first}-{last} of {num_layers} in FP8" if first <= last else "no layer in FP8"
        weights = ("weights from megatron.fsdp's FP8 gather" if self.param_gather else
                   "each layer quantizes its compute weight")
        return (f"{self.format} {self.recipe} recipe: inputs and weights E4M3, output gradients {grads}, {scaling}"
                f"{f', margin {self.margin}' if self.margin else ''}, {gemm}"
                f"{'' if self.wgrad else ', weight gradients in the compute dtype (--no-fp8-wgrad)'}; {layers}; "
                f"{weights}")


Quantizer = Callable[[str, torch.Tensor, int], fp8.QuantizedWeight]
WeightSource = Callable[[torch.Tensor, int], fp8.QuantizedWeight]


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows up to a multiple (MXFP8 blocks along the tokens; zero rows add nothing to ``dy^T x``)."""
    extra = -x.shape[0] % multiple
    return torch.nn.functional.pad(x, (0, 0, 0, extra)) if extra else x


def _column_major(data: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (``_scaled_mm``'s ``b``)."""
    return data.t().contiguous().t()


@contextlib.contextmanager
def _without_onednn(device: torch.device):
    """On CPU, ``torch._scaled_mm`` with oneDNN off: torch's own kernel, the product of the dequantized operands.

    Where oneDNN takes FP8 matmuls (an Intel Xeon with AVX512-FP16 and AMX, torch 2.13) it runs them ~1000x
    slower than torch's kernel on a CPU without FP8 arithmetic (256 x 256 x 256: 1.3 s against 1.3 ms, measured),
    which made one 4-rank FP8 test take 157 s. The flag is process-wide and only chooses a kernel; it is
    restored at once, and no other thread of the job multiplies matrices meanwhile.
    """
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        yield
        return
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def _scaled_mm(a: fp8.QuantizedWeight, b_data: torch.Tensor, b: fp8.QuantizedWeight) -> torch.Tensor:
    """``a @ b`` in fp32 from per-tensor FP8 operands (``b_data``: ``b``'s elements as the ``[K, N]`` operand)."""
    if a.data.shape[0] == 0 or b_data.shape[1] == 0 or a.data.shape[1] == 0:  # an expert without tokens
        return torch.zeros((a.data.shape[0], b_data.shape[1]), dtype=torch.float32, device=a.data.device)
    with _without_onednn(a.data.device):
        return torch._scaled_mm(a.data.contiguous(), b_data, scale_a=a.scale_inv, scale_b=b.scale_inv,
                                out_dtype=torch.float32)


def forward_gemm(recipe: Fp8Recipe, qx: fp8.QuantizedWeight, qw: fp8.QuantizedWeight) -> torch.Tensor:
    """``x W^T`` in fp32 (``qx`` ``[M, K]``, ``qw`` ``[N, K]``)."""
    if recipe.per_tensor:
        return _scaled_mm(qx, qw.data.t(), qw)
    return qx.dequantize() @ qw.dequantize().t()


def dgrad_gemm(recipe: Fp8Recipe, qdy: fp8.QuantizedWeight, qw: fp8.QuantizedWeight) -> torch.Tensor:
    """``dy W`` in fp32 (``qdy`` ``[M, N]``, ``qw`` ``[N, K]``; mxfp8: ``qw`` blocked along N)."""
    if recipe.per_tensor:
        return _scaled_mm(qdy, _column_major(qw.data), qw)
    return qdy.dequantize() @ qw.dequantize()


def wgrad_gemm(recipe: Fp8Recipe, qdy: fp8.QuantizedWeight, qx: fp8.QuantizedWeight) -> torch.Tensor:
    """``dy^T x`` in fp32 (``qdy`` ``[M, N]``, ``qx`` ``[M, K]``; mxfp8: both blocked along M)."""
    if recipe.per_tensor:
        dy_t = fp8.QuantizedWeight(qdy.data.t().contiguous(), qdy.scale_inv, qdy.fmt, qdy.recipe)
        return _scaled_mm(dy_t, _column_major(qx.data), qx)
    return qdy.dequantize().t() @ qx.dequantize()


class Fp8Linear(torch.autograd.Function):
    """``y = x W^T + b`` with FP8 GEMMs (module docstring). ``x`` is 2-D ``[M, K]``.

    ``quantize(role, tensor, dim)`` quantizes an input or output gradient (recording delayed
    scaling's amax when the layer trains); ``weight_source(weight, dim)`` gives the weight operand,
    blocked along ``dim`` for mxfp8 (1 in the forward, 0 for the input gradient). Per-tensor recipes
    keep the FP8 input for the weight gradient (as Transformer Engine does); the weight operand is
    asked for again in the backward (under ZeRO-3 the unit is gathered again by then), the same bits
    within a step.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8Recipe, quantize: Quantizer, weight_source: WeightSource):
        qx = quantize(INPUT, x, 1)
        out = forward_gemm(recipe, qx, weight_source(weight, 1))
        if bias is not None:
            out = out + bias.to(torch.float32)
        ctx.recipe, ctx.quantize, ctx.weight_source = recipe, quantize, weight_source
        ctx.has_bias = bias is not None
        keep_x = (not recipe.wgrad) or not recipe.per_tensor
        ctx.qx = qx if recipe.per_tensor and recipe.wgrad else None
        ctx.save_for_backward(x if keep_x else None, weight)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        recipe = ctx.recipe
        dy = dy.contiguous()
        qdy_rows = ctx.quantize(GRAD, dy, 1)  # blocked along N for mxfp8's dgrad
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = dgrad_gemm(recipe, qdy_rows, ctx.weight_source(weight, 0)).to(dy.dtype)
        if ctx.needs_input_grad[1]:
            if not recipe.wgrad:
                dw = dy.t().matmul(x.to(dy.dtype))
            elif recipe.per_tensor:
                dw = wgrad_gemm(recipe, qdy_rows, ctx.qx)
            else:  # mxfp8: both operands blocked along the tokens
                block = fp8.MX_BLOCK
                dw = wgrad_gemm(recipe, ctx.quantize(GRAD, _pad_rows(dy, block), 0),
                                ctx.quantize(INPUT, _pad_rows(x, block), 0))
            dw = dw.to(weight.dtype)
        db = dy.sum(dim=0, dtype=torch.float32).to(dy.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        ctx.qx = None
        return dx, dw, db, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], recipe: Fp8Recipe,
               quantize: Quantizer, weight_source: WeightSource) -> torch.Tensor:
    """``Fp8Linear`` on the last dimension of ``x`` (``[..., K]`` -> ``[..., N]``)."""
    rows = x.reshape(-1, x.shape[-1])
    out = Fp8Linear.apply(rows, weight, bias, recipe, quantize, weight_source)
    return out.reshape(*x.shape[:-1], out.shape[-1])

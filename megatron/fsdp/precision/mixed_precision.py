"""Mixed-precision policy: which dtype computes, which dtype is the master copy."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .param_gather import QuantizedParamGather


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Compute in ``param_dtype``; keep main weights and accumulate grads in ``main_dtype``.

    ``param_dtype=None`` keeps each parameter's own dtype for compute.
    ``grad_reduce_dtype`` is the dtype gradients travel in over the network;
    fp32 by default so a bf16 model still sums gradients without rounding
    per rank. ``cast_forward_inputs`` casts floating-point inputs of the root
    module to ``param_dtype`` (integer inputs such as token ids are left alone).
    ``param_gather=QuantizedParamGather(recipe, ...)`` gathers the GEMM weights it selects as FP8
    bytes plus scales and computes with their dequantization (``quantized_gather.py``; Megatron-LM's
    ``--fp8-param-gather``).
    """

    param_dtype: Optional[torch.dtype] = None
    main_dtype: torch.dtype = torch.float32
    grad_reduce_dtype: Optional[torch.dtype] = torch.float32
    cast_forward_inputs: bool = True
    param_gather: Optional[QuantizedParamGather] = None

    def __post_init__(self):
        if self.param_gather is not None and not isinstance(self.param_gather, QuantizedParamGather):
            raise TypeError(f"param_gather must be a megatron.fsdp.QuantizedParamGather, "
                            f"got {type(self.param_gather).__name__}")
        for field in ("param_dtype", "main_dtype", "grad_reduce_dtype"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"MixedPrecision.{field} must be a floating-point torch.dtype, got {value!r}")
        if self.main_dtype is None:
            raise ValueError("MixedPrecision.main_dtype cannot be None; use torch.float32")

    def compute_dtype(self, original: torch.dtype) -> torch.dtype:
        return self.param_dtype if self.param_dtype is not None else original

    def reduce_dtype(self, compute: torch.dtype) -> torch.dtype:
        return self.grad_reduce_dtype if self.grad_reduce_dtype is not None else compute

    def unit_dtypes(self, original: torch.dtype) -> "UnitDtypes":
        """The dtypes of a unit whose parameters are ``original``."""
        compute = self.compute_dtype(original)
        return UnitDtypes(compute, self.main_dtype, self.reduce_dtype(compute))


@dataclasses.dataclass(frozen=True)
class UnitDtypes:
    """One unit's dtypes: ``compute`` (parameters and gathers), ``main`` (main weights and gradient
    accumulators), ``reduce`` (gradients on the wire)."""

    compute: torch.dtype
    main: torch.dtype
    reduce: torch.dtype


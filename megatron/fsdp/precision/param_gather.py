"""``QuantizedParamGather``: which parameters a unit gathers in FP8, and with which recipe.

``MixedPrecision(param_gather=QuantizedParamGather(...))`` (Megatron-LM's ``--fp8-param-gather``)
gathers the selected weights as FP8 bytes plus their scales instead of bf16: half the bytes of
ZeRO-3's dominant traffic. The value names the recipe the way Megatron-LM's flags do
(``--fp8-recipe``, ``--fp8-amax-history-len``, ``--fp8-amax-compute-algo``, ``--fp8-margin``);
what each recipe computes is ``fp8.py``'s, and the data movement is ``sharding/quantized_gather.py``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from . import fp8

GATHER_RECIPES = ("tensorwise", "delayed", "mxfp8")


@dataclasses.dataclass(frozen=True)
class QuantizedParamGather:
    """Gather the weights ``quantize`` selects in FP8 ``fmt`` under ``recipe``.

    ``recipe``: ``"tensorwise"`` (a scale per tensor from its current global amax, one
    all-reduce MAX per unit per step), ``"delayed"`` (the scale from an amax history of
    ``amax_history_len`` steps, ``amax_compute_algo`` ``"max"`` or ``"most_recent"``: Transformer
    Engine's delayed scaling), ``"mxfp8"`` (32-element blocks along each weight's last dimension,
    the forward GEMM's reduction dimension, with power-of-two E8M0 scales).
    ``margin``: scale = fp8_max / amax / 2**margin (per-tensor recipes).
    ``quantize(name, param) -> bool``: the GEMM weights to gather in FP8; ``None`` selects the
    ``weight`` of every trainable ``torch.nn.Linear``. Everything else (biases, norms, embeddings,
    frozen parameters) is gathered in the compute dtype as without this option.
    """

    recipe: str = "tensorwise"
    fmt: str = "e4m3"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0
    quantize: Optional[Callable[[str, torch.nn.Parameter], bool]] = None

    def __post_init__(self):
        if self.recipe == "blockwise":
            raise ValueError("QuantizedParamGather(recipe='blockwise') is not built: a 128 x 128 tile spans 128 rows, "
                             "which a shard boundary may split; gather with 'tensorwise', 'delayed' or 'mxfp8' "
                             "(fp8.quantize_blockwise quantizes a full weight without the gather)")
        if self.recipe not in GATHER_RECIPES:
            raise ValueError(f"QuantizedParamGather(recipe={self.recipe!r}): unknown recipe; use one of "
                             f"{list(GATHER_RECIPES)}")
        fp8.fp8_format(self.fmt)
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) \
                or self.amax_history_len < 1:
            raise ValueError(f"QuantizedParamGather(amax_history_len={self.amax_history_len!r}): an integer >= 1")
        if self.amax_compute_algo not in fp8.AMAX_ALGOS:
            raise ValueError(f"QuantizedParamGather(amax_compute_algo={self.amax_compute_algo!r}): use one of "
                             f"{list(fp8.AMAX_ALGOS)}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"QuantizedParamGather(margin={self.margin!r}): an integer >= 0")
        if self.quantize is not None and not callable(self.quantize):
            raise TypeError("QuantizedParamGather.quantize must be a callable (name, param) -> bool, or None")

    @property
    def per_tensor(self) -> bool:
        """One scale per tensor (tensorwise, delayed), as opposed to block scales (mxfp8)."""
        return self.recipe != "mxfp8"

    @property
    def block(self) -> int:
        """Elements per scale block along the last dimension (0: per tensor)."""
        return fp8.MX_BLOCK if self.recipe == "mxfp8" else 0

    @property
    def format(self) -> fp8.Fp8Format:
        return fp8.fp8_format(self.fmt)

"""Which weights megatron.fsdp gathers in FP8 under ``--fp8-param-gather``, and with which recipe.

``fp8_param_gather(config, ddp_config, module)`` is ``MixedPrecision``'s ``param_gather`` for one
model chunk (``DistributedDataParallelConfig.fp8_param_gather``, Megatron-Core's field for the flag):

* the CPU FP8 layers (``mcore_cpu/fp8_linears.py``): their GEMM weights, with the recipe they were built with;
  the layers then compute with ``megatron.fsdp.quantized_weight`` (the gathered FP8 bytes and scales);
* Transformer Engine's layers (``config.fp8``, a GPU with TE): the weights of every TE module, with
  ``config``'s recipe. The TE layers compute from the compute weight the engine builds from the
  gathered bytes (their dequantization, which TE's quantizer maps back to the same FP8 values:
  exactly for MXFP8's power-of-two block scales, up to the scale's last bit per tensor). Not verified
  until a GPU run (docs/precision.md, "FP8").

Blockwise scaling is not gathered in FP8 (a 128 x 128 tile spans rows a shard boundary may split).
"""

from __future__ import annotations

import re
from typing import Optional, Set

import torch

import megatron.fsdp as mfsdp

from megatron.fsdp.mcore_cpu.fp8_linears import _Fp8Linear

_TE_WEIGHT = re.compile(r"weight\d*")  # TE's GEMM weights: ``weight``, grouped GEMMs' ``weight0`` ...


def _cpu_fp8_weights(module: torch.nn.Module):
    layers = [m for m in module.modules() if isinstance(m, _Fp8Linear)]
    return layers, {id(m.weight) for m in layers}


def _te_weights(module: torch.nn.Module) -> Set[int]:
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    return {id(p) for m in module.modules() if isinstance(m, TransformerEngineBaseModule)
            for name, p in m.named_parameters(recurse=False) if _TE_WEIGHT.fullmatch(name) and p.requires_grad}


def fp8_param_gather(config, ddp_config, module: torch.nn.Module) -> Optional[mfsdp.QuantizedParamGather]:
    """``MixedPrecision.param_gather`` for ``fully_shard``: a ``QuantizedParamGather``, or None without FP8
    gathers."""
    layers, ids = _cpu_fp8_weights(module)
    asked = bool(getattr(ddp_config, "fp8_param_gather", False))
    gathered_by_layers = sorted({layer.fp8_recipe.param_gather for layer in layers})
    if gathered_by_layers == [True] and not asked or (asked and gathered_by_layers == [False]):
        raise ValueError("the FP8 layers' recipe and DistributedDataParallelConfig.fp8_param_gather disagree on "
                         "whether megatron.fsdp gathers their weights in FP8: build both from --fp8-param-gather")
    if not asked:
        return None
    if layers:
        recipe = layers[0].fp8_recipe
        name, history, algo, margin = recipe.recipe, recipe.amax_history_len, recipe.amax_compute_algo, recipe.margin
    elif getattr(config, "fp8", None):
        ids = _te_weights(module)
        name, history = str(getattr(config.fp8_recipe, "value", config.fp8_recipe)), config.fp8_amax_history_len
        algo, margin = config.fp8_amax_compute_algo, config.fp8_margin
    else:
        raise ValueError("DistributedDataParallelConfig.fp8_param_gather=True but the model has no FP8 layers: "
                         "train with --fp8-format (Transformer Engine's layers, or the CPU FP8 layers)")
    return mfsdp.QuantizedParamGather(
        recipe=name, fmt="e4m3", amax_history_len=history, amax_compute_algo=algo, margin=margin,
        quantize=lambda _name, param: id(param) in ids)

"""``--moe-token-dispatcher-type flex``, ``--moe-permute-fusion`` and ``--moe-grouped-gemm`` where their kernels are missing.

DeepSeek-V3's script asks for the flex dispatcher (DeepEP / HybridEP kernels) and Transformer Engine's
fused permutation. Both only choose kernels: the same tokens reach the same experts with the same
weights. Where the kernels are absent the job runs the alltoall dispatcher and the unfused
permutation, says so in the start-up substitution line (``moe_dispatcher_substitutions``, listed in
``substitutions.PROVIDERS``), and builds the TransformerConfig from the same decision
(``dispatcher_settings``), so what is said and what runs cannot differ. ``--moe-grouped-gemm`` on
Megatron-Core 0.17+ without Transformer Engine builds Megatron-Core's ``SequentialMLP`` (the local
spec's choice, the same mathematics): said in the same line.
"""

from __future__ import annotations

import argparse
from typing import List

from .architecture import FLEX_BACKEND_MODULES
from .arguments.substitution_record import Substitution
from .compat import HAS_LEGACY_GROUPED_MLP, MCORE_VERSION_STRING


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False




def _flex_runs_here(args) -> bool:
    import torch

    module = FLEX_BACKEND_MODULES.get(getattr(args, "moe_flex_dispatcher_backend", "deepep"))
    return torch.cuda.is_available() and module is not None and _installed(module)


def _permute_fusion_runs_here() -> bool:
    import torch

    return torch.cuda.is_available() and _installed("transformer_engine")


def moe_dispatcher_substitutions(args: argparse.Namespace) -> List[Substitution]:
    """``--moe-token-dispatcher-type flex`` (DeepEP/HybridEP kernels) -> the alltoall dispatcher, and
    ``--moe-permute-fusion`` (Transformer Engine's kernels) -> the unfused permutation: the same tokens
    reach the same experts with the same weights, only the kernels differ."""
    if getattr(args, "num_experts", None) is None:
        return []
    found = []
    if args.moe_token_dispatcher_type == "flex" and not _flex_runs_here(args):
        backend = args.moe_flex_dispatcher_backend
        found.append(Substitution(f"--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend {backend}",
                                  "alltoall", f"{FLEX_BACKEND_MODULES[backend]} and a GPU are not here"))
    if getattr(args, "moe_permute_fusion", False) and not _permute_fusion_runs_here():
        found.append(Substitution("--moe-permute-fusion", "unfused permute",
                                  "Transformer Engine's fused permute needs it and a GPU"))
    if getattr(args, "moe_grouped_gemm", False) and _local_spec_without_grouped_gemm(args):
        found.append(Substitution("--moe-grouped-gemm", "SequentialMLP (one GEMM per expert)",
                                  f"Megatron-Core {MCORE_VERSION_STRING}'s local layer spec has no grouped GEMM "
                                  "without Transformer Engine"))
    return found


def _local_spec_without_grouped_gemm(args) -> bool:
    """Megatron-Core 0.17+ builds ``SequentialMLP`` for ``moe_grouped_gemm`` in its local spec (the CPU spec, or
    ``--transformer-impl local``); 0.16.1's local spec has ``GroupedMLP`` (compat.HAS_LEGACY_GROUPED_MLP)."""
    import torch

    return not HAS_LEGACY_GROUPED_MLP and (not torch.cuda.is_available()
                                           or getattr(args, "transformer_impl", "transformer_engine") == "local")


def dispatcher_settings(args: argparse.Namespace) -> dict:
    """The TransformerConfig dispatcher fields after the substitutions above (one truth for both)."""
    flex = args.moe_token_dispatcher_type == "flex" and _flex_runs_here(args)
    settings = dict(moe_token_dispatcher_type="flex" if flex else (
        "alltoall" if args.moe_token_dispatcher_type == "flex" else args.moe_token_dispatcher_type),
        moe_permute_fusion=bool(getattr(args, "moe_permute_fusion", False)) and _permute_fusion_runs_here())
    if flex:
        settings["moe_flex_dispatcher_backend"] = args.moe_flex_dispatcher_backend
    return settings

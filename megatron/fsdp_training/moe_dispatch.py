"""``--moe-token-dispatcher-type flex``, ``--moe-permute-fusion`` and ``--moe-grouped-gemm`` where their kernels are missing.

DeepSeek-V3's script asks for the flex dispatcher (DeepEP / HybridEP kernels) and Transformer Engine's
fused permutation. Both only choose kernels: the same tokens reach the same experts with the same
weights. Where the kernels are absent the job runs the alltoall dispatcher and the unfused
permutation, says so in the start-up substitution line (``arguments/moe_flags.py``'s
``dispatcher_substitutions``, which asks the functions below), and builds the TransformerConfig from
the same decision (``dispatcher_settings``), so what is said and what runs cannot differ.
``--moe-grouped-gemm`` on Megatron-Core 0.17+ without Transformer Engine builds Megatron-Core's
``SequentialMLP`` (the local spec's choice, the same mathematics): said in the same line.
"""

from __future__ import annotations

# --moe-flex-dispatcher-backend's choices and the module each needs (Megatron-Core's fused_a2a imports them).
FLEX_BACKEND_MODULES = {"deepep": "deep_ep", "hybridep": "deep_ep", "ncclep": "transformer_engine"}


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def flex_runs_here(backend: str = "deepep") -> bool:
    """Whether ``--moe-flex-dispatcher-backend``'s kernels can run here."""
    import torch

    module = FLEX_BACKEND_MODULES.get(backend)
    return torch.cuda.is_available() and module is not None and _installed(module)


def permute_fusion_runs_here() -> bool:
    import torch

    return torch.cuda.is_available() and _installed("transformer_engine")


def local_spec_without_grouped_gemm(transformer_impl: str = "transformer_engine") -> bool:
    """Megatron-Core 0.17+ builds ``SequentialMLP`` for ``moe_grouped_gemm`` in its local spec (the CPU spec, or
    ``--transformer-impl local``); 0.16.1's local spec has ``GroupedMLP`` (mcore_releases.HAS_LEGACY_GROUPED_MLP)."""
    import torch

    from megatron.fsdp.mcore_releases import HAS_LEGACY_GROUPED_MLP  # Megatron-Core itself: not at import (the parser imports this)

    return not HAS_LEGACY_GROUPED_MLP and (not torch.cuda.is_available()
                                           or transformer_impl == "local")


def dispatcher_settings(dispatcher_type: str, flex_backend: str, permute_fusion: bool) -> dict:
    """The TransformerConfig dispatcher fields after the substitutions (one truth for both): from
    ``--moe-token-dispatcher-type``, ``--moe-flex-dispatcher-backend`` and ``--moe-permute-fusion``."""
    flex = dispatcher_type == "flex" and flex_runs_here(flex_backend)
    settings = dict(moe_token_dispatcher_type="flex" if flex else (
        "alltoall" if dispatcher_type == "flex" else dispatcher_type),
        moe_permute_fusion=bool(permute_fusion) and permute_fusion_runs_here())
    if flex:
        settings["moe_flex_dispatcher_backend"] = flex_backend
    return settings

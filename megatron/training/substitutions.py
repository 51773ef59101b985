"""Flags that select a kernel or backend this machine lacks: accepted, substituted, and said once in one line.

A Megatron-LM launch script asks for Transformer Engine, flash attention, fused kernels, NCCL
features, DeepEP dispatchers. Where the choice only picks a faster implementation of the same
mathematics, the job runs the implementation this machine has and says so once, at start-up,
on rank 0, in one line::

    > substituted on this machine: --use-flash-attn -> PyTorch SDPA (flash-attn not installed); ...

A flag that would change the mathematics is not substituted: ``validate_args`` refuses it with
one line instead. Each group of flags states its own substitutions (a provider: a function of the
parsed arguments returning ``Substitution`` values); ``PROVIDERS`` lists them, so the one line is
assembled in one place.
"""

from __future__ import annotations

import argparse
from typing import Callable, List, Tuple

from .compat_args import compat_substitutions
from .profiling import profiling_substitutions
from .substitution_record import Substitution


Provider = Callable[[argparse.Namespace], List[Substitution]]


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# The modules each flex-dispatcher backend needs (Megatron-Core's fused_a2a imports them).
FLEX_BACKEND_MODULES = {"deepep": "deep_ep", "hybridep": "deep_ep", "ncclep": "transformer_engine"}


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
    return found


def dispatcher_settings(args: argparse.Namespace) -> dict:
    """The TransformerConfig dispatcher fields after the substitutions above (one truth for both)."""
    flex = args.moe_token_dispatcher_type == "flex" and _flex_runs_here(args)
    settings = dict(moe_token_dispatcher_type="flex" if flex else (
        "alltoall" if args.moe_token_dispatcher_type == "flex" else args.moe_token_dispatcher_type),
        moe_permute_fusion=bool(getattr(args, "moe_permute_fusion", False)) and _permute_fusion_runs_here())
    if flex:
        settings["moe_flex_dispatcher_backend"] = args.moe_flex_dispatcher_backend
    return settings


PROVIDERS: Tuple[Provider, ...] = (compat_substitutions, profiling_substitutions, moe_dispatcher_substitutions)


def substitutions(args: argparse.Namespace, providers: Tuple[Provider, ...] = None) -> List[Substitution]:
    """Every substitution the parsed arguments need on this machine, in the providers' order."""
    return [s for provider in (PROVIDERS if providers is None else providers) for s in provider(args)]


def substitution_line(args: argparse.Namespace, providers: Tuple[Provider, ...] = None) -> str:
    """The one start-up line (empty when nothing is substituted)."""
    found = substitutions(args, providers)
    return "> substituted on this machine: " + "; ".join(map(str, found)) if found else ""

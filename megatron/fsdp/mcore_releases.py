"""Every difference between the Megatron-Core releases the adapter supports (0.16.1 to 0.19.x), in one place.

The adapter reads Megatron-Core's changing surface only through the names below, so each
difference is decided once, by the installed release (``MCORE_VERSION``, read from the package
metadata once per process), and a new release means editing this file, not hunting for
``try/except ImportError`` across the code. Each entry names the release that changed it. The
training job's own differences (tokenizer base, context-parallel split, MoE metrics, torch_dist
checkpoints, batch-size ramp-up) are in ``megatron/fsdp_training/compat.py``, which reads the
version from here; the tools and the tests use the two modules too.

What is the same on every release, by construction: a checkpoint's logical keys. Megatron-Core
0.17 renamed the multi-token prediction layer's attribute (``transformer_layer`` ->
``mtp_model_layer``); its own ``sharded_state_dict`` still writes ``transformer_layer``, and so does
this adapter (``CHECKPOINT_MTP_LAYER``), so a checkpoint saved under one release loads under the other.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Optional, Tuple

import torch


def _parse(version: str) -> Tuple[int, int, int]:
    """``"0.19.2"``, ``"0.20.0rc1"``, ``"0.16.1+local"`` -> ``(major, minor, patch)``."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise RuntimeError(f"megatron-core reports version {version!r}, which megatron.fsdp cannot read")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


MCORE_VERSION_STRING = importlib.metadata.version("megatron-core")
MCORE_VERSION: Tuple[int, int, int] = _parse(MCORE_VERSION_STRING)


def at_least(version: str) -> bool:
    """True when the installed Megatron-Core is ``version`` or newer."""
    return MCORE_VERSION >= _parse(version)


# --------------------------------------------------------------------------- MoE experts
# 0.17.0 removed ``moe.grouped_gemm_util`` and the legacy ``experts.GroupedMLP``; the local spec
# builds ``SequentialMLP`` for ``moe_grouped_gemm=True`` (TEGroupedMLP remains, with Transformer Engine).
HAS_LEGACY_GROUPED_MLP = not at_least("0.17.0")

# --------------------------------------------------------------------------- Megatron-LM's trainer
# 0.17.0 ships Megatron-LM's ``megatron/training`` in the wheel (Python >= 3.12): ``megatron_lm.py`` runs it.
HAS_MEGATRON_TRAINING = at_least("0.17.0")


def legacy_grouped_mlp_class() -> Optional[type]:
    """0.16.1's ``GroupedMLP`` (``weight1``/``weight2`` holding every local expert); None from 0.17.0."""
    if not HAS_LEGACY_GROUPED_MLP:
        return None
    from megatron.core.transformer.moe.experts import GroupedMLP

    return GroupedMLP


def grouped_gemm_util():
    """0.16.1's ``moe.grouped_gemm_util`` (CPU mode gives it a per-expert matmul loop); None from 0.17.0."""
    if not HAS_LEGACY_GROUPED_MLP:
        return None
    from megatron.core.transformer.moe import grouped_gemm_util as module

    return module


# --------------------------------------------------------------------------- optimizer config
# 0.18.0 renamed ``OptimizerConfig.muon_use_nesterov`` to ``muon_nesterov``.
MUON_NESTEROV_FIELD = "muon_nesterov" if at_least("0.18.0") else "muon_use_nesterov"


def muon_nesterov(config) -> bool:
    """The Nesterov switch of Muon in an ``OptimizerConfig``, under this release's field name."""
    return bool(getattr(config, MUON_NESTEROV_FIELD))


# 0.17.0 added ``OptimizerConfig.muon_coefficient_type`` (Megatron-LM's ``--muon-coefficient-type``, default
# "quintic"); 0.16.1's config has no such field, so a caller sets it as an attribute of the config there.
MUON_COEFFICIENT_TYPE_IS_FIELD = at_least("0.17.0")


def muon_coefficient_type(config) -> str:
    """The Newton-Schulz coefficient set of Muon in an ``OptimizerConfig`` (the field, or before 0.17.0 the
    attribute the caller set; "quintic", Megatron-LM's default, when neither)."""
    return getattr(config, "muon_coefficient_type", "quintic")


# --------------------------------------------------------------------------- multi-token prediction
# 0.17.0 renamed ``MultiTokenPredictionLayer.transformer_layer`` to ``mtp_model_layer``; checkpoints keep
# ``transformer_layer`` (Megatron-Core's own sharded_state_dict maps it back, and so do this adapter's keys).
MTP_LAYER_ATTRIBUTE = "mtp_model_layer" if at_least("0.17.0") else "transformer_layer"
CHECKPOINT_MTP_LAYER = "transformer_layer"


def mtp_inner_layer(mtp_layer: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The transformer layer inside one ``MultiTokenPredictionLayer``."""
    return getattr(mtp_layer, MTP_LAYER_ATTRIBUTE, None)


# --------------------------------------------------------------------------- tied embedding on meta
# 0.17.0: ``LanguageModule.setup_embeddings_and_output_layer`` skips the all-reduce that makes a
# pipeline-split tied output layer equal to the embedding when ``config.init_model_with_meta_device``
# (0.16.1 ran it on the meta tensors); whoever materialises the model must run it.
TIED_EMBEDDING_SYNC_RUNS_ON_META = not at_least("0.17.0")


# --------------------------------------------------------------------------- finalize_model_grads
# Reductions that Megatron-Core's ``finalize_model_grads`` gained and this adapter's does not run, so a
# config that switches them on is refused (``FullyShardedDataParallel``): 0.18.0 the flextron router
# all-reduce (``flextron``); 0.19.0 GTP weight rematerialisation (``gtp_weight_remat_size``,
# ``expert_gtp_weight_remat_size`` > 1) and quantile balancing's ``qb_beta`` update
# (``moe_router_load_balancing_type="quantile_balancing"``). The fields do not exist before those releases.
def finalize_features_not_supported(config) -> list:
    """The ``TransformerConfig`` settings (``"field=value"``) whose gradient reductions megatron.fsdp lacks."""
    found = []
    if getattr(config, "flextron", False):
        found.append("flextron=True")
    for field in ("gtp_weight_remat_size", "expert_gtp_weight_remat_size"):
        if (getattr(config, field, 1) or 1) > 1:
            found.append(f"{field}={getattr(config, field)}")
    if getattr(config, "moe_router_load_balancing_type", None) == "quantile_balancing":
        found.append("moe_router_load_balancing_type='quantile_balancing'")
    return found


__all__ = [
    "CHECKPOINT_MTP_LAYER", "HAS_LEGACY_GROUPED_MLP", "MCORE_VERSION", "MCORE_VERSION_STRING", "MTP_LAYER_ATTRIBUTE",
    "MUON_COEFFICIENT_TYPE_IS_FIELD", "MUON_NESTEROV_FIELD", "TIED_EMBEDDING_SYNC_RUNS_ON_META", "at_least",
    "finalize_features_not_supported", "grouped_gemm_util", "legacy_grouped_mlp_class", "mtp_inner_layer",
    "muon_coefficient_type", "muon_nesterov",
]

"""Every difference between the Megatron-Core releases this project supports (0.16.1 to 0.19.x), in one place.

The adapter, the CPU emulation (``megatron.fsdp.mcore_cpu``), the training job, its tools and its tests read
Megatron-Core's changing surface only through the names below, so each difference is decided once, by the
installed release (``MCORE_VERSION``, read from the package metadata once per process), and a new release
means editing this file, not hunting for ``try/except ImportError`` across the code. Each entry names the
release that changed it. It sits beside the adapter package, not in it, so that importing it does not
import the adapter (the CPU emulation and the job's leaves need the version without the adapter).

What is the same on every release, by construction: a checkpoint's logical keys. Megatron-Core
0.17 renamed the multi-token prediction layer's attribute (``transformer_layer`` ->
``mtp_model_layer``); its own ``sharded_state_dict`` still writes ``transformer_layer``, and so does
this adapter (``CHECKPOINT_MTP_LAYER``), so a checkpoint saved under one release loads under the other.
A checkpoint of either job format saved under one release loads under the other too: ``fsdp_dtensor``
keys are the adapter's, and ``torch_dist``'s common state is read here (``read_torch_dist_common``,
``torch_dist_load``) wherever the saving release put it.
"""

from __future__ import annotations

import importlib.metadata
import io
import os
import re
from typing import Any, Dict, Optional, Tuple

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


# --------------------------------------------------------------------------- tokenizers
# 0.17.0 removed ``megatron.core.datasets.megatron_tokenizer`` (the legacy tokenizer base class,
# ``MegatronLegacyTokenizer``); the datasets only read ``.vocab_size``, ``.eod`` (and ``.pad`` when present).
HAS_LEGACY_TOKENIZER_BASE = not at_least("0.17.0")


def tokenizer_base() -> type:
    """The base class of the job's tokenizers: Megatron-Core's legacy interface where it exists, else ``object``."""
    if HAS_LEGACY_TOKENIZER_BASE:
        from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

        return MegatronLegacyTokenizer
    return object


# The checkpoint keys of ``--moe-grouped-gemm`` experts follow the module (0.17.0 above): GroupedMLP's
# ``mlp.experts.weight1/weight2`` before 0.17, ``mlp.experts.local_experts.{e}.linear_fc1/2.weight`` from 0.17.
_GROUPED_KEY = re.compile(r"\.mlp\.experts\.weight\d+$")
_PER_EXPERT_KEY = ".mlp.experts.local_experts."


def expert_layout_hint(missing, unexpected) -> str:
    """The sentence a key-mismatch error adds when the only difference is how the release lays out
    ``--moe-grouped-gemm`` experts (``missing``: keys the model asks for, ``unexpected``: keys only the
    checkpoint has); empty otherwise."""
    def grouped(keys):
        return any(_GROUPED_KEY.search(k) for k in keys)

    def per_expert(keys):
        return any(_PER_EXPERT_KEY in k for k in keys)

    if grouped(unexpected) and per_expert(missing):
        return (f" (its experts are GroupedMLP's weight1/weight2, written by --moe-grouped-gemm under Megatron-Core "
                f"0.16; Megatron-Core {MCORE_VERSION_STRING} removed GroupedMLP and builds one weight per expert: "
                "resume this checkpoint under megatron-core 0.16.1)")
    if grouped(missing) and per_expert(unexpected):
        return (" (its experts are one weight per expert, SequentialMLP's, as Megatron-Core 0.17 and later build "
                f"--moe-grouped-gemm without Transformer Engine; Megatron-Core {MCORE_VERSION_STRING} builds GroupedMLP: "
                "resume this checkpoint under megatron-core 0.17 or later)")
    return ""


# --------------------------------------------------------------------------- context parallelism
# 0.18.0: ``get_batch_on_this_cp_rank(batch, is_hybrid_cp, cp_group=None, ...)``, where ``cp_group=None``
# means the *world* group (0.16.1: ``(batch, cp_group=None)``, None meaning parallel_state's CP group).
# A call without a group would split every batch across all ranks: the group is always passed here.
CP_SPLIT_TAKES_HYBRID_FLAG = at_least("0.18.0")


def batch_on_this_cp_rank(batch: Dict[str, Any], cp_group) -> Dict[str, Any]:
    """This CP rank's load-balanced sequence chunks of ``batch`` (Megatron-Core's split); ``cp_group`` required."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    if cp_group is None:
        raise ValueError("batch_on_this_cp_rank needs the context-parallel group (from Megatron-Core 0.18 "
                         "None means the world group)")
    if CP_SPLIT_TAKES_HYBRID_FLAG:
        return get_batch_on_this_cp_rank(batch, False, cp_group=cp_group)
    return get_batch_on_this_cp_rank(batch, cp_group=cp_group)


# --------------------------------------------------------------------------- MoE metrics
# 0.18.0: the router's losses live in a ``MoEMetricsTracker`` (``moe_logging``); the legacy
# ``get_moe_layer_wise_logging_tracker()`` returns a *copy* (entries added to it are lost),
# ``track_moe_metrics`` is deprecated and returns a string, and ``clear()`` only zeroes the
# entries, which keep their process groups.
HAS_MOE_METRICS_TRACKER = at_least("0.18.0")


def report_moe_metrics(names, loss_scale: float, num_layers: int, moe_layer_freq, mtp_num_layers,
                       device: torch.device) -> Dict[str, torch.Tensor]:
    """Reduce this iteration's router losses ``names`` over the ranks (Megatron-LM's ``track_moe_metrics``; the
    entries are created first on every rank, so every rank runs the same collectives), average them over the
    MoE layers, clear the tracker; returns ``{name: tensor}``. A collective: every rank, every iteration."""
    totals: Dict[str, torch.Tensor] = {}
    layers = num_layers + (mtp_num_layers or 0)
    if HAS_MOE_METRICS_TRACKER:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        tracker = get_moe_metrics_tracker()
        for name in names:
            tracker.ensure_initialized(name, layers, device=device)
        tracker.report(loss_scale=loss_scale, iteration=0, track_names=list(names), num_layers=num_layers,
                       moe_layer_freq=moe_layer_freq, mtp_num_layers=mtp_num_layers, total_loss_dict=totals)
        return totals
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    for name in names:
        if name not in tracker:
            tracker[name] = {"values": torch.zeros(layers, device=device), "reduce_group": None,
                             "avg_group": None, "reduce_group_has_dp": False}
    moe_utils.track_moe_metrics(loss_scale=loss_scale, iteration=0, total_loss_dict=totals, track_names=list(names),
                                num_layers=num_layers, moe_layer_freq=moe_layer_freq, mtp_num_layers=mtp_num_layers)
    return totals


def drop_moe_metrics() -> None:
    """Forget every tracked router metric and the process groups it holds (a process that runs many cases)."""
    if HAS_MOE_METRICS_TRACKER:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

        destroy_moe_metrics_tracker()
    else:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()


# --------------------------------------------------------------------------- torch_dist checkpoints
# 0.17.0 renamed ``FileSystemWriterAsync.write_preloaded_data_multiproc`` to ``..._multithread`` (same
# arguments) and dropped ``dist_checkpointing.save``'s ``common_strategy``.
TORCH_DIST_BUCKET_WRITER = "write_preloaded_data_multithread" if at_least("0.17.0") else "write_preloaded_data_multiproc"
# 0.19.0 stores the common (non-tensor) state as one ``ShardedObject`` "common_state" inside the DCP files
# instead of ``common.pt`` (and still reads ``common.pt``); 0.16.1 reads only ``common.pt``.
COMMON_PT = "common.pt"
COMMON_STATE_KEY = "common_state/shard_0_1"  # ShardedObject("common_state", ..., (1,), (0,)).unique_key
COMMON_STATE_IN_DCP = at_least("0.19.0")


def read_torch_dist_common(directory) -> Dict[str, Any]:
    """The common state of a torch_dist checkpoint saved by any supported release (``args`` needs
    ``argparse.Namespace`` allowed in ``torch.load``'s weights-only unpickler)."""
    path = os.path.join(str(directory), COMMON_PT)
    if os.path.isfile(path):
        return torch.load(path, map_location="cpu", weights_only=True)
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: Dict[str, Any] = {COMMON_STATE_KEY: io.BytesIO()}
    _load_state_dict(state, storage_reader=FileSystemReader(str(directory)), no_dist=True)
    loaded = state[COMMON_STATE_KEY]
    if isinstance(loaded, io.BytesIO):
        loaded.seek(0)
        loaded = torch.load(loaded, map_location="cpu", weights_only=True)
    return loaded[0]


def torch_dist_common_place(directory) -> str:
    """Where a torch_dist checkpoint keeps its common state, for messages: its ``common.pt``, or (saved by 0.19.0
    or later) the ``common_state`` entry of its DCP files."""
    path = os.path.join(str(directory), COMMON_PT)
    return path if os.path.isfile(path) else f"the common_state in {directory}'s DCP files"


def torch_dist_load(sharded_state: Dict[str, Any], directory) -> Dict[str, Any]:
    """``dist_checkpointing.load`` of a checkpoint saved by any supported release: before 0.19.0 the common
    state is read by ``read_torch_dist_common`` (a 0.19 checkpoint has no ``common.pt``)."""
    from megatron.core import dist_checkpointing

    if COMMON_STATE_IN_DCP:
        return dist_checkpointing.load(sharded_state, str(directory))
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class _EitherCommonLayout(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return read_torch_dist_common(checkpoint_dir)

    return dist_checkpointing.load(sharded_state, str(directory), common_strategy=_EitherCommonLayout())


# --------------------------------------------------------------------------- batch-size ramp-up
# 0.18.0 removed ``num_microbatches_calculator.RampupBatchsizeNumMicroBatchesCalculator`` (Megatron-LM's
# ``--rampup-batch-size``; the job computes its own schedule, batch_rampup.py).
HAS_RAMPUP_CALCULATOR = not at_least("0.18.0")



__all__ = [
    "CHECKPOINT_MTP_LAYER", "COMMON_PT", "COMMON_STATE_IN_DCP", "CP_SPLIT_TAKES_HYBRID_FLAG", "HAS_LEGACY_GROUPED_MLP",
    "HAS_LEGACY_TOKENIZER_BASE", "HAS_MEGATRON_TRAINING", "HAS_MOE_METRICS_TRACKER", "HAS_RAMPUP_CALCULATOR",
    "MCORE_VERSION", "MCORE_VERSION_STRING", "MTP_LAYER_ATTRIBUTE", "MUON_COEFFICIENT_TYPE_IS_FIELD",
    "MUON_NESTEROV_FIELD", "TIED_EMBEDDING_SYNC_RUNS_ON_META", "TORCH_DIST_BUCKET_WRITER", "at_least",
    "batch_on_this_cp_rank", "drop_moe_metrics", "expert_layout_hint", "finalize_features_not_supported",
    "grouped_gemm_util", "legacy_grouped_mlp_class", "mtp_inner_layer", "muon_coefficient_type", "muon_nesterov",
    "read_torch_dist_common", "report_moe_metrics", "tokenizer_base", "torch_dist_common_place", "torch_dist_load",
]

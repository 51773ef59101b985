"""The training job's differences between the Megatron-Core releases it supports (0.16.1 to 0.19.x), in one place.

The job, its tools and its tests call the parts of Megatron-Core that changed between releases
only through the names below; each names the release that changed it. The release is read once,
by the adapter's compatibility module (``megatron/fsdp/mcore/compat.py``, which also holds the
adapter's own differences: experts, Muon's config field, multi-token prediction, meta-device
init, ``finalize_model_grads``).

What a user keeps across releases: a checkpoint of either format saved under one release loads
under the other. ``fsdp_dtensor`` keys are the adapter's (release-independent); ``torch_dist`` keeps its
common state in ``common.pt`` before 0.19.0 and inside the DCP files from 0.19.0, and both are read
here (``read_torch_dist_common``, ``torch_dist_load``) whichever release saved them.
"""

from __future__ import annotations

import io
import os
import re
from typing import Any, Dict

import torch

from megatron.fsdp.mcore.compat import (  # noqa: F401  (the version and the adapter's differences, re-exported)
    HAS_LEGACY_GROUPED_MLP, HAS_MEGATRON_TRAINING, MCORE_VERSION, MCORE_VERSION_STRING, MUON_COEFFICIENT_TYPE_IS_FIELD, MUON_NESTEROV_FIELD,
    at_least, legacy_grouped_mlp_class,
)

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


# --------------------------------------------------------------------------- pickled tensors
# 0.18.0 replaces ``torch.storage._load_from_bytes`` with ``megatron.core.safe_globals.safe_load_from_bytes`` when
# it is imported, so a tensor pickled with ``pickle`` (not ``torch.save``) under 0.18+ names that function, which
# 0.16.1 lacks: the unpickling fails there. What the job pickles into a checkpoint (each rank's RNG states) holds
# NumPy arrays instead (``portable``), which every release reads; ``as_tensor`` turns them back (a tensor that an
# older checkpoint pickled passes through).
def portable(value):
    """``value`` with every tensor in it (in dicts, lists, tuples) replaced by a NumPy copy."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(portable(v) for v in value)
    return value


def as_tensor(value):
    """A tensor of ``portable``'s NumPy array (a tensor or None as it is)."""
    import numpy as np

    return torch.from_numpy(value.copy()) if isinstance(value, np.ndarray) else value


# --------------------------------------------------------------------------- batch-size ramp-up
# 0.18.0 removed ``num_microbatches_calculator.RampupBatchsizeNumMicroBatchesCalculator`` (Megatron-LM's
# ``--rampup-batch-size``; the job computes its own schedule, schedule.py).
HAS_RAMPUP_CALCULATOR = not at_least("0.18.0")


__all__ = [
    "COMMON_PT", "COMMON_STATE_IN_DCP", "CP_SPLIT_TAKES_HYBRID_FLAG", "HAS_LEGACY_GROUPED_MLP", "HAS_MEGATRON_TRAINING",
    "HAS_LEGACY_TOKENIZER_BASE", "HAS_MOE_METRICS_TRACKER", "HAS_RAMPUP_CALCULATOR", "MCORE_VERSION",
    "MCORE_VERSION_STRING", "MUON_COEFFICIENT_TYPE_IS_FIELD", "MUON_NESTEROV_FIELD", "TORCH_DIST_BUCKET_WRITER",
    "at_least", "batch_on_this_cp_rank", "as_tensor", "drop_moe_metrics", "expert_layout_hint", "legacy_grouped_mlp_class", "portable",
    "read_torch_dist_common", "report_moe_metrics", "tokenizer_base", "torch_dist_common_place", "torch_dist_load",
]

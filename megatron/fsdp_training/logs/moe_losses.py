"""The MoE router's auxiliary losses in the log, as Megatron-LM's ``training_log`` reports them.

Megatron-Core's routers add each layer's load-balancing (and z-) loss to a process-wide
tracker during the forward; Megatron-LM reduces it across ranks once per iteration
(``track_moe_metrics``), averages it over the MoE layers and the micro-batches, and
prints it next to ``lm loss``. This module does the same, so a user sees whether the
experts are balanced. The tracker entries are created up front on every rank, so the
reduction is the same collective everywhere (Megatron-LM's ``force_initialize``).
"""

from __future__ import annotations

from typing import Dict

import torch

from .aux_loss_config import AuxLossConfig


def moe_aux_losses(config: AuxLossConfig, device: torch.device) -> Dict[str, float]:
    """This iteration's auxiliary losses, averaged over MoE layers and micro-batches; clears the tracker.

    A collective over the pipeline and data-parallel groups: call it on every rank, every iteration.
    """
    names = list(config.moe_loss_names)
    if not names:
        return {}
    from megatron.fsdp.mcore_releases import report_moe_metrics

    # The routers of MTP layers log after the decoder's (Megatron-Core's tracker holds both): every
    # pipeline stage needs the same length, since the reduction sums the stages' tensors.
    totals = report_moe_metrics(names, 1.0 / config.num_micro_batches, config.num_layers, config.moe_layer_freq,
                                config.mtp_num_layers, device)
    return {name: float(totals[name]) for name in names if name in totals}


def mtp_losses(config: AuxLossConfig, device: torch.device) -> Dict[str, float]:
    """This iteration's multi-token prediction losses, ``mtp_1 loss`` ... as Megatron-LM logs them
    (``MTPLossLoggingHelper.track_mtp_metrics``: each MTP layer's mean token loss, averaged over the
    data-parallel ranks and the micro-batches); clears the tracker.

    The MTP layers sit on the last pipeline stage: the values come from there, broadcast over the
    pipeline group so every rank (rank 0 prints) has them. Call it on every rank, every iteration.
    """
    layers = config.mtp_num_layers
    if not layers:
        return {}
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    values = torch.zeros(layers, dtype=torch.float64, device=device)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        totals: Dict[str, torch.Tensor] = {}
        MTPLossLoggingHelper.track_mtp_metrics(loss_scale=1.0 / config.num_micro_batches, iteration=0, writer=None,
                                               total_loss_dict=totals)
        for i in range(layers):
            if f"mtp_{i + 1} loss" in totals:
                values[i] = float(totals[f"mtp_{i + 1} loss"])
    dist.broadcast(values, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return {f"mtp_{i + 1} loss": float(values[i]) for i in range(layers)}

"""The MoE router's auxiliary losses in the log, as Megatron-LM's ``training_log`` reports them.

Megatron-Core's routers add each layer's load-balancing (and z-) loss to a process-wide
tracker during the forward; Megatron-LM reduces it across ranks once per iteration
(``track_moe_metrics``), averages it over the MoE layers and the micro-batches, and
prints it next to ``lm loss``. This module does the same, so a user sees whether the
experts are balanced. The tracker entries are created up front on every rank, so the
reduction is the same collective everywhere (Megatron-LM's ``force_initialize``).
"""

from __future__ import annotations

from typing import Dict, List

import torch


def tracked_names(args) -> List[str]:
    """Megatron-LM's names for the losses the router of this run logs (none for a dense model)."""
    if args.num_experts is None:
        return []
    names = []
    balancing = args.moe_router_load_balancing_type
    if args.moe_aux_loss_coeff and balancing == "aux_loss":
        names.append("load_balancing_loss")
    if args.moe_aux_loss_coeff and balancing == "seq_aux_loss":
        names.append("seq_load_balancing_loss")
    if getattr(args, "moe_z_loss_coeff", None):
        names.append("z_loss")
    return names


def moe_aux_losses(args, device: torch.device) -> Dict[str, float]:
    """This iteration's auxiliary losses, averaged over MoE layers and micro-batches; clears the tracker.

    A collective over the pipeline and data-parallel groups: call it on every rank, every iteration.
    """
    names = tracked_names(args)
    if not names:
        return {}
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker, track_moe_metrics

    tracker = get_moe_layer_wise_logging_tracker()
    for name in names:
        if name not in tracker:
            tracker[name] = {"values": torch.zeros(args.num_layers, device=device), "reduce_group": None,
                             "avg_group": None, "reduce_group_has_dp": False}
    totals: Dict[str, torch.Tensor] = {}
    track_moe_metrics(loss_scale=1.0 / args.num_micro_batches, iteration=0, total_loss_dict=totals,
                      track_names=names, num_layers=args.num_layers)
    return {name: float(totals[name]) for name in names if name in totals}

"""Which auxiliary losses the iteration line reports (``AuxLossConfig``): the MoE router's and the MTP layers'."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple


@dataclasses.dataclass(frozen=True)
class AuxLossConfig:
    """The router losses this run logs under Megatron-LM's names, and how ``moe_losses`` averages them."""

    moe_loss_names: Tuple[str, ...]  # none for a dense model
    num_micro_batches: int
    num_layers: int
    moe_layer_freq: object  # an int (every N-th layer) or a list of 0/1 per layer, as Megatron-Core reads it
    mtp_num_layers: Optional[int]

    @classmethod
    def from_args(cls, args) -> "AuxLossConfig":
        names = []  # Megatron-LM's names for the losses the router of this run logs
        if args.num_experts is not None:
            balancing = args.moe_router_load_balancing_type
            if args.moe_aux_loss_coeff and balancing == "aux_loss":
                names.append("load_balancing_loss")
            if args.moe_aux_loss_coeff and balancing == "seq_aux_loss":
                names.append("seq_load_balancing_loss")
            if getattr(args, "moe_z_loss_coeff", None):
                names.append("z_loss")
        return cls(moe_loss_names=tuple(names), num_micro_batches=args.num_micro_batches,
                   num_layers=args.num_layers, moe_layer_freq=args.moe_layer_freq,
                   mtp_num_layers=getattr(args, "mtp_num_layers", None))

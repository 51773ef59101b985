"""The model's shape as ``--log-throughput``'s FLOP count reads it (``ModelSize``), built once after set-up.

After set-up because the output layer's rows are the padded vocabulary, which set-up finds from the tokenizer
(``args.padded_vocab_size``).
"""

from __future__ import annotations

import dataclasses

from ..model_shape import moe_layer_pattern


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """Megatron-LM's ``num_floating_point_operations`` inputs: sizes per layer, layer kinds, sequence, vocabulary."""

    hidden_size: int
    seq_length: int
    num_layers: int
    num_attention_heads: int
    query_groups: int  # --num-query-groups under --group-query-attention, else one per head
    kv_channels: int
    swiglu: bool
    ffn_hidden_size: int  # dense layers
    moe_layers: int  # how many layers are MoE layers (--moe-layer-freq); 0 for a dense model
    moe_router_topk: int
    moe_ffn_hidden_size: int  # one routed expert's
    moe_shared_expert_size: int
    padded_vocab_size: int

    @classmethod
    def from_args(cls, args) -> "ModelSize":
        moe = args.num_experts is not None
        return cls(
            hidden_size=args.hidden_size, seq_length=args.seq_length, num_layers=args.num_layers,
            num_attention_heads=args.num_attention_heads,
            query_groups=args.num_query_groups if args.group_query_attention else args.num_attention_heads,
            kv_channels=args.kv_channels, swiglu=bool(args.swiglu), ffn_hidden_size=args.ffn_hidden_size,
            moe_layers=sum(moe_layer_pattern(args.moe_layer_freq, args.num_layers)) if moe else 0,
            moe_router_topk=args.moe_router_topk if moe else 0,
            moe_ffn_hidden_size=(args.moe_ffn_hidden_size or args.ffn_hidden_size) if moe else 0,
            moe_shared_expert_size=(args.moe_shared_expert_intermediate_size or 0) if moe else 0,
            padded_vocab_size=args.padded_vocab_size)

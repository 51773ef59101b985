"""The model's shape as Megatron-Core takes it: the ``TransformerConfig`` fields of the shape flags (the
``GPTModel`` ones are ``model.ModelBuildConfig``'s).

Llama-, Qwen-, Mistral- and DeepSeek-shaped models (RMSNorm, SwiGLU, rotary embeddings,
grouped-query attention, qk-layernorm, shared experts, dense and MoE layers mixed, multi-latent
attention, multi-token prediction, sigmoid routing) map one to one onto Megatron-Core's fields:
the model code is Megatron-Core's, nothing here builds layers. The flags and their rules are
``arguments/model_flags.py`` and ``arguments/moe_flags.py``; the logs and the checkpoint tools read the MoE
layer pattern from here (docs/training.md, "Llama-class models: the architecture flags").
"""

from __future__ import annotations

from typing import List

# The MLA and MTP fields of (MLA)TransformerConfig, under the flags' own names (Megatron-LM passes them by name).
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
              "rotary_scaling_factor", "mscale", "mscale_all_dim")
ROUTER_FIELDS = ("moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
                 "moe_router_group_topk", "moe_router_num_groups", "moe_router_topk_scaling_factor",
                 "moe_router_dtype", "moe_router_force_load_balancing")


def swiglu_ffn_hidden_size(hidden_size: int) -> int:
    """Megatron-LM's default MLP size under --swiglu: 2/3 of 4 x hidden, rounded down to a multiple of 64."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64


def moe_layer_pattern(moe_layer_freq, num_layers: int) -> List[int]:
    """1 for an MoE layer, 0 for a dense one, per layer (Megatron-Core's reading of ``--moe-layer-freq``: every
    ``freq``-th layer for an int, else the list itself)."""
    if isinstance(moe_layer_freq, int):
        return [1 if i % moe_layer_freq == 0 else 0 for i in range(num_layers)]
    return list(moe_layer_freq)


def transformer_config_fields(args) -> dict:
    """Mapper of the shape flags to their (MLA)TransformerConfig fields (Megatron-LM's core_transformer_config_from_args);
    ``multi_latent_attention`` selects ``MLATransformerConfig`` (model.py), whose RoPE is YaRN, as Megatron-LM's."""
    import torch.nn.functional as F

    fields = dict(
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        kv_channels=args.kv_channels, qk_layernorm=args.qk_layernorm,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        add_qkv_bias=args.add_qkv_bias,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        calculate_per_token_loss=args.calculate_per_token_loss,
    )
    if args.swiglu:
        fields.update(gated_linear_unit=True, activation_func=F.silu)
    if args.num_experts is not None:
        fields.update(moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
                      moe_shared_expert_gate=args.moe_shared_expert_gate,
                      moe_router_pre_softmax=args.moe_router_pre_softmax, moe_layer_freq=args.moe_layer_freq)
    # the DeepSeek flags
    if args.multi_latent_attention:
        fields.update({name: getattr(args, name) for name in MLA_FIELDS}, multi_latent_attention=True,
                      rotary_base=args.rotary_base, rotary_percent=args.rotary_percent)
    if args.mtp_num_layers is not None:
        fields.update(mtp_num_layers=args.mtp_num_layers, mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)
    if args.num_experts is not None:
        fields.update({name: getattr(args, name) for name in ROUTER_FIELDS})
    return fields

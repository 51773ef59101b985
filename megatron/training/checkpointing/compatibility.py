"""What a checkpoint must agree with on the command line before it loads.

The arguments that fix parameter shapes (``MODEL_SHAPE_ARGS``) are recorded in every checkpoint;
one that differs stops the load with a line naming each difference (``save_load.check_model_args``
for ``fsdp_dtensor``, ``torch_dist._check_model`` for the Megatron-Core baseline's format). One
module, so that both formats read the same list without importing each other.
"""

# Arguments that fix parameter shapes: a checkpoint saved with other values cannot load.
MODEL_SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length",
                    "max_position_embeddings", "true_vocab_size", "padded_vocab_size", "num_experts",
                    "moe_ffn_hidden_size", "untie_embeddings_and_output_weights", "add_bias_linear",
                    "moe_grouped_gemm",
                    # DeepSeek-V3 shapes: multi-latent attention's projections, the MTP layers, which layers
                    # are MoE, and the router's expert-bias buffer.
                    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                    "v_head_dim", "mtp_num_layers", "moe_layer_freq", "moe_router_enable_expert_bias")
# Arguments that changed checkpoint keys in layout version 1 (tensor-parallel shards stored per TP rank): recorded,
# free to change at load.
KEY_LAYOUT_ARGS = ("tensor_model_parallel_size", "expert_tensor_parallel_size")

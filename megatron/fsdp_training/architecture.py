"""Model-architecture arguments with Megatron-LM's names, defaults and meanings, and their checks.

These describe Llama-, Qwen-, Mistral- and DeepSeek-shaped models (RMSNorm, SwiGLU,
rotary embeddings, grouped-query attention, qk-layernorm, shared experts, dense and
MoE layers mixed) and map one to one onto Megatron-Core's ``TransformerConfig`` and
``GPTModel`` arguments (``transformer_config_fields``, ``gpt_model_fields``): the
model code is Megatron-Core's, nothing here builds layers.

Validation runs before any process group exists; each inconsistency raises one
``ArgumentError`` naming the arguments and the fix.
"""

from __future__ import annotations

import argparse
import ast
from typing import List, Union

from .errors import ArgumentError

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")


def moe_layer_freq_type(text: str) -> Union[int, List[int]]:
    """Megatron-LM's ``--moe-layer-freq``: an int N (an MoE layer every N layers, starting with
    the first) or a Python list expression of 0/1 per layer, e.g. ``"([0]*1+[1]*3)"``.

    Megatron-LM ``eval``s the expression; this accepts only list literals, integers, ``+``
    and ``*``, so a command line can never run code.
    """
    text = text.strip().strip("'\"")
    if text.lstrip("-").isdigit():
        return int(text)

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(node)

    try:
        result = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        result = None
    if not (isinstance(result, list) and all(type(v) is int for v in result)):
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither an integer nor a list of 0/1 per layer such as '([0]*1+[1]*3)'")
    return result


def add_architecture_args(p: argparse.ArgumentParser) -> None:
    """The architecture flags (Megatron-LM's ``_add_network_size_args`` / ``_add_regularization_args``)."""
    g = p.add_argument_group("model architecture (Megatron-LM's flags: Llama, Qwen, Mistral, DeepSeek shapes)")
    g.add_argument("--normalization", choices=NORMALIZATIONS, default="LayerNorm",
                   help="normalization layer (default: %(default)s; Llama: RMSNorm)")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="epsilon of the norms (default: %(default)s)")
    g.add_argument("--swiglu", action="store_true",
                   help="SwiGLU MLP (gated, SiLU); --ffn-hidden-size then defaults to Megatron-LM's "
                        "int(8 x hidden / 3 / 64) x 64")
    g.add_argument("--position-embedding-type", choices=POSITION_EMBEDDINGS, default="learned_absolute",
                   help="position embeddings (default: %(default)s; Llama: rope)")
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base (default: %(default)s)")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="fraction of each head's channels rotated by RoPE (default: %(default)s)")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups key/value heads")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="key/value heads with --group-query-attention (default: 1, multi-query attention)")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="channels per attention head (default: hidden size / attention heads)")
    g.add_argument("--qk-layernorm", action="store_true", help="normalize queries and keys (--normalization type)")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="biases on the query/key/value projection only, with --disable-bias-linear (Qwen2)")
    g.add_argument("--hidden-dropout", type=float, default=0.1,
                   help="dropout after attention and MLP (default: %(default)s, Megatron-LM's)")
    g.add_argument("--attention-dropout", type=float, default=0.1,
                   help="dropout on the attention probabilities (default: %(default)s, Megatron-LM's)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="average the loss over all tokens of the global batch, not per micro-batch "
                        "then over micro-batches")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="FFN size of the shared expert(s) every token passes (DeepSeek, Qwen-MoE); "
                        "default: none")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="scale the shared expert's output by sigmoid(x . w), a learned per-token gate (Qwen2-MoE)")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before the top-k (weights then sum to under 1); default: "
                        "softmax over the top-k scores")
    g.add_argument("--moe-layer-freq", type=moe_layer_freq_type, default=1,
                   help="MoE layers: every N-th layer from the first (int), or a 0/1 list per layer, "
                        "e.g. '([0]*1+[1]*3)' (default: %(default)s, every layer)")
    add_deepseek_args(p)


def _fail(message: str) -> None:
    raise ArgumentError(message)


def swiglu_ffn_hidden_size(hidden_size: int) -> int:
    """Megatron-LM's default MLP size under --swiglu: 2/3 of 4 x hidden, rounded down to a multiple of 64."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64


def moe_layer_pattern(args) -> List[int]:
    """1 for an MoE layer, 0 for a dense one, per layer (Megatron-Core's reading of moe_layer_freq)."""
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(args.num_layers)]
    return list(freq)


def validate_architecture(args) -> None:
    """Derive Megatron-LM's architecture defaults and check them; called from ``validate_args``
    before the head and MLP sizes are checked (kv-channels relaxes hidden % heads)."""
    tp = args.tensor_model_parallel_size
    heads = args.num_attention_heads
    if args.kv_channels is None:
        if heads < 1 or args.hidden_size % heads:
            _fail(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {heads}; "
                  "change one, or set --kv-channels (channels per head) explicitly")
        args.kv_channels = args.hidden_size // heads
    elif args.kv_channels < 1:
        _fail(f"--kv-channels={args.kv_channels} must be at least 1")
    if args.num_query_groups is not None and not args.group_query_attention:
        _fail("--num-query-groups needs --group-query-attention (without it every head has its own keys "
              "and values)")
    if args.group_query_attention:
        groups = args.num_query_groups = args.num_query_groups or 1
        if groups < 1 or heads % groups:
            _fail(f"--num-query-groups {groups} must divide --num-attention-heads {heads}")
        if groups % tp:
            _fail(f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp}: every "
                  "tensor-parallel rank needs whole key/value groups")
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(args, name)
        if not 0.0 <= value < 1.0:
            _fail(f"--{name.replace('_', '-')}={value} must be in [0, 1)")
    if args.norm_epsilon <= 0:
        _fail(f"--norm-epsilon={args.norm_epsilon} must be positive")
    if args.position_embedding_type == "rope":
        if not 0.0 < args.rotary_percent <= 1.0:
            _fail(f"--rotary-percent={args.rotary_percent} must be in (0, 1]")
        rotated = int(args.kv_channels * args.rotary_percent)
        if rotated < 2 or rotated % 2:
            _fail(f"--rotary-percent {args.rotary_percent} x --kv-channels {args.kv_channels} = {rotated} rotated "
                  "channels per head; RoPE needs an even number of at least 2")
        if args.rotary_base < 1:
            _fail(f"--rotary-base={args.rotary_base} must be positive")
    if args.swiglu and args.ffn_hidden_size is None:
        args.ffn_hidden_size = swiglu_ffn_hidden_size(args.hidden_size)
        if args.ffn_hidden_size < 1:
            _fail(f"--swiglu: the default --ffn-hidden-size for --hidden-size {args.hidden_size} rounds to 0; "
                  "set --ffn-hidden-size")
    _validate_moe_shape(args)
    validate_deepseek(args)


def _validate_moe_shape(args) -> None:
    moe_flags = (args.moe_shared_expert_intermediate_size is not None or args.moe_layer_freq != 1
                 or args.moe_shared_expert_gate or args.moe_router_pre_softmax)
    if args.num_experts is None:
        if moe_flags:
            _fail("--moe-shared-expert-intermediate-size, --moe-shared-expert-gate, --moe-router-pre-softmax "
                  "and --moe-layer-freq need --num-experts")
        return
    shared = args.moe_shared_expert_intermediate_size
    if args.moe_shared_expert_gate and shared is None:
        _fail("--moe-shared-expert-gate gates the shared expert: it needs --moe-shared-expert-intermediate-size")
    if shared is not None and shared < 1:
        _fail(f"--moe-shared-expert-intermediate-size={shared} must be at least 1")
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        if freq < 1:
            _fail(f"--moe-layer-freq={freq} must be at least 1")
    else:
        if len(freq) != args.num_layers or any(v not in (0, 1) for v in freq):
            _fail(f"--moe-layer-freq {freq}: needs one 0 (dense) or 1 (MoE) per layer, "
                  f"{args.num_layers} in all (--num-layers)")
    if not any(moe_layer_pattern(args)):
        _fail(f"--moe-layer-freq {freq} makes no layer an MoE layer; drop --num-experts for a dense model")


def transformer_config_fields(args) -> dict:
    """The TransformerConfig fields these flags set (Megatron-LM's core_transformer_config_from_args)."""
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
    fields.update(deepseek_config_fields(args))
    return fields


def gpt_model_fields(args) -> dict:
    """The GPTModel arguments these flags set."""
    return dict(position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                rotary_base=args.rotary_base)


# ---------------------------------------------------------------- DeepSeek-V3: MLA, MTP, the router

SCORE_FUNCTIONS = ("softmax", "sigmoid")
ROUTER_DTYPES = ("fp32", "fp64")
# --moe-flex-dispatcher-backend's choices and the module each needs (Megatron-Core's fused_a2a imports them).
FLEX_BACKEND_MODULES = {"deepep": "deep_ep", "hybridep": "deep_ep", "ncclep": "transformer_engine"}
# The MLA and MTP fields of (MLA)TransformerConfig, under the flags' own names (Megatron-LM passes them by name).
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
              "rotary_scaling_factor", "mscale", "mscale_all_dim")
ROUTER_FIELDS = ("moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
                 "moe_router_group_topk", "moe_router_num_groups", "moe_router_topk_scaling_factor",
                 "moe_router_dtype", "moe_router_force_load_balancing")


def add_deepseek_args(p: argparse.ArgumentParser) -> None:
    """DeepSeek-V3's flags, Megatron-LM's names and defaults: multi-latent attention (with YaRN RoPE),
    multi-token prediction, sigmoid routing with a learned expert bias, group-limited top-k."""
    g = p.add_argument_group("multi-latent attention and multi-token prediction (Megatron-LM's flags, DeepSeek-V3)")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="multi-latent attention: queries and keys/values through low-rank projections")
    g.add_argument("--q-lora-rank", type=int, default=None,
                   help="rank of the query's low-rank projection (default: none, a full-rank query projection)")
    g.add_argument("--kv-lora-rank", type=int, default=32, help="rank of the keys' and values' low-rank projection")
    g.add_argument("--qk-head-dim", type=int, default=128,
                   help="query/key head dimension without RoPE (the head is --qk-head-dim + --qk-pos-emb-head-dim)")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64, help="query/key head dimension with RoPE")
    g.add_argument("--v-head-dim", type=int, default=128, help="value head dimension")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="YaRN RoPE scaling factor (MLA)")
    g.add_argument("--mscale", type=float, default=1.0, help="YaRN RoPE mscale (MLA)")
    g.add_argument("--mscale-all-dim", type=float, default=0.0, help="YaRN RoPE mscale of all dimensions (MLA)")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="multi-token prediction layers: each predicts one more future token with the main "
                        "model's embedding and output layer (default: none)")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="weight of the MTP loss (the mean over MTP layers) in the training loss")
    g = p.add_argument_group("MoE router and dispatcher (Megatron-LM's flags, DeepSeek-V3)")
    g.add_argument("--moe-router-score-function", choices=SCORE_FUNCTIONS, default="softmax",
                   help="router score function")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: a per-expert bias added to the scores for the top-k choice, "
                        "updated every step from the tokens each expert received (needs sigmoid scores)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="step of the expert-bias update (DeepSeek-V3's value)")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="group-limited routing: groups each token may use (needs --moe-router-num-groups)")
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="group-limited routing: equal groups the experts are divided into")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="scale of the top-k routing weights (default: none, unscaled)")
    g.add_argument("--moe-router-dtype", choices=ROUTER_DTYPES, default=None,
                   help="dtype of routing and of the weighted sum of expert outputs (default: the compute dtype)")
    g.add_argument("--moe-router-force-load-balancing", action="store_true",
                   help="[experimental, benchmarks only] route on random logits, evenly")
    g.add_argument("--moe-flex-dispatcher-backend", choices=tuple(FLEX_BACKEND_MODULES), default="deepep",
                   help="backend of --moe-token-dispatcher-type flex (GPU kernels; substituted by alltoall "
                        "where missing)")
    g.add_argument("--moe-permute-fusion", action="store_true",
                   help="fused token permutation (Transformer Engine kernels; unfused where missing)")


def validate_deepseek(args) -> None:
    """Megatron-LM's and Megatron-Core's rules for MLA, MTP and the router, checked before any process group."""
    if args.multi_latent_attention:
        if args.group_query_attention:
            _fail("--multi-latent-attention and --group-query-attention exclude each other (Megatron-LM's rule): "
                  "MLA compresses keys and values itself")
        for name in ("kv_lora_rank", "qk_head_dim", "v_head_dim", "qk_pos_emb_head_dim"):
            if getattr(args, name) < 1:
                _fail(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
        if args.qk_pos_emb_head_dim % 2:
            _fail(f"--qk-pos-emb-head-dim {args.qk_pos_emb_head_dim} must be even (RoPE rotates channel pairs)")
        if args.q_lora_rank is not None and args.q_lora_rank < 1:
            _fail(f"--q-lora-rank={args.q_lora_rank} must be at least 1 (or left out: a full-rank query)")
        if args.position_embedding_type != "rope":
            _fail("--multi-latent-attention applies its YaRN RoPE to the --qk-pos-emb-head-dim channels: it needs "
                  "--position-embedding-type rope")
    mtp = args.mtp_num_layers
    if mtp is not None:
        if mtp < 1:
            _fail(f"--mtp-num-layers={mtp} must be at least 1 (or left out)")
        if args.position_embedding_type not in ("learned_absolute", "rope", "none"):
            _fail("--mtp-num-layers needs --position-embedding-type learned_absolute, rope or none")
    router = [f for f in ROUTER_FIELDS if getattr(args, f) != _ROUTER_DEFAULTS[f]]
    if args.num_experts is None:
        if router:
            _fail(f"--{router[0].replace('_', '-')} configures the MoE router: it needs --num-experts")
        return
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        _fail("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (Megatron-Core's rule)")
    groups, group_topk = args.moe_router_num_groups, args.moe_router_group_topk
    if group_topk is not None:
        if groups is None:
            _fail("--moe-router-group-topk needs --moe-router-num-groups")
        if not 1 <= group_topk <= groups:
            _fail(f"--moe-router-group-topk {group_topk} must be between 1 and --moe-router-num-groups {groups}")
    if groups is not None:
        if groups < 1 or args.num_experts % groups:
            _fail(f"--moe-router-num-groups {groups} must divide --num-experts {args.num_experts}")
        if group_topk is not None and args.moe_router_topk > group_topk * (args.num_experts // groups):
            _fail(f"--moe-router-topk {args.moe_router_topk} exceeds the experts of {group_topk} groups of "
                  f"{args.num_experts // groups} (--moe-router-group-topk x experts per group)")
    if args.moe_router_bias_update_rate < 0:
        _fail(f"--moe-router-bias-update-rate={args.moe_router_bias_update_rate} must not be negative")


_ROUTER_DEFAULTS = dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
                        moe_router_bias_update_rate=1e-3, moe_router_group_topk=None, moe_router_num_groups=None,
                        moe_router_topk_scaling_factor=None, moe_router_dtype=None,
                        moe_router_force_load_balancing=False)


def deepseek_config_fields(args) -> dict:
    """The (MLA)TransformerConfig fields of the DeepSeek flags; ``multi_latent_attention`` selects
    ``MLATransformerConfig`` (model.py), whose RoPE is YaRN, as Megatron-LM's."""
    fields = {}
    if args.multi_latent_attention:
        fields.update({name: getattr(args, name) for name in MLA_FIELDS}, multi_latent_attention=True,
                      rotary_base=args.rotary_base, rotary_percent=args.rotary_percent)
    if args.mtp_num_layers is not None:
        fields.update(mtp_num_layers=args.mtp_num_layers, mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)
    if args.num_experts is not None:
        fields.update({name: getattr(args, name) for name in ROUTER_FIELDS})
    return fields

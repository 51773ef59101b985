"""How a Megatron-Core GPT with ``--qk-layernorm`` maps onto HuggingFace Qwen3 and Qwen3-MoE.

Qwen3 is Llama's layout (``hf_layouts``: fused QKV split per query group, SwiGLU ``[2, ffn, hidden]``,
non-interleaved RoPE) plus an RMSNorm over each head's channels of q and of k before RoPE:
``self_attn.q_norm`` / ``k_norm``, which is Megatron-Core's ``self_attention.q_layernorm`` /
``k_layernorm`` (``--qk-layernorm``, both over ``--kv-channels``, epsilon ``--norm-epsilon``).
``head_dim`` may differ from hidden / heads (``--kv-channels``). Qwen3 has no biases at all.

Qwen3-MoE: the Qwen2-MoE router (softmax over all experts, top k, renormalized with
``norm_topk_prob``: Megatron's default, ``--moe-router-pre-softmax`` the other) without a shared
expert; dense layers are ``mlp_only_layers`` / ``decoder_sparse_step`` (``--moe-layer-freq``), and
their MLP is ``intermediate_size`` (``--ffn-hidden-size``). The Hub's per-expert names go out;
transformers 5's fused ``mlp.experts.gate_up_proj`` / ``down_proj`` are read too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Tuple

from .hf_layouts import Arch, ConversionError, Rule, _copy, _rope_theta, llama_rules

MODEL_TYPES = ("qwen3", "qwen3_moe")


def rules(model_type: str, a: Arch, fused_experts: bool = False) -> List[Rule]:
    """Llama's (``hf_layouts.llama_rules``, its attention without the norms) plus q_norm / k_norm per layer."""
    out = llama_rules(dataclasses.replace(a, qk_layernorm=False), moe="qwen3_moe" if model_type == "qwen3_moe" else "",
                      fused_experts=fused_experts)
    for i in range(a.num_layers):
        m, h = f"decoder.layers.{i}.self_attention.", f"model.layers.{i}.self_attn."
        out += [_copy(m + "q_layernorm.weight", h + "q_norm.weight"), _copy(m + "k_layernorm.weight", h + "k_norm.weight")]
    return out


def problems(model_type: str, a: Arch) -> List[str]:
    """What ``model_type`` cannot express of ``a`` (each with the flag that fixes it)."""
    out = [f"{model_type} needs {what}" for ok, what in (
        (a.normalization == "RMSNorm", "--normalization RMSNorm"), (a.swiglu, "--swiglu"),
        (a.position_embedding_type == "rope", "--position-embedding-type rope"),
        (a.rotary_percent == 1.0, "--rotary-percent 1.0"), (a.qk_layernorm, "--qk-layernorm (its q_norm/k_norm)"),
        (not a.bias and not a.qkv_bias, "no biases (--disable-bias-linear, no --add-qkv-bias)")) if not ok]
    if model_type == "qwen3" and a.num_experts:
        out.append("qwen3 is dense: use --model-type qwen3_moe for --num-experts")
    if model_type == "qwen3_moe":
        if not a.num_experts:
            out.append("qwen3_moe needs --num-experts")
        if a.shared_expert_size:
            out.append("qwen3_moe has no shared expert (--moe-shared-expert-intermediate-size: use qwen2_moe "
                       "without --qk-layernorm, or deepseek_v3)")
    return out


def hf_config(model_type: str, a: Arch, base: Dict[str, Any]) -> Dict[str, Any]:
    """``config.json``; ``base``: the Llama-family fields every such config has (``hf_layouts.hf_config``'s)."""
    config = dict(base, intermediate_size=a.ffn_hidden_size, attention_bias=False, use_sliding_window=False,
                  sliding_window=None, layer_types=["full_attention"] * a.num_layers)
    if model_type == "qwen3":
        return dict(config, model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    return dict(config, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                moe_intermediate_size=a.moe_ffn_hidden_size, num_experts=a.num_experts,
                num_experts_per_tok=a.moe_router_topk, norm_topk_prob=not a.moe_router_pre_softmax,
                decoder_sparse_step=1, mlp_only_layers=[i for i, v in enumerate(a.moe_layers) if not v],
                output_router_logits=False)


def arch_from_hf(c: Mapping[str, Any]) -> Tuple[str, Arch]:
    model_type = c["model_type"]
    if c.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act {c.get('hidden_act')!r}: SwiGLU needs silu")
    if c.get("attention_bias"):
        raise ConversionError(f"{model_type} with attention_bias: Megatron's --add-qkv-bias has no o_proj bias "
                              "(not converted)")
    heads, layers = c["num_attention_heads"], c["num_hidden_layers"]
    moe: Dict[str, Any] = {}
    if model_type == "qwen3_moe":
        step, dense = c.get("decoder_sparse_step", 1), c.get("mlp_only_layers") or []
        moe = dict(num_experts=c.get("num_experts") or c["num_local_experts"], moe_router_topk=c.get("num_experts_per_tok", 8),
                   moe_ffn_hidden_size=c["moe_intermediate_size"],
                   moe_router_pre_softmax=not c.get("norm_topk_prob", False),
                   moe_layers=tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers)))
    return model_type, Arch(
        num_layers=layers, hidden_size=c["hidden_size"], ffn_hidden_size=c["intermediate_size"],
        num_attention_heads=heads, num_query_groups=c.get("num_key_value_heads") or heads,
        kv_channels=c.get("head_dim") or c["hidden_size"] // heads, vocab_size=c["vocab_size"],
        padded_vocab_size=c["vocab_size"], max_position_embeddings=c["max_position_embeddings"],
        normalization="RMSNorm", norm_epsilon=c.get("rms_norm_eps", 1e-6), swiglu=True,
        position_embedding_type="rope", rotary_base=_rope_theta(c), tied=bool(c.get("tie_word_embeddings", False)),
        bias=False, qk_layernorm=True, **moe)


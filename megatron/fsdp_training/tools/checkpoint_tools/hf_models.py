"""Which HuggingFace architectures ``convert.py to-hf`` / ``from-hf`` know, and which module maps each.

One table, ``FAMILIES``: the model types of ``hf_layouts`` (GPT-2, Llama, Qwen2, Qwen2-MoE,
Mixtral), ``hf_layouts_qwen3`` (Qwen3, Qwen3-MoE) and ``hf_layouts_deepseek`` (DeepSeek-V3).
``hf_convert`` and ``hf_checks`` (what from-hf checks before writing) ask this module, never a
family's module, so a new architecture is one new module and one row here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Collection, Dict, List, Mapping, Tuple

import torch

from . import hf_layouts, hf_layouts_deepseek, hf_layouts_qwen3
from .hf_layouts import Arch, ConversionError, Rule
from .hf_layouts_deepseek import DeepseekArch


@dataclasses.dataclass(frozen=True)
class Family:
    """The functions of one module: tensors, what cannot be exported, config.json, and back."""

    model_types: Tuple[str, ...]
    rules: Callable[..., List[Rule]]  # (model_type, arch, fused_experts, importing)
    problems: Callable[[str, Arch], List[str]]
    hf_config: Callable[[str, Arch, torch.dtype], Dict[str, Any]]
    arch_from_hf: Callable[[Mapping[str, Any], Collection[str]], Tuple[str, Arch]]


FAMILIES = (
    Family(hf_layouts_qwen3.MODEL_TYPES,
           lambda t, a, fused, importing: hf_layouts_qwen3.rules(t, a, fused),
           hf_layouts_qwen3.problems,
           lambda t, a, dtype: hf_layouts_qwen3.hf_config(t, a, hf_layouts.llama_family_config(a, dtype)),
           lambda c, keys: hf_layouts_qwen3.arch_from_hf(c)),
    Family(hf_layouts_deepseek.MODEL_TYPES, hf_layouts_deepseek.rules, hf_layouts_deepseek.problems,
           hf_layouts_deepseek.hf_config, hf_layouts_deepseek.arch_from_hf),
)
MODEL_TYPES = hf_layouts.MODEL_TYPES + tuple(t for f in FAMILIES for t in f.model_types)


def _family(model_type: str):
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def arch_from_args(args: Mapping[str, Any]) -> Arch:
    """Mapper of a checkpoint's recorded arguments (``common.json``'s ``args``, every argument of the saving run)
    to its shape; MLA models carry their extra fields (``DeepseekArch``)."""
    from megatron.fsdp_training.model_shape import moe_layer_pattern

    groups = args["num_query_groups"] if args.get("group_query_attention") else args["num_attention_heads"]
    experts = args.get("num_experts")
    pattern = ()
    if experts:
        freq = args.get("moe_layer_freq", 1)
        if isinstance(freq, str):
            from megatron.fsdp_training.arguments.moe_flags import moe_layer_freq_type

            freq = moe_layer_freq_type(freq)
        pattern = tuple(moe_layer_pattern(freq, args["num_layers"]))
    base = dict(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"], ffn_hidden_size=args["ffn_hidden_size"],
        num_attention_heads=args["num_attention_heads"], num_query_groups=groups,
        kv_channels=args["kv_channels"], vocab_size=args["true_vocab_size"],
        padded_vocab_size=args["padded_vocab_size"], max_position_embeddings=args["max_position_embeddings"],
        normalization=args.get("normalization", "LayerNorm"), norm_epsilon=args.get("norm_epsilon", 1e-5),
        swiglu=bool(args.get("swiglu")),
        position_embedding_type=args.get("position_embedding_type", "learned_absolute"),
        rotary_base=args.get("rotary_base", 10000), rotary_percent=args.get("rotary_percent", 1.0),
        tied=not args.get("untie_embeddings_and_output_weights"), bias=args.get("add_bias_linear", True),
        qk_layernorm=bool(args.get("qk_layernorm")), qkv_bias=bool(args.get("add_qkv_bias")), num_experts=experts,
        moe_router_topk=args.get("moe_router_topk", 2),
        moe_ffn_hidden_size=args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"],
        shared_expert_size=args.get("moe_shared_expert_intermediate_size"), moe_layers=pattern,
        shared_expert_gate=bool(args.get("moe_shared_expert_gate")),
        moe_router_pre_softmax=bool(args.get("moe_router_pre_softmax")),
        moe_grouped_gemm=bool(args.get("moe_grouped_gemm")))
    if not args.get("multi_latent_attention"):
        return Arch(**base)
    return DeepseekArch(**base,
                        q_lora_rank=args.get("q_lora_rank"), kv_lora_rank=args["kv_lora_rank"],
                        qk_head_dim=args["qk_head_dim"], qk_pos_emb_head_dim=args["qk_pos_emb_head_dim"],
                        v_head_dim=args["v_head_dim"], rotary_scaling_factor=args.get("rotary_scaling_factor", 1.0),
                        mscale=args.get("mscale", 1.0), mscale_all_dim=args.get("mscale_all_dim", 0.0),
                        mtp_num_layers=args.get("mtp_num_layers") or 0,
                        score_function=args.get("moe_router_score_function", "softmax"),
                        expert_bias=bool(args.get("moe_router_enable_expert_bias")),
                        num_groups=args.get("moe_router_num_groups"), group_topk=args.get("moe_router_group_topk"),
                        topk_scaling_factor=args.get("moe_router_topk_scaling_factor"),
                        rope_interleave=args.get("rope_interleave", True))


def default_model_type(common: Mapping[str, Any], arch: Arch) -> str:
    """The type a checkpoint came from (from-hf), else the one its shape calls for."""
    saved = common.get("hf", {}).get("model_type")
    if saved:
        return saved
    if isinstance(arch, DeepseekArch):
        return "deepseek_v3"
    if arch.qk_layernorm:
        return "qwen3_moe" if arch.num_experts else "qwen3"
    if arch.num_experts:
        return "qwen2_moe" if arch.shared_expert_size else "mixtral"
    return "qwen2" if arch.qkv_bias else "llama" if arch.swiglu else "gpt2"


def check_exportable(model_type: str, a: Arch) -> None:
    family = _family(model_type)
    if family is None:
        if isinstance(a, DeepseekArch):
            raise ConversionError(f"cannot convert to HuggingFace {model_type}: multi-latent attention has a place "
                                  "in deepseek_v3 only (use --model-type deepseek_v3)")
        return hf_layouts.check_exportable(model_type, a)
    problems = family.problems(model_type, a)
    if problems:
        raise ConversionError(f"cannot convert to HuggingFace {model_type}: " + "; ".join(problems))


def hf_config(model_type: str, a: Arch, dtype: torch.dtype) -> Dict[str, Any]:
    check_exportable(model_type, a)
    family = _family(model_type)
    return hf_layouts.hf_config(model_type, a, dtype) if family is None else family.hf_config(model_type, a, dtype)


def rules_for(model_type: str, a: Arch, fused_experts: bool = False, importing: bool = False) -> List[Rule]:
    """The tensor mapping; ``fused_experts``: transformers 5's MoE names, ``importing``: from-hf's rules
    (which may check tensors that have no Megatron place, such as DeepSeek-V3's MTP copies)."""
    family = _family(model_type)
    if family is None:
        return hf_layouts.rules_for(model_type, a, fused_experts)
    return family.rules(model_type, a, fused_experts, importing)


def arch_from_hf(c: Mapping[str, Any], keys: Collection[str] = ()) -> Tuple[str, Arch]:
    """Model type and Megatron shape of ``config.json`` ``c``; ``keys``: the tensors the files hold."""
    model_type = c.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConversionError(f"model_type {model_type!r} is not converted; supported: {', '.join(MODEL_TYPES)}")
    family = _family(model_type)
    return hf_layouts.arch_from_hf(c) if family is None else family.arch_from_hf(c, keys)


def note(a: Arch, exporting: bool, config: Mapping[str, Any] = None) -> str:
    """One line about what happened to weights transformers has no module for (DeepSeek-V3's MTP); "" if none."""
    if not isinstance(a, DeepseekArch):
        return ""
    declared = hf_layouts_deepseek.mtp_layers_present(config, ())[0] if config else 0
    return hf_layouts_deepseek.mtp_note(a, exporting, declared)

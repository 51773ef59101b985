"""How a DeepSeek-V3-shaped Megatron-Core GPT maps onto HuggingFace ``DeepseekV3ForCausalLM``.

The pieces (Megatron-Core 0.16's TP-1 names; transformers' ``modeling_deepseek_v3``):

- multi-latent attention: ``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj`` are
  ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` (``linear_q_proj`` is ``q_proj`` without
  ``--q-lora-rank``); ``linear_kv_down_proj`` / ``kv_layernorm`` / ``linear_kv_up_proj`` are
  ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``; ``linear_proj`` is ``o_proj``. The
  row orders agree: per head ``[no-RoPE, RoPE]`` for q, ``[latent, RoPE]`` for the kv down projection,
  per head ``[k, v]`` for the kv up projection, and so do the RoPE rows: Megatron-Core's MLA rotates
  channel pairs ``(2j, 2j+1)`` (its ``apply_rotary_pos_emb`` de-interleaves MLA inputs first), as the
  Hub's checkpoints and transformers with ``rope_interleave`` (its default, what ``to-hf`` writes) do.
  A model with ``rope_interleave`` false rotates pairs ``(j, j + d/2)``: ``from-hf`` permutes those rows;
- the latent norms: transformers gives ``q_a_layernorm`` / ``kv_a_layernorm`` epsilon 1e-6 whatever
  ``rms_norm_eps``; Megatron has one ``--norm-epsilon``: it must be 1e-6 (DeepSeek-V3's);
- YaRN RoPE: ``rope_parameters`` ``factor`` / ``mscale`` / ``mscale_all_dim`` are
  ``--rotary-scaling-factor`` / ``--mscale`` / ``--mscale-all-dim``; Megatron-Core fixes
  ``original_max_position_embeddings`` 4096, ``beta_fast`` 32, ``beta_slow`` 1 and rounds the
  correction range (``truncate``); the cos/sin scale is written as ``attention_factor``
  (Megatron-Core's ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``, which transformers
  would otherwise infer differently when ``mscale`` is 0);
- the router: ``mlp.gate.weight`` and ``mlp.gate.e_score_correction_bias`` (``router.expert_bias``,
  ``--moe-router-enable-expert-bias``); sigmoid scores, ``n_group`` / ``topk_group``
  (``--moe-router-num-groups`` / ``--moe-router-group-topk``; transformers scores a group by its top
  2 experts, Megatron-Core by its top ``topk // group_topk``: they agree when that is 2),
  ``routed_scaling_factor`` (``--moe-router-topk-scaling-factor``), ``norm_topk_prob`` (Megatron-Core
  renormalizes sigmoid top-k weights when k > 1); ``first_k_dense_replace`` is ``--moe-layer-freq``
  of k dense layers then MoE ones; ``shared_experts`` of ``n_shared_experts`` x ``moe_intermediate_size``;
- multi-token prediction: transformers' model has no MTP module; the Hub stores MTP layer k as decoder
  layer ``num_hidden_layers + k`` with ``enorm``, ``hnorm``, ``eh_proj`` (``[embedding; hidden]``, as
  Megatron-Core concatenates), ``shared_head.norm`` (``final_layernorm``) and copies of the embedding
  (``embed_tokens``) and output layer (``shared_head.head``). ``to-hf`` writes them so (transformers
  then reports those keys as unexpected and ignores them); ``from-hf`` reads them and checks the two
  copies equal the model's own tensors (Megatron's MTP shares them).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Collection, Dict, List, Mapping, Optional, Tuple

import torch

from .hf_layouts import (Arch, ConversionError, Rule, _copy, _swiglu_mlp_rules, _vocab,
                                         routed_expert_rules)

MODEL_TYPES = ("deepseek_v3",)
# What Megatron-Core's YarnRotaryEmbedding fixes (MLATransformerConfig defaults; the job has no flags for them).
YARN_FIXED = {"original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}
LATENT_NORM_EPSILON = 1e-6  # transformers' DeepseekV3RMSNorm default, used by q_a_layernorm / kv_a_layernorm


@dataclasses.dataclass(frozen=True)
class DeepseekArch(Arch):
    """``Arch`` plus multi-latent attention, YaRN, MTP and the sigmoid group-limited router."""

    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    mtp_num_layers: int = 0
    score_function: str = "softmax"
    expert_bias: bool = False
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    topk_scaling_factor: Optional[float] = None
    rope_interleave: bool = True  # the HuggingFace side's RoPE row layout (the Hub's and Megatron's: interleaved)

    def megatron_flags(self) -> List[str]:
        flags = super().megatron_flags() + ["--multi-latent-attention", "--kv-lora-rank", self.kv_lora_rank,
                                            "--qk-head-dim", self.qk_head_dim,
                                            "--qk-pos-emb-head-dim", self.qk_pos_emb_head_dim,
                                            "--v-head-dim", self.v_head_dim,
                                            "--rotary-scaling-factor", self.rotary_scaling_factor,
                                            "--mscale", self.mscale, "--mscale-all-dim", self.mscale_all_dim]
        flags += ["--q-lora-rank", self.q_lora_rank] if self.q_lora_rank else []
        flags += ["--mtp-num-layers", self.mtp_num_layers] if self.mtp_num_layers else []
        if self.num_experts:
            flags += ["--moe-router-score-function", self.score_function, "--moe-router-dtype", "fp32"]
            flags += ["--moe-router-enable-expert-bias"] * self.expert_bias
            if self.num_groups:
                flags += ["--moe-router-num-groups", self.num_groups, "--moe-router-group-topk", self.group_topk]
            if self.topk_scaling_factor:
                flags += ["--moe-router-topk-scaling-factor", self.topk_scaling_factor]
        return [str(f) for f in flags]

    def as_args(self) -> Dict[str, Any]:
        return dict(super().as_args(), multi_latent_attention=True, q_lora_rank=self.q_lora_rank,
                    kv_lora_rank=self.kv_lora_rank, qk_head_dim=self.qk_head_dim,
                    qk_pos_emb_head_dim=self.qk_pos_emb_head_dim, v_head_dim=self.v_head_dim,
                    rotary_scaling_factor=self.rotary_scaling_factor, mscale=self.mscale,
                    mscale_all_dim=self.mscale_all_dim, mtp_num_layers=self.mtp_num_layers or None,
                    moe_router_score_function=self.score_function, moe_router_enable_expert_bias=self.expert_bias,
                    moe_router_num_groups=self.num_groups, moe_router_group_topk=self.group_topk,
                    moe_router_topk_scaling_factor=self.topk_scaling_factor, rope_interleave=self.rope_interleave)

    @property
    def first_k_dense(self) -> int:
        return len(self.moe_layers) - sum(self.moe_layers)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention scale (Megatron-Core's ``_yarn_get_mscale``, transformers' ``get_mscale``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# ------------------------------------------------------------------------ tensors
def _rope_order(d: int) -> torch.Tensor:
    """Row j of the rotate-half layout (pairs ``(j, j + d/2)``) is row ``order[j]`` of the interleaved one."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def _permute_rope(w: torch.Tensor, rows: int, rope: int, to_hf: bool) -> torch.Tensor:
    """The last ``rope`` of every ``rows`` rows of ``w`` (per head, or the one kv down block): Megatron's
    interleaved order -> rotate-half order (``to_hf``), or back."""
    order = _rope_order(rope)
    x = w.reshape(-1, rows, *w.shape[1:])
    head, tail = x[:, :rows - rope], x[:, rows - rope:]
    tail = tail[:, order] if to_hf else tail[:, torch.argsort(order)]
    return torch.cat([head, tail], 1).reshape(w.shape)


def _rope_rows(a: DeepseekArch, m: str, h: str, rows: int) -> Rule:
    if a.rope_interleave:  # Megatron-Core's own layout
        return _copy(m, h)
    d = a.qk_pos_emb_head_dim
    return Rule((m,), (h,), lambda w: (_permute_rope(w, rows, d, True),),
                lambda w: (_permute_rope(w, rows, d, False),))


def _attention(a: DeepseekArch, m: str, h: str) -> List[Rule]:
    q_rows = a.qk_head_dim + a.qk_pos_emb_head_dim
    if a.q_lora_rank:
        rules = [_copy(m + "linear_q_down_proj.weight", h + "q_a_proj.weight"),
                 _copy(m + "q_layernorm.weight", h + "q_a_layernorm.weight"),
                 _rope_rows(a, m + "linear_q_up_proj.weight", h + "q_b_proj.weight", q_rows)]
    else:
        rules = [_rope_rows(a, m + "linear_q_proj.weight", h + "q_proj.weight", q_rows)]
    return rules + [_rope_rows(a, m + "linear_kv_down_proj.weight", h + "kv_a_proj_with_mqa.weight",
                               a.kv_lora_rank + a.qk_pos_emb_head_dim),
                    _copy(m + "kv_layernorm.weight", h + "kv_a_layernorm.weight"),
                    _copy(m + "linear_kv_up_proj.weight", h + "kv_b_proj.weight"),
                    _copy(m + "linear_proj.weight", h + "o_proj.weight")]


def _layer(a: DeepseekArch, m: str, h: str, sparse: bool, fused_experts: bool) -> List[Rule]:
    rules = [_copy(m + "input_layernorm.weight", h + "input_layernorm.weight")]
    rules += _attention(a, m + "self_attention.", h + "self_attn.")
    rules.append(_copy(m + "pre_mlp_layernorm.weight", h + "post_attention_layernorm.weight"))
    if not sparse:
        return rules + _swiglu_mlp_rules(a, m + "mlp.", h + "mlp.")
    rules += routed_expert_rules(a, m, h, fused_experts)
    rules.append(_copy(m + "mlp.router.expert_bias", h + "mlp.gate.e_score_correction_bias"))
    if a.shared_expert_size:
        rules += _swiglu_mlp_rules(a, m + "mlp.shared_experts.", h + "mlp.shared_experts.")
    return rules


def _same_as(copy_name: str, own_name: str):
    """from-hf of an MTP layer's copy of the embedding / output layer: checked against the model's own."""
    def check(copy: torch.Tensor, own: torch.Tensor):
        if copy.device.type != "meta" and not torch.equal(copy, own):
            raise ConversionError(f"{copy_name} differs from {own_name}: Megatron's MTP layers share the model's "
                                  "embedding and output layer, so this model cannot be held")
        return ()
    return check


def _mtp(a: DeepseekArch, k: int, importing: bool) -> List[Rule]:
    m, h = f"mtp.layers.{k}.", f"model.layers.{a.num_layers + k}."
    rules = [_copy(m + "enorm.weight", h + "enorm.weight"), _copy(m + "hnorm.weight", h + "hnorm.weight"),
             _copy(m + "eh_proj.weight", h + "eh_proj.weight")]
    rules += _layer(a, m + "transformer_layer.", h, bool(a.num_experts), False)
    rules.append(_copy(m + "final_layernorm.weight", h + "shared_head.norm.weight"))
    head = "embedding.word_embeddings.weight" if a.tied else "output_layer.weight"
    copies = ((h + "embed_tokens.weight", "model.embed_tokens.weight", "embedding.word_embeddings.weight"),
              (h + "shared_head.head.weight", "model.embed_tokens.weight" if a.tied else "lm_head.weight", head))
    for copy, own, megatron in copies:
        if importing:  # a check: no Megatron tensor comes from it
            rules.append(Rule((megatron,), (copy, own), lambda w: (w, w), _same_as(copy, own)))
        else:
            rules.append(_vocab(a, megatron, copy))
    return rules


def rules(model_type: str, a: DeepseekArch, fused_experts: bool = False, importing: bool = False) -> List[Rule]:
    out = [_vocab(a, "embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    for i in range(a.num_layers):
        out += _layer(a, f"decoder.layers.{i}.", f"model.layers.{i}.", bool(a.moe_layers and a.moe_layers[i]),
                      fused_experts)
    out.append(_copy("decoder.final_layernorm.weight", "model.norm.weight"))
    if not a.tied:
        out.append(_vocab(a, "output_layer.weight", "lm_head.weight"))
    for k in range(a.mtp_num_layers):
        out += _mtp(a, k, importing)
    return out


# ------------------------------------------------------------------------ configs
def problems(model_type: str, a: Arch) -> List[str]:
    if not isinstance(a, DeepseekArch):
        return ["deepseek_v3 needs --multi-latent-attention (use llama, qwen2, qwen3 or their MoE types)"]
    out = [f"deepseek_v3 needs {what}" for ok, what in (
        (a.normalization == "RMSNorm", "--normalization RMSNorm"), (a.swiglu, "--swiglu"),
        (a.rotary_percent == 1.0, "--rotary-percent 1.0"),
        (a.qk_layernorm, "--qk-layernorm (its q_a_layernorm / kv_a_layernorm)"),
        (not a.bias and not a.qkv_bias, "--disable-bias-linear and no --add-qkv-bias"),
        (a.norm_epsilon == LATENT_NORM_EPSILON, f"--norm-epsilon {LATENT_NORM_EPSILON} (transformers' latent "
                                                f"norms have it whatever rms_norm_eps; the model has {a.norm_epsilon})"),
        (bool(a.num_experts), "--num-experts"), (not a.moe_grouped_gemm, "no --moe-grouped-gemm (SequentialMLP experts)"),
        (a.score_function == "sigmoid", "--moe-router-score-function sigmoid"),
        (a.expert_bias, "--moe-router-enable-expert-bias (its gate.e_score_correction_bias)"),
        (not a.moe_router_pre_softmax, "no --moe-router-pre-softmax"),
        (not a.shared_expert_gate, "no --moe-shared-expert-gate")) if not ok]
    if a.num_experts:
        if tuple(a.moe_layers) != (0,) * a.first_k_dense + (1,) * (a.num_layers - a.first_k_dense):
            out.append(f"deepseek_v3 has k dense layers then MoE ones (first_k_dense_replace): --moe-layer-freq "
                       f"{list(a.moe_layers)} is not of that form")
        if a.shared_expert_size and a.shared_expert_size % a.moe_ffn_hidden_size:
            out.append(f"deepseek_v3's shared experts are n x moe_intermediate_size: "
                       f"--moe-shared-expert-intermediate-size {a.shared_expert_size} is not a multiple of "
                       f"--moe-ffn-hidden-size {a.moe_ffn_hidden_size}")
        if a.num_groups and a.num_groups > 1 and a.moe_router_topk != 2 * a.group_topk:
            out.append(f"transformers scores an expert group by its top 2 experts, Megatron-Core by its top "
                       f"--moe-router-topk / --moe-router-group-topk = {a.moe_router_topk // a.group_topk}: "
                       "deepseek_v3 needs --moe-router-topk = 2 x --moe-router-group-topk")
        if (a.num_experts // (a.num_groups or 1)) < 2:
            out.append("deepseek_v3 scores each expert group by its top 2 experts: groups need 2 experts or more")
    return out


def _rope_parameters(a: DeepseekArch) -> Dict[str, Any]:
    theta = float(a.rotary_base)
    if a.rotary_scaling_factor <= 1:  # Megatron-Core's YaRN at factor 1 is plain RoPE, scale 1
        return {"rope_type": "default", "rope_theta": theta}
    f = a.rotary_scaling_factor
    return dict(YARN_FIXED, rope_type="yarn", rope_theta=theta, factor=f, mscale=a.mscale,
                mscale_all_dim=a.mscale_all_dim,
                attention_factor=yarn_mscale(f, a.mscale) / yarn_mscale(f, a.mscale_all_dim))


def hf_config(model_type: str, a: DeepseekArch, dtype: torch.dtype) -> Dict[str, Any]:
    return dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=a.vocab_size,
                hidden_size=a.hidden_size, intermediate_size=a.ffn_hidden_size,
                moe_intermediate_size=a.moe_ffn_hidden_size, num_hidden_layers=a.num_layers,
                num_attention_heads=a.num_attention_heads, num_key_value_heads=a.num_attention_heads,
                n_shared_experts=(a.shared_expert_size or 0) // a.moe_ffn_hidden_size,
                n_routed_experts=a.num_experts, routed_scaling_factor=float(a.topk_scaling_factor or 1.0),
                kv_lora_rank=a.kv_lora_rank, q_lora_rank=a.q_lora_rank, qk_rope_head_dim=a.qk_pos_emb_head_dim,
                v_head_dim=a.v_head_dim, qk_nope_head_dim=a.qk_head_dim, n_group=a.num_groups or 1,
                topk_group=a.group_topk or 1, num_experts_per_tok=a.moe_router_topk,
                first_k_dense_replace=a.first_k_dense, norm_topk_prob=a.moe_router_topk > 1, hidden_act="silu",
                max_position_embeddings=a.max_position_embeddings, rms_norm_eps=a.norm_epsilon,
                tie_word_embeddings=a.tied, rope_parameters=_rope_parameters(a), rope_interleave=a.rope_interleave,
                attention_bias=False, attention_dropout=0.0, num_nextn_predict_layers=a.mtp_num_layers,
                dtype=str(dtype).replace("torch.", ""))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConversionError("deepseek_v3: " + message)


def _yarn_from_hf(c: Mapping[str, Any]) -> Dict[str, float]:
    """--rotary-base, --rotary-scaling-factor, --mscale, --mscale-all-dim of a config's RoPE."""
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    if kind == "default":
        return dict(rotary_base=theta, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    _require(kind == "yarn", f"rope type {kind!r} is not converted (Megatron-Core's MLA has YaRN or plain RoPE)")
    for key, value in YARN_FIXED.items():
        _require(params.get(key, value) == value, f"YaRN {key} {params.get(key)}: Megatron-Core fixes it at {value} "
                                                  "(no flag sets it)")
    _require(params.get("truncate", True), "YaRN truncate false: Megatron-Core rounds the correction range")
    f = float(params.get("factor") or c["max_position_embeddings"] / YARN_FIXED["original_max_position_embeddings"])
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    hf_factor = params.get("attention_factor")
    if hf_factor is None:  # transformers' own inference
        hf_factor = yarn_mscale(f, mscale) / yarn_mscale(f, all_dim) if mscale and all_dim else yarn_mscale(f, 1)
    ours_mscale = 1.0 if mscale is None else float(mscale)
    ours = yarn_mscale(f, ours_mscale) / yarn_mscale(f, all_dim or 0.0)
    _require(abs(ours - hf_factor) <= 1e-12 * hf_factor, f"YaRN attention factor {hf_factor}: Megatron-Core's "
             f"mscale(factor, mscale) / mscale(factor, mscale_all_dim) gives {ours} for these values")
    return dict(rotary_base=theta, rotary_scaling_factor=f, mscale=ours_mscale, mscale_all_dim=float(all_dim or 0.0))


def mtp_layers_present(c: Mapping[str, Any], keys: Collection[str]) -> Tuple[int, int]:
    """(MTP layers config.json declares, how many of them the files hold)."""
    declared = int(c.get("num_nextn_predict_layers", c.get("num_mtp_layers", 0)) or 0)
    layers = c["num_hidden_layers"]
    held = sum(any(k.startswith(f"model.layers.{layers + j}.") for k in keys) for j in range(declared))
    return declared, held


def arch_from_hf(c: Mapping[str, Any], keys: Collection[str] = ()) -> Tuple[str, DeepseekArch]:
    heads, layers = c["num_attention_heads"], c["num_hidden_layers"]
    _require(c.get("hidden_act", "silu") == "silu", f"hidden_act {c.get('hidden_act')!r}: SwiGLU needs silu")
    _require(not c.get("attention_bias"), "attention_bias: Megatron's MLA has no biases")
    _require((c.get("num_key_value_heads") or heads) == heads, "num_key_value_heads must equal num_attention_heads "
                                                               "(MLA has no key/value head groups)")
    eps = c.get("rms_norm_eps", 1e-6)
    _require(eps == LATENT_NORM_EPSILON, f"rms_norm_eps {eps}: the latent norms have {LATENT_NORM_EPSILON} and "
                                         "Megatron's --norm-epsilon is one value for every norm")
    experts, topk = c.get("n_routed_experts") or c.get("num_local_experts"), c.get("num_experts_per_tok", 8)
    _require(bool(experts), "n_routed_experts 0 is not converted")
    _require(bool(c.get("norm_topk_prob", True)) == (topk > 1), "norm_topk_prob false with top-k > 1: Megatron-Core "
                                                                "always renormalizes sigmoid top-k weights")
    groups, group_topk = c.get("n_group") or 1, c.get("topk_group") or 1
    _require(groups == 1 or topk == 2 * group_topk, f"n_group {groups}, topk_group {group_topk}, top-k {topk}: "
             "transformers scores a group by its top 2 experts, Megatron-Core by its top top-k / topk_group")
    dense = min(c.get("first_k_dense_replace") or 0, layers)
    declared, held = mtp_layers_present(c, keys)
    _require(held in (0, declared), f"{held} of the {declared} MTP layers are in the files")
    shared = (c.get("n_shared_experts") or 0) * c["moe_intermediate_size"]
    return "deepseek_v3", DeepseekArch(
        num_layers=layers, hidden_size=c["hidden_size"], ffn_hidden_size=c["intermediate_size"],
        num_attention_heads=heads, num_query_groups=heads, kv_channels=c["hidden_size"] // heads,
        vocab_size=c["vocab_size"], padded_vocab_size=c["vocab_size"],
        max_position_embeddings=c["max_position_embeddings"], normalization="RMSNorm", norm_epsilon=eps, swiglu=True,
        position_embedding_type="rope", tied=bool(c.get("tie_word_embeddings", False)), bias=False,
        qk_layernorm=True, num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=c["moe_intermediate_size"],
        shared_expert_size=shared or None, moe_layers=(0,) * dense + (1,) * (layers - dense),
        q_lora_rank=c.get("q_lora_rank"), kv_lora_rank=c["kv_lora_rank"], qk_head_dim=c["qk_nope_head_dim"],
        qk_pos_emb_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"], mtp_num_layers=held,
        score_function="sigmoid", expert_bias=True, num_groups=groups if groups > 1 else None,
        group_topk=group_topk if groups > 1 else None,
        topk_scaling_factor=float(c.get("routed_scaling_factor", 1.0)), rope_interleave=bool(c.get("rope_interleave", True)),
        **_yarn_from_hf(c))


def mtp_note(a: DeepseekArch, exporting: bool, declared: int = 0) -> str:
    """The one line saying what happened to the MTP layers."""
    first = a.num_layers
    if exporting:
        if not a.mtp_num_layers:
            return ""
        return (f"MTP: {a.mtp_num_layers} layer(s) written as the Hub stores them, model.layers.{first}.* on "
                f"(enorm, hnorm, eh_proj, shared_head, copies of embed_tokens and the head); transformers' "
                "DeepseekV3ForCausalLM does not load them (it reports them as unexpected keys)")
    if a.mtp_num_layers:
        return (f"MTP: {a.mtp_num_layers} layer(s) read from model.layers.{first}.* (--mtp-num-layers "
                f"{a.mtp_num_layers}); their embed_tokens / shared_head.head equal the model's (checked)")
    if declared:
        return (f"MTP: config.json declares {declared} layer(s) but the files hold no model.layers.{first}.*: "
                "converted without MTP (add --mtp-num-layers to train new ones)")
    return ""

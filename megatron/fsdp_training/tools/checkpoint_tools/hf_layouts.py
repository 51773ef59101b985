"""How a Megatron-Core GPT maps onto HuggingFace GPT-2, Llama, Qwen2, Qwen2-MoE and Mixtral: configs and tensors.

One ``Arch`` (the model's shape, from a checkpoint's arguments or a HuggingFace
config) and, per architecture, a list of ``Rule``s: which Megatron tensors make
which HuggingFace tensors and back. Every rule is a pair of pure functions on
tensors, so the converter runs them on meta tensors to plan (names, shapes) and
on real ones to convert, one layer (to HF) or one tensor (from HF) at a time.

What differs between the two sides (Megatron-Core's TP-1 names, layout v2 shapes:
docs/checkpoint-conversion.md, "HuggingFace"):

- fused QKV: Megatron interleaves per query group ``[q heads of group g, k_g, v_g]``;
  HuggingFace has separate ``q_proj`` (heads in order), ``k_proj``, ``v_proj``
  (GPT-2: one ``c_attn`` of ``[q; k; v]``, transposed, as ``Conv1D`` stores it);
- SwiGLU ``linear_fc1`` is stored ``[2, ffn, hidden]`` (``[0]`` gate, ``[1]`` up):
  ``gate_proj`` / ``up_proj`` (Mixtral experts ``w1`` / ``w3``);
- rotary embeddings: Megatron's non-interleaved RoPE rotates the two halves of
  each head (``rotate_half``), as HuggingFace Llama does: no permutation
  (the logit tests check it); interleaved RoPE is refused;
- vocabulary: Megatron's rows are padded (``--make-vocab-size-divisible-by`` x TP);
  HuggingFace gets the tokenizer's rows only;
- tied embeddings: ``tie_word_embeddings`` and no ``lm_head.weight`` tensor;
- Qwen2-MoE: the shared expert is Megatron's ``shared_experts`` (SwiGLU, its ``gate_weight``
  ``[1, hidden]`` is ``shared_expert_gate``: both scale it by ``sigmoid(x . w)``); the router
  ``mlp.gate`` softmaxes over all experts then takes the top k, renormalized only with
  ``norm_topk_prob``: Megatron's default (top k, then softmax over them) equals the renormalized
  form, ``--moe-router-pre-softmax`` the other.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

MODEL_TYPES = ("gpt2", "llama", "qwen2", "qwen2_moe", "mixtral")


class ConversionError(ValueError):
    """The model cannot be represented in the requested format; the message names what and the fix."""


@dataclasses.dataclass(frozen=True)
class Arch:
    """A GPT's shape in Megatron-LM's terms (the arguments a checkpoint's ``common.json`` keeps)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int  # the tokenizer's rows (HuggingFace's vocab_size)
    padded_vocab_size: int
    max_position_embeddings: int
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000
    rotary_percent: float = 1.0
    tied: bool = True
    bias: bool = True
    qk_layernorm: bool = False
    qkv_bias: bool = False  # --add-qkv-bias (biases on linear_qkv only)
    num_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    shared_expert_size: Optional[int] = None
    shared_expert_gate: bool = False
    moe_router_pre_softmax: bool = False
    moe_layers: Tuple[int, ...] = ()  # 1 per MoE layer
    moe_grouped_gemm: bool = False

    def megatron_flags(self) -> List[str]:
        """The ``pretrain_gpt.py`` arguments that build this model (vocabulary: padded to HF's rows)."""
        flags = ["--num-layers", self.num_layers, "--hidden-size", self.hidden_size, "--ffn-hidden-size",
                 self.ffn_hidden_size, "--num-attention-heads", self.num_attention_heads,
                 "--max-position-embeddings", self.max_position_embeddings,
                 "--normalization", self.normalization, "--norm-epsilon", self.norm_epsilon,
                 "--position-embedding-type", self.position_embedding_type]
        if self.kv_channels * self.num_attention_heads != self.hidden_size:
            flags += ["--kv-channels", self.kv_channels]
        if self.num_query_groups != self.num_attention_heads:
            flags += ["--group-query-attention", "--num-query-groups", self.num_query_groups]
        if self.position_embedding_type == "rope":
            flags += ["--rotary-base", int(self.rotary_base)]
        flags += ["--swiglu"] * self.swiglu + ["--untie-embeddings-and-output-weights"] * (not self.tied)
        flags += ["--disable-bias-linear"] * (not self.bias) + ["--qk-layernorm"] * self.qk_layernorm
        flags += ["--add-qkv-bias"] * (self.qkv_bias and not self.bias)
        if self.num_experts:
            flags += ["--num-experts", self.num_experts, "--moe-router-topk", self.moe_router_topk,
                      "--moe-ffn-hidden-size", self.moe_ffn_hidden_size]
            flags += ["--moe-router-pre-softmax"] * self.moe_router_pre_softmax
            if self.shared_expert_size:
                flags += ["--moe-shared-expert-intermediate-size", self.shared_expert_size]
                flags += ["--moe-shared-expert-gate"] * self.shared_expert_gate
            if not all(self.moe_layers):
                flags += ["--moe-layer-freq", "[" + ",".join(str(v) for v in self.moe_layers) + "]"]
        return [str(f) for f in flags]

    def as_args(self) -> Dict[str, Any]:
        """The arguments ``hf_models.arch_from_args`` reads (``common.json``'s ``args`` of a converted checkpoint)."""
        return dict(num_layers=self.num_layers, hidden_size=self.hidden_size, ffn_hidden_size=self.ffn_hidden_size,
                    num_attention_heads=self.num_attention_heads, kv_channels=self.kv_channels,
                    group_query_attention=self.num_query_groups != self.num_attention_heads,
                    # (None without GQA, as pretrain_gpt.py records it: a loading run compares it)
                    num_query_groups=self.num_query_groups if self.num_query_groups != self.num_attention_heads
                    else None, true_vocab_size=self.vocab_size,
                    padded_vocab_size=self.padded_vocab_size, max_position_embeddings=self.max_position_embeddings,
                    normalization=self.normalization, norm_epsilon=self.norm_epsilon, swiglu=self.swiglu,
                    position_embedding_type=self.position_embedding_type, rotary_base=self.rotary_base,
                    rotary_percent=self.rotary_percent, untie_embeddings_and_output_weights=not self.tied,
                    add_bias_linear=self.bias, qk_layernorm=self.qk_layernorm, add_qkv_bias=self.qkv_bias,
                    num_experts=self.num_experts,
                    moe_router_topk=self.moe_router_topk, moe_ffn_hidden_size=self.moe_ffn_hidden_size,
                    moe_shared_expert_intermediate_size=self.shared_expert_size,
                    moe_shared_expert_gate=self.shared_expert_gate, moe_router_pre_softmax=self.moe_router_pre_softmax,
                    moe_layer_freq=list(self.moe_layers) or 1, moe_grouped_gemm=self.moe_grouped_gemm)

    def model_args(self) -> Dict[str, Any]:
        """``common.json``'s ``model_args``: what a loading run's shape is checked against."""
        out = dict(num_layers=self.num_layers, hidden_size=self.hidden_size, ffn_hidden_size=self.ffn_hidden_size,
                   num_attention_heads=self.num_attention_heads, true_vocab_size=self.vocab_size,
                   padded_vocab_size=self.padded_vocab_size, num_experts=self.num_experts,
                   untie_embeddings_and_output_weights=not self.tied, add_bias_linear=self.bias,
                   moe_grouped_gemm=False, tensor_model_parallel_size=1, expert_tensor_parallel_size=1)
        if self.position_embedding_type == "learned_absolute":
            out["max_position_embeddings"] = self.max_position_embeddings
        if self.num_experts:
            out["moe_ffn_hidden_size"] = self.moe_ffn_hidden_size
        return out


@dataclasses.dataclass(frozen=True)
class Rule:
    """Megatron tensors ``megatron`` <-> HuggingFace tensors ``hf`` (names, each side in order)."""

    megatron: Tuple[str, ...]
    hf: Tuple[str, ...]
    to_hf: Callable[..., Sequence[torch.Tensor]]
    from_hf: Callable[..., Sequence[torch.Tensor]]


def _same(*t):
    return t


def _t(*ts):
    return tuple(x.t() for x in ts)


def _copy(m: str, h: str) -> Rule:
    return Rule((m,), (h,), _same, _same)


def _transposed(m: str, h: str) -> Rule:
    return Rule((m,), (h,), _t, _t)


def _vocab(a: Arch, m: str, h: str) -> Rule:
    """Padding rows dropped going out; HF's rows alone coming in (the checkpoint's padded size = HF's)."""
    return Rule((m,), (h,), lambda w: (w[:a.vocab_size],), _same)


def _qkv_split(a: Arch, fused: torch.Tensor):
    """Megatron's per-group interleaved ``[q_g..., k_g, v_g]`` rows -> q (heads in order), k, v."""
    per = a.num_attention_heads // a.num_query_groups
    x = fused.reshape(a.num_query_groups, per + 2, a.kv_channels, *fused.shape[1:])
    q = x[:, :per].reshape(a.num_attention_heads * a.kv_channels, *fused.shape[1:])
    k = x[:, per].reshape(a.num_query_groups * a.kv_channels, *fused.shape[1:])
    v = x[:, per + 1].reshape(a.num_query_groups * a.kv_channels, *fused.shape[1:])
    return q, k, v


def _qkv_merge(a: Arch, q, k, v):
    per = a.num_attention_heads // a.num_query_groups
    rest = q.shape[1:]
    q = q.reshape(a.num_query_groups, per, a.kv_channels, *rest)
    k = k.reshape(a.num_query_groups, 1, a.kv_channels, *rest)
    v = v.reshape(a.num_query_groups, 1, a.kv_channels, *rest)
    return torch.cat([q, k, v], 1).reshape(-1, *rest)


def _qkv(a: Arch, m: str, q: str, k: str, v: str) -> Rule:
    return Rule((m,), (q, k, v), lambda w: _qkv_split(a, w), lambda *qkv: (_qkv_merge(a, *qkv),))


def _gate_up(m: str, gate: str, up: str) -> Rule:
    """Stored ``[2, ffn, ...]`` (weight or bias) <-> gate, up."""
    return Rule((m,), (gate, up), lambda w: (w[0], w[1]), lambda g, u: (torch.stack([g, u]),))


# ------------------------------------------------------------------ per architecture
def gpt2_rules(a: Arch) -> List[Rule]:
    rules = [_vocab(a, "embedding.word_embeddings.weight", "transformer.wte.weight"),
             _copy("embedding.position_embeddings.weight", "transformer.wpe.weight")]
    for i in range(a.num_layers):
        m, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
        rules += [_copy(m + "input_layernorm.weight", h + "ln_1.weight"),
                  _copy(m + "input_layernorm.bias", h + "ln_1.bias"),
                  Rule((m + "self_attention.linear_qkv.weight",), (h + "attn.c_attn.weight",),
                       lambda w: (torch.cat(_qkv_split(a, w)).t(),),
                       lambda w: (_qkv_merge(a, *w.t().chunk(3)),)),
                  Rule((m + "self_attention.linear_qkv.bias",), (h + "attn.c_attn.bias",),
                       lambda b: (torch.cat(_qkv_split(a, b)),), lambda b: (_qkv_merge(a, *b.chunk(3)),)),
                  _transposed(m + "self_attention.linear_proj.weight", h + "attn.c_proj.weight"),
                  _copy(m + "self_attention.linear_proj.bias", h + "attn.c_proj.bias"),
                  _copy(m + "pre_mlp_layernorm.weight", h + "ln_2.weight"),
                  _copy(m + "pre_mlp_layernorm.bias", h + "ln_2.bias"),
                  _transposed(m + "mlp.linear_fc1.weight", h + "mlp.c_fc.weight"),
                  _copy(m + "mlp.linear_fc1.bias", h + "mlp.c_fc.bias"),
                  _transposed(m + "mlp.linear_fc2.weight", h + "mlp.c_proj.weight"),
                  _copy(m + "mlp.linear_fc2.bias", h + "mlp.c_proj.bias")]
    rules += [_copy("decoder.final_layernorm.weight", "transformer.ln_f.weight"),
              _copy("decoder.final_layernorm.bias", "transformer.ln_f.bias")]
    if not a.tied:
        rules.append(_vocab(a, "output_layer.weight", "lm_head.weight"))
    return rules


def _attention_rules(a: Arch, m: str, h: str, qkv_bias: str) -> List[Rule]:
    """Llama-family attention; ``qkv_bias``: "none", "model" (the Megatron model has it) or "zero"
    (HF has it, Megatron has none: Qwen2 exported from a model without biases)."""
    rules = [_qkv(a, m + "linear_qkv.weight", h + "q_proj.weight", h + "k_proj.weight", h + "v_proj.weight"),
             _copy(m + "linear_proj.weight", h + "o_proj.weight")]
    if qkv_bias == "model":
        rules.append(_qkv(a, m + "linear_qkv.bias", h + "q_proj.bias", h + "k_proj.bias", h + "v_proj.bias"))
    elif qkv_bias == "zero":
        def zeros(w):
            return tuple(torch.zeros(t.shape[0], dtype=t.dtype, device=t.device) for t in _qkv_split(a, w))

        def check(*biases):
            if any(b.device.type != "meta" and bool(b.abs().max() > 0) for b in biases):
                raise ConversionError("this HuggingFace model has non-zero q/k/v biases, which a Megatron model "
                                      "without --add-qkv-bias cannot hold")
            return ()
        rules.append(Rule((m + "linear_qkv.weight",), (h + "q_proj.bias", h + "k_proj.bias", h + "v_proj.bias"),
                          zeros, check))
    if a.bias:
        rules.append(_copy(m + "linear_proj.bias", h + "o_proj.bias"))
    if a.qk_layernorm:
        raise ConversionError("--qk-layernorm has no place in HuggingFace Llama/Qwen2/Mixtral (use --model-type "
                              "qwen3 or qwen3_moe)")
    return rules


def _swiglu_mlp_rules(a: Arch, m: str, h: str, gate="gate_proj", up="up_proj", down="down_proj") -> List[Rule]:
    rules = [_gate_up(m + "linear_fc1.weight", h + gate + ".weight", h + up + ".weight"),
             _copy(m + "linear_fc2.weight", h + down + ".weight")]
    if a.bias:
        rules += [_gate_up(m + "linear_fc1.bias", h + gate + ".bias", h + up + ".bias"),
                  _copy(m + "linear_fc2.bias", h + down + ".bias")]
    return rules


def _fused_expert_rules(a: Arch, m: str, h: str) -> List[Rule]:
    """transformers 5's own Mixtral layout: ``experts.gate_up_proj`` [E, 2 x ffn, hidden], ``down_proj``."""
    fc1 = tuple(f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight" for e in range(a.num_experts))
    fc2 = tuple(f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight" for e in range(a.num_experts))
    f = a.moe_ffn_hidden_size
    return [_copy(m + "mlp.router.weight", h + "mlp.gate.weight"),
            Rule(fc1, (h + "mlp.experts.gate_up_proj",), lambda *w: (torch.stack(w).reshape(len(w), 2 * f, -1),),
                 lambda w: tuple(w.reshape(w.shape[0], 2, f, w.shape[-1]).unbind(0))),
            Rule(fc2, (h + "mlp.experts.down_proj",), lambda *w: (torch.stack(w),), lambda w: tuple(w.unbind(0)))]


def routed_expert_rules(a: Arch, m: str, h: str, fused_experts: bool) -> List[Rule]:
    """The router ``mlp.gate`` and the experts, the Hub's ``mlp.experts.<e>.*`` or transformers 5's fused
    names (Qwen2-MoE, Qwen3-MoE, DeepSeek-V3)."""
    if fused_experts:
        return _fused_expert_rules(a, m, h)
    rules = [_copy(m + "mlp.router.weight", h + "mlp.gate.weight")]
    for e in range(a.num_experts):
        rules += _swiglu_mlp_rules(a, f"{m}mlp.experts.local_experts.{e}.", f"{h}mlp.experts.{e}.")
    return rules


def _qwen2_moe_rules(a: Arch, m: str, h: str, fused_experts: bool) -> List[Rule]:
    """Qwen2-MoE's sparse block: routed experts (the Hub's per-expert names, or transformers 5's fused
    ones on import), the router ``mlp.gate``, the shared expert and its sigmoid gate."""
    rules = routed_expert_rules(a, m, h, fused_experts)
    rules += _swiglu_mlp_rules(a, m + "mlp.shared_experts.", h + "mlp.shared_expert.")
    return rules + [_copy(m + "mlp.shared_experts.gate_weight", h + "mlp.shared_expert_gate.weight")]


def llama_rules(a: Arch, qkv_bias: str = "none", moe: str = "", fused_experts: bool = False) -> List[Rule]:
    """``moe``: "" (dense), "mixtral", "qwen2_moe" or "qwen3_moe" (the MoE layers' names; dense layers as
    Llama's)."""
    rules = [_vocab(a, "embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    for i in range(a.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        rules += [_copy(m + "input_layernorm.weight", h + "input_layernorm.weight")]
        rules += _attention_rules(a, m + "self_attention.", h + "self_attn.", qkv_bias)
        rules += [_copy(m + "pre_mlp_layernorm.weight", h + "post_attention_layernorm.weight")]
        sparse = moe and (not a.moe_layers or a.moe_layers[i])
        if sparse and moe == "qwen2_moe":
            rules += _qwen2_moe_rules(a, m, h, fused_experts)
        elif sparse and moe == "qwen3_moe":  # (hf_layouts_qwen3's: no shared expert)
            rules += routed_expert_rules(a, m, h, fused_experts)
        elif sparse and fused_experts:
            rules += _fused_expert_rules(a, m, h)
        elif sparse:
            # The Hub's Mixtral layout (transformers 4 reads it as is, 5 fuses the experts on load).
            rules.append(_copy(m + "mlp.router.weight", h + "block_sparse_moe.gate.weight"))
            for e in range(a.num_experts):
                rules += _swiglu_mlp_rules(a, f"{m}mlp.experts.local_experts.{e}.",
                                           f"{h}block_sparse_moe.experts.{e}.", "w1", "w3", "w2")
        else:
            rules += _swiglu_mlp_rules(a, m + "mlp.", h + "mlp.")
    rules.append(_copy("decoder.final_layernorm.weight", "model.norm.weight"))
    if not a.tied:
        rules.append(_vocab(a, "output_layer.weight", "lm_head.weight"))
    return rules


def rules_for(model_type: str, a: Arch, fused_experts: bool = False) -> List[Rule]:
    """The tensor mapping of ``model_type``; ``fused_experts``: transformers 5's MoE names (import only).

    q/k/v biases: the model's own (``--add-qkv-bias``, or every linear's); Qwen2 exported from a
    model without them gets zeros (its attention always has them)."""
    if model_type == "gpt2":
        return gpt2_rules(a)
    qkv_bias = "model" if a.bias or a.qkv_bias else "zero" if model_type == "qwen2" else "none"
    moe = model_type if model_type in ("mixtral", "qwen2_moe") else ""
    return llama_rules(a, qkv_bias=qkv_bias, moe=moe, fused_experts=fused_experts)


# ---------------------------------------------------------------------- configs
def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConversionError(message)


def check_exportable(model_type: str, a: Arch) -> None:
    """Every property of ``a`` that ``model_type`` cannot express, named with the fix (one error)."""
    problems = []
    if a.moe_grouped_gemm:
        problems.append("--moe-grouped-gemm experts are not converted (train with SequentialMLP experts)")
    if a.shared_expert_size and model_type != "qwen2_moe":
        problems.append("shared experts (--moe-shared-expert-intermediate-size) have no place in "
                        f"{model_type} (use --model-type qwen2_moe, with --moe-shared-expert-gate)")
    if model_type == "gpt2":
        for ok, what in ((a.normalization == "LayerNorm", "--normalization LayerNorm"), (not a.swiglu, "no --swiglu"),
                         (a.position_embedding_type == "learned_absolute", "learned_absolute positions"),
                         (a.num_query_groups == a.num_attention_heads, "no --group-query-attention"),
                         (a.bias, "biases (no --disable-bias-linear)"), (not a.qk_layernorm, "no --qk-layernorm"),
                         (not a.num_experts, "no --num-experts"),
                         (a.kv_channels * a.num_attention_heads == a.hidden_size, "no --kv-channels")):
            if not ok:
                problems.append(f"gpt2 needs {what}")
    else:
        for ok, what in ((a.normalization == "RMSNorm", "--normalization RMSNorm"), (a.swiglu, "--swiglu"),
                         (a.position_embedding_type == "rope", "--position-embedding-type rope"),
                         (a.rotary_percent == 1.0, "--rotary-percent 1.0"), (not a.qk_layernorm, "no --qk-layernorm")):
            if not ok:
                problems.append(f"{model_type} needs {what}")
        if model_type == "mixtral" and (not a.num_experts or not all(a.moe_layers)):
            problems.append("mixtral needs --num-experts with every layer an MoE layer (--moe-layer-freq 1)")
        if model_type == "mixtral" and (a.bias or a.qkv_bias):
            problems.append("mixtral has no biases: it needs --disable-bias-linear and no --add-qkv-bias")
        if model_type == "mixtral" and a.moe_router_pre_softmax:
            problems.append("mixtral renormalizes its top-k router weights: it needs no --moe-router-pre-softmax")
        if model_type == "qwen2_moe":
            if not a.num_experts or not a.shared_expert_size or not a.shared_expert_gate:
                problems.append("qwen2_moe needs --num-experts, --moe-shared-expert-intermediate-size and "
                                "--moe-shared-expert-gate (its shared expert is always there, gated)")
            if a.bias:
                problems.append("qwen2_moe has biases on q/k/v only: it needs --disable-bias-linear "
                                "(with --add-qkv-bias for them)")
        if model_type not in ("mixtral", "qwen2_moe") and a.num_experts:
            problems.append(f"{model_type} is dense: use --model-type mixtral or qwen2_moe for --num-experts")
        if model_type == "qwen2" and a.bias:
            problems.append("qwen2 has biases on q/k/v only: the model has them on every linear layer "
                            "(use --model-type llama, whose attention_bias/mlp_bias hold them)")
    _require(not problems, "cannot convert to HuggingFace " + model_type + ": " + "; ".join(problems))


def llama_family_config(a: Arch, dtype: torch.dtype) -> Dict[str, Any]:
    """The ``config.json`` fields every Llama-family model here shares (also hf_layouts_qwen3's)."""
    return dict(vocab_size=a.vocab_size, hidden_size=a.hidden_size, num_hidden_layers=a.num_layers,
                num_attention_heads=a.num_attention_heads, num_key_value_heads=a.num_query_groups,
                head_dim=a.kv_channels, max_position_embeddings=a.max_position_embeddings, hidden_act="silu",
                rms_norm_eps=a.norm_epsilon, rope_theta=float(a.rotary_base),
                rope_parameters={"rope_type": "default", "rope_theta": float(a.rotary_base)},
                tie_word_embeddings=a.tied, attention_dropout=0.0, dtype=str(dtype).replace("torch.", ""))


def hf_config(model_type: str, a: Arch, dtype: torch.dtype) -> Dict[str, Any]:
    """``config.json`` of the HuggingFace model equal to ``a``."""
    check_exportable(model_type, a)
    name = str(dtype).replace("torch.", "")
    if model_type == "gpt2":
        return dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=a.vocab_size,
                    n_positions=a.max_position_embeddings, n_embd=a.hidden_size, n_layer=a.num_layers,
                    n_head=a.num_attention_heads, n_inner=a.ffn_hidden_size, activation_function="gelu",
                    layer_norm_epsilon=a.norm_epsilon, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                    tie_word_embeddings=a.tied, scale_attn_weights=True, dtype=name)
    config = llama_family_config(a, dtype)
    if model_type == "llama":
        return dict(config, model_type="llama", architectures=["LlamaForCausalLM"],
                    intermediate_size=a.ffn_hidden_size, attention_bias=a.bias, mlp_bias=a.bias)
    if model_type == "qwen2":
        return dict(config, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                    intermediate_size=a.ffn_hidden_size, use_sliding_window=False)
    if model_type == "qwen2_moe":
        return dict(config, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
                    intermediate_size=a.ffn_hidden_size, moe_intermediate_size=a.moe_ffn_hidden_size,
                    shared_expert_intermediate_size=a.shared_expert_size, num_experts=a.num_experts,
                    num_experts_per_tok=a.moe_router_topk, norm_topk_prob=not a.moe_router_pre_softmax,
                    decoder_sparse_step=1, mlp_only_layers=[i for i, v in enumerate(a.moe_layers) if not v],
                    qkv_bias=a.qkv_bias, use_sliding_window=False, output_router_logits=False)
    return dict(config, model_type="mixtral", architectures=["MixtralForCausalLM"],
                intermediate_size=a.moe_ffn_hidden_size, num_local_experts=a.num_experts,
                num_experts_per_tok=a.moe_router_topk, router_jitter_noise=0.0, sliding_window=None,
                output_router_logits=False)


def _rope_theta(c: Mapping[str, Any]) -> float:
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    _require(kind == "default", f"rope scaling {kind!r} is not converted (Megatron's --rotary-base only)")
    return float(params.get("rope_theta", c.get("rope_theta", 10000.0)))


def arch_from_hf(c: Mapping[str, Any], divisible_by: int = 1) -> Tuple[str, Arch]:
    """The model type and Megatron shape of a HuggingFace ``config.json``.

    The checkpoint's vocabulary keeps HF's rows; ``pretrain_gpt.py`` pads to a multiple
    of ``--make-vocab-size-divisible-by`` x TP, so the printed flags include
    ``--make-vocab-size-divisible-by 1`` (padding rows would take part in the softmax).
    """
    model_type = c.get("model_type")
    _require(model_type in MODEL_TYPES, f"model_type {model_type!r} is not converted; supported: "
                                        f"{', '.join(MODEL_TYPES)}")
    vocab = c["vocab_size"]
    if model_type == "gpt2":
        h = c["n_embd"]
        _require(c.get("activation_function", "gelu_new") == "gelu",
                 f"GPT-2 activation_function {c.get('activation_function', 'gelu_new')!r}: Megatron's GELU is "
                 "the exact one ('gelu'); the tanh approximation would change every output")
        return model_type, Arch(num_layers=c["n_layer"], hidden_size=h, ffn_hidden_size=c.get("n_inner") or 4 * h,
                                num_attention_heads=c["n_head"], num_query_groups=c["n_head"],
                                kv_channels=h // c["n_head"], vocab_size=vocab, padded_vocab_size=vocab,
                                max_position_embeddings=c["n_positions"],
                                norm_epsilon=c.get("layer_norm_epsilon", 1e-5),
                                tied=c.get("tie_word_embeddings", True))
    _require(c.get("hidden_act", "silu") == "silu", f"hidden_act {c.get('hidden_act')!r}: SwiGLU needs silu")
    heads = c["num_attention_heads"]
    bias = bool(c.get("attention_bias", False)) if model_type == "llama" else False
    if model_type == "llama":
        _require(bool(c.get("mlp_bias", False)) == bias, "attention_bias and mlp_bias differ: Megatron's "
                 "--disable-bias-linear is one switch for both")
    experts = c.get("num_local_experts") if model_type == "mixtral" else None
    moe = dict(moe_router_topk=c.get("num_experts_per_tok", 2),
               moe_ffn_hidden_size=c["intermediate_size"] if experts else None,
               moe_layers=(1,) * c["num_hidden_layers"] if experts else ())
    if model_type == "qwen2_moe":
        experts, step, dense = c["num_experts"], c.get("decoder_sparse_step", 1), c.get("mlp_only_layers") or []
        _require(bool(c.get("shared_expert_intermediate_size")), "qwen2_moe without a shared expert "
                 "(shared_expert_intermediate_size 0) is not converted")
        moe = dict(moe_router_topk=c.get("num_experts_per_tok", 4), moe_ffn_hidden_size=c["moe_intermediate_size"],
                   shared_expert_size=c["shared_expert_intermediate_size"], shared_expert_gate=True,
                   moe_router_pre_softmax=not c.get("norm_topk_prob", False),
                   moe_layers=tuple(int(i not in dense and (i + 1) % step == 0)
                                    for i in range(c["num_hidden_layers"])))
    qkv_bias = {"qwen2": True, "qwen2_moe": bool(c.get("qkv_bias", True))}.get(model_type, False)
    return model_type, Arch(
        num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], ffn_hidden_size=c["intermediate_size"],
        num_attention_heads=heads, num_query_groups=c.get("num_key_value_heads") or heads,
        kv_channels=c.get("head_dim") or c["hidden_size"] // heads, vocab_size=vocab, padded_vocab_size=vocab,
        max_position_embeddings=c["max_position_embeddings"], normalization="RMSNorm",
        norm_epsilon=c.get("rms_norm_eps", 1e-6), swiglu=True, position_embedding_type="rope",
        rotary_base=_rope_theta(c), tied=bool(c.get("tie_word_embeddings", False)), bias=bias,
        qkv_bias=qkv_bias and not bias, num_experts=experts, **moe)

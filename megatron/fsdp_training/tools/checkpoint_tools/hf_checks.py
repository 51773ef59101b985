"""What ``from-hf`` checks of a HuggingFace directory, and the plan it writes by, before anything is written.

Each family module says how its ``config.json`` maps to Megatron's shape (``hf_models``); what every
family shares is checked here, once, so that a model either converts to exactly what transformers
computes or stops with one line naming the field and the fix (without these checks each would convert
wrongly, fail with a traceback, or fail only when the job loads the result):

- ``config.json``'s values have the types transformers gives them (``FIELDS``: ``"hidden_size": "64"``
  is refused), and a field a family needs is named when missing (transformers would take its config
  class's default, sized for another model);
- ``num_key_value_heads`` divides ``num_attention_heads``; a top-1 router that renormalizes (Mixtral's
  with ``num_experts_per_tok`` 1), which Megatron-Core refuses to build, is refused here;
- sliding-window attention, which the job does not have, where transformers applies it (``WINDOWS``,
  per model type: which layers, how wide). A window no shorter than ``max_position_embeddings`` masks
  nothing in any sequence the model takes (transformers' mask keeps ``q - kv < window``): it converts;
- ``tie_word_embeddings`` with an ``lm_head.weight`` in the files: equal to the embedding, tied;
  different, transformers keeps both (it unties them, with a warning), and so does the conversion,
  said in one line;
- the tensors against the config: none missing, none without a place, and every one of the shape
  the config implies (``megatron_shape``), so a ``vocab_size`` the files disagree with stops here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from .hf_layouts import Arch, ConversionError, Rule
from .hf_layouts_deepseek import DeepseekArch
from .hf_models import arch_from_hf, rules_for

# HuggingFace tensors that are not weights (old GPT-2 files keep their attention masks).
_NOT_WEIGHTS = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|\.rotary_emb\.inv_freq)$")
_EMBEDDING = "embedding.word_embeddings.weight"
_TIE_CHUNK_BYTES = 64 * 2 ** 20  # the tie check compares the two matrices this many bytes at a time

# ------------------------------------------------------------------ config.json's types
_KINDS: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "count": (lambda v: type(v) is int and v > 0, "a positive integer"),
    "count0": (lambda v: type(v) is int and v >= 0, "a non-negative integer"),
    "number": (lambda v: type(v) in (int, float) and math.isfinite(v) and v > 0, "a positive number"),
    "flag": (lambda v: type(v) is bool, "true or false"),
    "name": (lambda v: type(v) is str, "a string"),
    "layers": (lambda v: type(v) is list and all(type(i) is int and i >= 0 for i in v), "a list of layer numbers"),
    "names": (lambda v: type(v) is list and all(type(i) is str for i in v), "a list of strings"),
    "table": (lambda v: type(v) is dict, "an object"),
}
# Every field a family module reads, with its kind; "?" where transformers also takes null.
FIELDS = {
    **dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_positions",
                     "moe_intermediate_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "num_experts_per_tok", "decoder_sparse_step"), "count"),
    **dict.fromkeys(("num_key_value_heads", "head_dim", "n_inner", "q_lora_rank", "num_local_experts",
                     "num_experts", "n_routed_experts", "n_group", "topk_group"), "count?"),
    **dict.fromkeys(("shared_expert_intermediate_size", "n_shared_experts", "first_k_dense_replace",
                     "num_nextn_predict_layers", "num_mtp_layers", "sliding_window", "max_window_layers"), "count0?"),
    **dict.fromkeys(("rms_norm_eps", "layer_norm_epsilon", "rope_theta", "routed_scaling_factor"), "number"),
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias", "qkv_bias", "norm_topk_prob",
                     "use_sliding_window", "rope_interleave"), "flag"),
    **dict.fromkeys(("model_type", "hidden_act", "activation_function"), "name"),
    "mlp_only_layers": "layers?", "layer_types": "names?", "rope_parameters": "table?", "rope_scaling": "table?",
}


def check_types(c: Mapping[str, Any]) -> None:
    for key, kind in FIELDS.items():
        if key not in c or (kind.endswith("?") and c[key] is None):
            continue
        ok, what = _KINDS[kind.rstrip("?")]
        if not ok(c[key]):
            raise ConversionError(f'config.json: "{key}" is {json.dumps(c[key])} ({type(c[key]).__name__}), but it '
                                  f"must be {what}{' or null' if kind.endswith('?') else ''}: correct config.json")


class _Required(dict):
    """``config.json`` for a family module: a field it needs and the file lacks is one line, not a KeyError."""

    def __getitem__(self, key):
        if key not in self:
            raise ConversionError(f'config.json has no "{key}", which a {self.get("model_type")} model needs: add '
                                  "it (transformers would take its config class's default, made for another model)")
        return dict.__getitem__(self, key)


# ------------------------------------------------------------------ sliding windows
@dataclasses.dataclass(frozen=True)
class Window:
    """Where transformers applies a sliding window: its size (None: no size), the layers, the fields that say
    so and the change to config.json that turns it off."""

    size: Optional[int]
    layers: Tuple[int, ...]
    fields: str
    off: str


def _qwen_window(c: Mapping[str, Any], moe: bool = False) -> Window:
    """Qwen2 / Qwen3 (and Qwen2-MoE, ``moe``) as transformers' configs set them up: ``sliding_window`` only with
    ``use_sliding_window``; ``layer_types`` as written, else every layer from ``max_window_layers`` on (Qwen2-MoE:
    the even layers below it)."""
    use, layers = bool(c.get("use_sliding_window")), c["num_hidden_layers"]
    size = c.get("sliding_window") if use else None
    types = c.get("layer_types")
    bound = c.get("max_window_layers", 28)
    if types is None:
        if bound is None and (use if moe else size is not None):
            raise ConversionError("max_window_layers null with use_sliding_window true: transformers cannot run this "
                                  "config; give max_window_layers a layer number")
        types = ["sliding_attention" if (use and i % 2 == 0 and i < bound if moe else size is not None and i >= bound)
                 else "full_attention" for i in range(layers)]
        fields = f"use_sliding_window {str(use).lower()}, max_window_layers {bound}"
    else:
        fields = f"use_sliding_window {str(use).lower()}, layer_types"
    return Window(size, tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
                  f"{fields}, sliding_window {json.dumps(c.get('sliding_window'))}", '"use_sliding_window": false')


def _every_layer(flag: Optional[str]) -> Callable[[Mapping[str, Any]], Window]:
    """Mixtral (``flag`` None) and Qwen3-MoE (``use_sliding_window``): ``sliding_window`` on every layer."""
    def window(c: Mapping[str, Any]) -> Window:
        size = c.get("sliding_window") if flag is None or c.get(flag) else None
        shown = f"{flag} {str(bool(c.get(flag))).lower()}, " if flag else ""
        return Window(size, tuple(range(c["num_hidden_layers"])) if size is not None else (),
                      f"{shown}sliding_window {json.dumps(c.get('sliding_window'))}",
                      f'"{flag}": false' if flag else '"sliding_window": null')
    return window


# transformers' Llama, GPT-2 and DeepSeek-V3 have no sliding window (a sliding_window field is ignored).
WINDOWS: Dict[str, Callable[[Mapping[str, Any]], Window]] = {
    "qwen2": _qwen_window, "qwen3": _qwen_window, "qwen2_moe": lambda c: _qwen_window(c, moe=True),
    "qwen3_moe": _every_layer("use_sliding_window"), "mixtral": _every_layer(None)}


def check_window(model_type: str, c: Mapping[str, Any]) -> None:
    if model_type not in WINDOWS:
        return
    w = WINDOWS[model_type](c)
    if not w.layers:
        return
    shown = ", ".join(map(str, w.layers[:8])) + (", ..." if len(w.layers) > 8 else "")
    if w.size is None:
        raise ConversionError(f"{model_type}: layer_types marks layer(s) {shown} sliding_attention, but {w.fields} "
                              "gives them no window, and transformers cannot run that; make those entries "
                              "full_attention in config.json")
    if w.size < c["max_position_embeddings"]:
        raise ConversionError(
            f"{model_type} with a sliding window ({w.fields}): transformers lets each position of layer(s) {shown} "
            f"see only the last {w.size} positions, the job's attention sees all of them (it has no sliding "
            f"window), so the outputs would differ from position {w.size} on; to convert it with full attention "
            f"anyway, set {w.off} in config.json")


# ------------------------------------------------------------------ shapes
_IN_LAYER = re.compile(r"^(?:decoder\.layers\.\d+\.|mtp\.layers\.\d+\.transformer_layer\.)(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.\d+\.(linear_fc1|linear_fc2)\.weight$")
_MTP = re.compile(r"^mtp\.layers\.\d+\.(enorm\.weight|hnorm\.weight|final_layernorm\.weight|eh_proj\.weight)$")
# config.json's names of the quantities where a family names them otherwise than Llama's
_LABELS = {"gpt2": {"hidden_size": "n_embd", "intermediate_size": "n_inner", "num_attention_heads": "n_head",
                    "num_key_value_heads": "n_head", "max_position_embeddings": "n_positions"},
           "mixtral": {"moe_intermediate_size": "intermediate_size", "experts": "num_local_experts"},
           "qwen2_moe": {"experts": "num_experts"}, "qwen3_moe": {"experts": "num_experts"},
           "deepseek_v3": {"experts": "n_routed_experts",
                           "shared_expert_intermediate_size": "n_shared_experts x moe_intermediate_size"}}

Dims = Tuple[Tuple[int, str], ...]  # (size, what config.json calls it) per dimension


def megatron_shape(name: str, a: Arch) -> Dims:
    """The shape ``a`` gives the Megatron tensor ``name`` (the converter's names: TP 1, SwiGLU ``[2, ffn, h]``)."""
    h, v = (a.hidden_size, "hidden_size"), (a.padded_vocab_size, "vocab_size")
    if name in (_EMBEDDING, "output_layer.weight"):
        return v, h
    if name == "embedding.position_embeddings.weight":
        return (a.max_position_embeddings, "max_position_embeddings"), h
    if name in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
        return (h,)
    mtp = _MTP.match(name)
    if mtp:
        return (h, (2 * a.hidden_size, "2 x hidden_size")) if mtp.group(1) == "eh_proj.weight" else (h,)
    local = _IN_LAYER.match(name)
    if not local:
        raise RuntimeError(f"hf_checks.megatron_shape knows no shape for {name}: add it")
    local = local.group(1)
    kv, heads, groups = a.kv_channels, a.num_attention_heads, a.num_query_groups
    ffn = (a.ffn_hidden_size, "intermediate_size")
    qkv = ((heads + 2 * groups) * kv, "(num_attention_heads + 2 x num_key_value_heads) x head_dim")
    gate = ((2, "gate and up"),) if a.swiglu else ()
    table: Dict[str, Dims] = {
        "input_layernorm.weight": (h,), "input_layernorm.bias": (h,), "pre_mlp_layernorm.weight": (h,),
        "pre_mlp_layernorm.bias": (h,), "self_attention.linear_qkv.weight": (qkv, h),
        "self_attention.linear_qkv.bias": (qkv,), "self_attention.linear_proj.bias": (h,),
        "self_attention.linear_proj.weight": (h, (heads * kv, "num_attention_heads x head_dim")),
        "self_attention.q_layernorm.weight": ((kv, "head_dim"),),
        "self_attention.k_layernorm.weight": ((kv, "head_dim"),),
        "mlp.linear_fc1.weight": gate + (ffn, h), "mlp.linear_fc1.bias": gate + (ffn,),
        "mlp.linear_fc2.weight": (h, ffn), "mlp.linear_fc2.bias": (h,),
    }
    if a.num_experts:
        experts = (a.num_experts, "experts")
        table.update({"mlp.router.weight": (experts, h), "mlp.router.expert_bias": (experts,)})
    if a.shared_expert_size:
        shared = (a.shared_expert_size, "shared_expert_intermediate_size")
        table.update({"mlp.shared_experts.linear_fc1.weight": ((2, "gate and up"), shared, h),
                      "mlp.shared_experts.linear_fc2.weight": (h, shared),
                      "mlp.shared_experts.gate_weight": ((1, "1"), h)})
    if isinstance(a, DeepseekArch):
        table.update(_mla_shapes(a, h))
    expert = _EXPERT.match(local)
    if expert and a.num_experts:
        moe_ffn = (a.moe_ffn_hidden_size, "moe_intermediate_size")
        return ((2, "gate and up"), moe_ffn, h) if expert.group(1) == "linear_fc1" else (h, moe_ffn)
    if local not in table:
        raise RuntimeError(f"hf_checks.megatron_shape knows no shape for {name}: add it")
    return table[local]


def _mla_shapes(a: DeepseekArch, h) -> Dict[str, Dims]:
    heads, rope = a.num_attention_heads, a.qk_pos_emb_head_dim
    q_rows = (heads * (a.qk_head_dim + rope), "num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim)")
    q_lora, kv_lora = (a.q_lora_rank, "q_lora_rank"), (a.kv_lora_rank, "kv_lora_rank")
    return {"self_attention.linear_q_proj.weight": (q_rows, h), "self_attention.linear_q_down_proj.weight": (q_lora, h),
            "self_attention.q_layernorm.weight": (q_lora,), "self_attention.linear_q_up_proj.weight": (q_rows, q_lora),
            "self_attention.linear_kv_down_proj.weight": (
                (a.kv_lora_rank + rope, "kv_lora_rank + qk_rope_head_dim"), h),
            "self_attention.kv_layernorm.weight": (kv_lora,),
            "self_attention.linear_kv_up_proj.weight": (
                (heads * (a.qk_head_dim + a.v_head_dim), "num_attention_heads x (qk_nope_head_dim + v_head_dim)"),
                kv_lora),
            "self_attention.linear_proj.weight": (h, (heads * a.v_head_dim, "num_attention_heads x v_head_dim"))}


def _shape_error(model_type: str, rule: Rule, reader, megatron: str = "", got=None, want: Dims = ()) -> ConversionError:
    labels = _LABELS.get(model_type, {})
    tensors = ", ".join(f"{k} {list(reader.shape(k))}" for k in rule.hf)
    if not want:
        return ConversionError(f"{tensors}: these shapes do not fit config.json (its sizes cannot arrange them as "
                               f"{', '.join(rule.megatron)}): correct config.json")
    sizes = " x ".join(str(n) for n, _ in want)
    names = ", ".join(labels.get(what, what) for _, what in want)
    return ConversionError(f"{tensors} do not fit config.json: its sizes ({names}) make {megatron} [{sizes}], these "
                           f"tensors [{' x '.join(map(str, got))}]: correct config.json (or use the files it was "
                           "written with)")


# ------------------------------------------------------------------ the tie
def _equal(reader, a: str, b: str) -> bool:
    """transformers' test of a tie (``torch.equal`` of the loaded weights), a slab of rows at a time."""
    if reader.shape(a) != reader.shape(b):
        return False
    rows = reader.shape(a)[0] if reader.shape(a) else 1
    row_bytes = max(1, reader.entries[a][2] // max(rows, 1))
    step = max(1, _TIE_CHUNK_BYTES // row_bytes)
    return all(torch.equal(reader.read_rows(a, i, i + step).float(), reader.read_rows(b, i, i + step).float())
               for i in range(0, rows, step))


def _untied_if_contradicted(model_type: str, a: Arch, reader) -> Tuple[Arch, str]:
    """``a`` untied where ``tie_word_embeddings`` is true but the files hold another ``lm_head.weight``
    (what transformers then computes), and the line saying so; ``a`` as it is otherwise."""
    if not a.tied or "lm_head.weight" not in reader.entries:
        return a, ""
    embedding = next(r.hf[0] for r in rules_for(model_type, a, importing=True) if r.megatron == (_EMBEDDING,))
    if _equal(reader, "lm_head.weight", embedding):
        return a, ""  # a tied copy (some files keep one)
    return dataclasses.replace(a, tied=False), (
        f"config.json says tie_word_embeddings, but lm_head.weight differs from {embedding}: transformers then keeps "
        "both (it does not tie them), and so does this checkpoint: converted untied "
        "(--untie-embeddings-and-output-weights)")


# ------------------------------------------------------------------ the plan
@dataclasses.dataclass(frozen=True)
class ImportPlan:
    """What from-hf writes: each Megatron tensor's shape and the rule that makes it, checked against the files."""

    model_type: str
    arch: Arch
    owner: Dict[str, Rule]  # "model.<megatron name>" -> its rule
    shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]]
    dtype: str  # the source's tensor dtype (float32 where they differ)
    note: str  # what the check changed, one line ("" if nothing)


def read_config(source: Path) -> Dict[str, Any]:
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source}: no config.json (a HuggingFace model directory, as save_pretrained "
                                "writes it, holds config.json and model.safetensors or shards with an index)")
    try:
        config = json.loads((source / "config.json").read_text())
    except ValueError as exc:
        raise ConversionError(f"{source / 'config.json'} does not parse as JSON ({exc}): correct it") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{source / 'config.json'} holds no JSON object: correct it")
    return config


def plan_import(source: Path, config: Mapping[str, Any], reader) -> ImportPlan:
    """Every check of the module docstring, then the plan (on meta tensors; check-only rules read theirs)."""
    check_types(config)
    model_type, arch = arch_from_hf(_Required(config), reader.entries)
    if arch.num_attention_heads % arch.num_query_groups:
        raise ConversionError(f"num_key_value_heads {arch.num_query_groups} does not divide num_attention_heads "
                              f"{arch.num_attention_heads} (each key/value head serves a whole group of query "
                              "heads): correct config.json")
    check_window(model_type, config)
    if arch.num_experts and arch.moe_router_topk == 1 and not arch.moe_router_pre_softmax and \
            getattr(arch, "score_function", "softmax") == "softmax":
        raise ConversionError(f"{model_type} with num_experts_per_tok 1 and renormalized router weights (each token's "
                              "expert weighted 1): Megatron-Core builds top-1 routing only with "
                              "--moe-router-pre-softmax (weighted by the expert's probability), so the job has no "
                              "such model; not converted")
    arch, note = _untied_if_contradicted(model_type, arch, reader)
    fused = any(k.endswith(".mlp.experts.gate_up_proj") for k in reader.entries)
    rules = rules_for(model_type, arch, fused_experts=fused, importing=True)
    needed = {k for r in rules for k in r.hf}
    present = {k for k in reader.entries if not _NOT_WEIGHTS.search(k)}
    if arch.tied:
        present.discard("lm_head.weight")  # the tied copy, equal to the embedding (checked)
    unknown, missing = sorted(present - needed), sorted(needed - present)
    if unknown or missing:
        raise ConversionError(f"{source} is not the {model_type} model its config.json describes: "
                              + (f"tensors without a Megatron place: {unknown[:6]}; " if unknown else "")
                              + (f"missing tensors: {missing[:6]}" if missing else ""))
    owner: Dict[str, Rule] = {}
    shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
    for rule in rules:
        meta = [torch.empty(reader.shape(k), dtype=torch.float32, device="meta") for k in rule.hf]
        try:
            made = rule.from_hf(*meta)
        except ConversionError:
            raise
        except (RuntimeError, ValueError, IndexError):  # a reshape the config's sizes cannot make
            raise _shape_error(model_type, rule, reader) from None
        if not made:  # a check only (q/k/v biases HF has and this Megatron model has not; MTP copies)
            rule.from_hf(*(reader.read(k) for k in rule.hf))
            continue
        for name, t in zip(rule.megatron, made):
            want = megatron_shape(name, arch)
            if tuple(t.shape) != tuple(n for n, _ in want):
                raise _shape_error(model_type, rule, reader, name, tuple(t.shape), want)
            owner["model." + name] = rule
            shapes["model." + name] = (tuple(t.shape), torch.float32)
    dtypes = {reader.dtype(k) for k in needed}
    dtype = str(dtypes.pop()).replace("torch.", "") if len(dtypes) == 1 else "float32"
    return ImportPlan(model_type, arch, owner, shapes, dtype, note)

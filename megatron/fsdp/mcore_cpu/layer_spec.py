"""CPU model parts for Megatron-Core: the layer spec GPTModel builds on CPU processes (no TE, no CUDA kernels).

``cpu_layer_spec(config)`` is GPTModel's block spec: Megatron's local spec with
``SDPACoreAttention`` (``scaled_dot_product_attention``, grouped-query attention through its
``enable_gqa``; under context parallelism it all-gathers K/V over the CP group) and
``CpuNorm`` (torch LayerNorm or RMSNorm, also for qk-layernorm; accepts sequence parallel),
dense or MoE per layer as ``config.moe_layer_freq`` says. Rotary embeddings need no kernel:
with ``apply_rope_fusion=False`` Megatron-Core's unfused RoPE is plain torch.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

class _AllGatherSequence(torch.autograd.Function):
    """All-gather along dim 0; backward sums the gradient and keeps this rank's slice.
    (torch.distributed.nn.all_gather's gloo backward addresses subgroup ranks by global rank.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((group.size() * x.size(0), *x.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.group.size())[ctx.group.rank()], None


def _load_balanced_positions(cp_size: int, cp_rank: int, chunk: int) -> torch.Tensor:
    """Positions ``cp_rank`` holds: chunks ``r`` and ``2*cp-1-r`` of ``2*cp`` (get_batch_on_this_cp_rank)."""
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return torch.cat([first, second])


class SDPACoreAttention(MegatronModule):
    """``core_attention`` on ``F.scaled_dot_product_attention`` (DotProductAttention has no
    context parallelism). ``[s, b, heads, dim]`` in, ``[s, b, heads * dim]`` out; the mask is
    Megatron's (True = masked out).

    Under context parallelism K/V are all-gathered over the CP group into global order and
    the local queries (two load-balanced chunks) attend to them. ``get_batch_on_this_cp_rank``
    slices the mask's queries only (``[b, 1, s_local, s]``), so it applies as is; without one
    the causal mask comes from token positions. Exact, not a ring: for numerics, O(s) memory.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, pg_collection=None, **read_from_tensors):
        # ``read_from_tensors``: DotProductAttention's keywords SDPA has no use for: k_channels/v_channels
        # (multi-latent attention's query/key and value head sizes differ; SDPA reads them from the tensors,
        # MLA passes its own YaRN softmax_scale) and cp_comm_type (K/V are always all-gathered here).
        unknown = sorted(set(read_from_tensors) - {"k_channels", "v_channels", "cp_comm_type"})
        if unknown:
            raise TypeError(f"SDPACoreAttention got an unexpected keyword argument {unknown[0]!r}")
        super().__init__(config=config)
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError("SDPACoreAttention supports softmax_type='vanilla' only")
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None

    def _context_parallel_group(self):
        if self.cp_group is not None:
            return self.cp_group
        if self.config.context_parallel_size > 1:
            return parallel_state.get_context_parallel_group()
        return None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: packed sequences and attention bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        allowed = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        causal = allowed is None and mask_type == AttnMaskType.causal
        group = self._context_parallel_group()
        if group is not None and group.size() > 1:
            key, value, allowed = self._gather_context(group, key, value, allowed, causal)
            causal = False
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        dropout = self.dropout_p if self.training else 0.0
        # As DotProductAttention: dropout under the model-parallel stream unless sequence parallel.
        rng = (tp_random.get_cuda_rng_tracker().fork()
               if dropout > 0 and not self.config.sequence_parallel else contextlib.nullcontext())
        with rng:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=dropout, is_causal=causal,
                scale=self.softmax_scale, enable_gqa=k.size(1) != q.size(1))
        return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)

    @staticmethod
    def _gather_context(group, key, value, allowed, causal):
        cp_size, cp_rank = group.size(), group.rank()
        local = key.size(0)
        chunk = local // 2
        order = torch.cat([_load_balanced_positions(cp_size, r, chunk) for r in range(cp_size)])
        inverse = torch.argsort(order)  # gathered row -> global position

        def to_global(t):
            return _AllGatherSequence.apply(t, group).index_select(0, inverse)

        key, value = to_global(key), to_global(value)
        if allowed is not None:
            if allowed.size(-1) != key.size(0):
                raise ValueError(f"context parallel attention needs the mask's key dimension to be "
                                 f"the full sequence ({key.size(0)}), got {tuple(allowed.shape)}")
        elif causal:
            positions = _load_balanced_positions(cp_size, cp_rank, chunk)
            allowed = torch.arange(key.size(0))[None, :] <= positions[:, None]
        return key, value, allowed


class ZeroCentredLayerNorm(torch.nn.LayerNorm):
    """``layernorm_zero_centered_gamma`` (Megatron-LM's ``--apply-layernorm-1p``), as apex's and
    Transformer Engine's norms have it: gamma is stored minus one (initialised to 0) and the
    norm scales by ``1 + gamma``, so weight decay pulls the scale towards 1."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.elementwise_affine:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCentredRMSNorm(torch.nn.RMSNorm):
    """RMSNorm with the zero-centred gamma of ``ZeroCentredLayerNorm``."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.elementwise_affine:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


class CpuNorm:
    """torch LayerNorm/RMSNorm that accepts sequence parallel (WrappedTorchNorm asserts).

    Its parameters are tagged ``sequence_parallel`` as apex/TE norms are, so
    ``finalize_model_grads`` all-reduces their gradients over the TP group.
    """

    def __new__(cls, config, hidden_size, eps=1e-5, **_unused):
        centred = config.layernorm_zero_centered_gamma  # --apply-layernorm-1p
        if config.normalization == "RMSNorm":
            norm = (ZeroCentredRMSNorm if centred else torch.nn.RMSNorm)(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = (ZeroCentredLayerNorm if centred else torch.nn.LayerNorm)(hidden_size, eps=eps,
                                                                               dtype=config.params_dtype)
        else:
            raise NotImplementedError(f"CpuNorm: normalization={config.normalization!r}")
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def _cpu_layer(spec):
    """A copy of one local layer spec with SDPA core attention and CPU norms."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.torch_norm import L2Norm

    layer = copy.deepcopy(spec)
    sub = layer.submodules
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(sub, name) is not IdentityOp:
            setattr(sub, name, CpuNorm)
    attention = sub.self_attention.submodules
    attention.core_attention = SDPACoreAttention
    for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):  # kv_layernorm: multi-latent attention
        if getattr(attention, name, IdentityOp) not in (IdentityOp, L2Norm):
            setattr(attention, name, CpuNorm)
    return layer


def _moe_layer_pattern(config):
    """1 (MoE) or 0 (dense) per layer of the whole model, as ``get_gpt_decoder_layer_specs`` reads
    ``moe_layer_freq``: an int N is an MoE layer every N layers from the first, a list is per layer."""
    if config.num_moe_experts is None:
        return [0] * config.num_layers
    freq = config.moe_layer_freq
    pattern = [1 if i % freq == 0 else 0 for i in range(config.num_layers)] if isinstance(freq, int) else list(freq)
    if len(pattern) != config.num_layers:
        raise ValueError(f"moe_layer_freq {freq} has {len(pattern)} entries for {config.num_layers} layers")
    return pattern


def cpu_layer_spec(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None, fp8=None,
                   **local_spec_kwargs):
    """GPT spec for CPU: Megatron's local layer specs with SDPA attention and CPU norms.

    A ``TransformerBlockSubmodules`` (GPTModel's ``transformer_layer_spec`` accepts it) of this
    stage's layers (``vp_stage``/``pp_rank`` as in ``get_num_layers_to_build``), dense or MoE per
    layer as ``config.moe_layer_freq`` says (``get_gpt_decoder_block_spec``'s reading), and a CPU
    final norm: with a bare layer spec TransformerBlock picks a final norm that rejects sequence
    parallel. Normalization (LayerNorm/RMSNorm), qk-layernorm and the MoE settings come from the
    config; ``local_spec_kwargs`` override what goes to ``get_gpt_layer_local_spec``. ``fp8``: an
    ``fp8_matmul.Fp8Recipe``; the layers it puts in FP8 (not those ``--first-last-layers-bf16`` keeps out)
    get ``fp8_linears``' FP8 linears.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules, get_num_layers_to_build, get_transformer_layer_offset)

    local_spec_kwargs.setdefault("num_experts", config.num_moe_experts)
    local_spec_kwargs.setdefault("moe_grouped_gemm", config.moe_grouped_gemm)
    local_spec_kwargs.setdefault("qk_layernorm", config.qk_layernorm)
    local_spec_kwargs.setdefault("normalization", config.normalization)
    local_spec_kwargs.setdefault("multi_latent_attention", getattr(config, "multi_latent_attention", False))
    moe = _cpu_layer(get_gpt_layer_local_spec(**local_spec_kwargs))
    dense = _cpu_layer(get_gpt_layer_local_spec(**{**local_spec_kwargs, "num_experts": None,
                                                   "moe_grouped_gemm": False}))
    if local_spec_kwargs["num_experts"] is None:
        pattern = [0] * config.num_layers
    else:
        pattern = _moe_layer_pattern(config) if config.num_moe_experts is not None else [1] * config.num_layers
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    layers = [moe if is_moe else dense for is_moe in pattern[offset:offset + count]]
    if fp8 is not None:
        from .fp8_linears import fp8_layer_spec

        layers = [fp8_layer_spec(spec, fp8) if fp8.in_fp8(offset + i, config.num_layers) else spec
                  for i, spec in enumerate(layers)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=CpuNorm)


def cpu_mtp_block_spec(config, block_spec, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None,
                       fp8=None):
    """The multi-token prediction block of this stage on CPU (None off the MTP stage): Megatron-Core's
    local MTP spec around ``block_spec``'s last layer (Megatron-LM's choice), with CPU norms for its
    embedding, hidden-state and final norms (the local ones reject sequence parallel). With ``fp8`` every
    linear of the MTP layers is FP8, whatever ``--first-last-layers-bf16`` says (Megatron-Core runs MTP
    under its global FP8 context)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    spec = get_gpt_mtp_block_spec(config, block_spec, use_transformer_engine=False, vp_stage=vp_stage,
                                  pp_rank=pp_rank)
    if spec is None:
        return None
    spec = copy.deepcopy(spec)
    for layer in spec.layer_specs:
        for name in ("enorm", "hnorm", "layer_norm"):
            setattr(layer.submodules, name, CpuNorm)
    if fp8 is not None:
        from .fp8_linears import fp8_layer_spec

        spec.layer_specs = [fp8_layer_spec(layer, fp8) for layer in spec.layer_specs]
    return spec

"""The model's flags: its size, architecture (Llama, Qwen, Mistral, DeepSeek shapes), multi-latent attention,
multi-token prediction, and the kernels and fusions its layers run with.

Megatron-LM's names, defaults and meanings; the shape flags map one to one onto Megatron-Core's
``TransformerConfig`` and ``GPTModel`` (``model_shape.py``, outside this package: the logs and the
checkpoint tools read it too). A kernel this machine lacks is substituted and said in the start-up
line (the providers below); a flag that would change the mathematics is refused with one line. The
mixture-of-experts flags are ``moe.py``'s. docs/training.md ("Llama-class models: the architecture
flags") and docs/arguments.md ("Coming from Megatron-LM") say what each does here.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import List

import torch

from ..errors import refuse
from ..model_shape import swiglu_ffn_hidden_size
from .substitutions import Substitution

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's ``_add_network_size_args`` / ``_add_regularization_args``, MLA and MTP; the kernel and fusion
    switches in a group of their own."""
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4, help="transformer layers")
    g.add_argument("--hidden-size", type=int, default=128, help="model width")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, default=4, help="attention heads")
    g.add_argument("--seq-length", type=int, default=128, help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: seq length")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="standard deviation of the normal initialisation of the weights")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="a separate output layer instead of the input embedding's transpose")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   help="no biases in linear layers (needed with --num-experts)")
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
    g.add_argument("--apply-layernorm-1p", dest="layernorm_zero_centered_gamma", action="store_true",
                   help="norms store gamma - 1 (zero-centred, initialised to 0) and scale by 1 + gamma")
    g.add_argument("--no-position-embedding", dest="add_position_embedding", action="store_false",
                   help="deprecated in Megatron-LM: no effect with --position-embedding-type rope, refused otherwise "
                        "(use --position-embedding-type none)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="average the loss over all tokens of the global batch, not per micro-batch "
                        "then over micro-batches")
    _add_mla_and_mtp_args(g)
    _add_kernel_args(p.add_argument_group("kernels and fusions"))


def _add_mla_and_mtp_args(g) -> None:
    """DeepSeek-V3's attention and multi-token prediction: multi-latent attention (with YaRN RoPE), MTP layers."""
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


def _add_kernel_args(g) -> None:
    """How this launch computes, not what the model is: the layers' implementation and the kernel and fusion
    switches. Each picks an implementation of the same mathematics (substituted where missing), so a checkpoint
    does not record them and a later launch (generation, a resume elsewhere) chooses its own."""
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="initialise weights on the CPU (always so on CPU runs); GPU runs build on the device")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="layer implementation (transformer_engine without Transformer Engine installed: local, said "
                        "at start-up)")
    g.add_argument("--use-mcore-models", action="store_true",
                   help="deprecated in Megatron-LM; models are always Megatron-Core's here (no effect)")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false",
                   help="do not fuse scaling, masking and softmax (the fused kernel needs CUDA)")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false",
                   help="do not fuse the bias add and GeLU")
    g.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false",
                   help="do not fuse the bias add and SwiGLU")
    g.add_argument("--no-rope-fusion", dest="apply_rope_fusion", action="store_false",
                   help="do not fuse rotary position embedding (the fused kernel needs Transformer Engine)")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="fuse the vocabulary-parallel cross entropy (Megatron-Core's native kernel; CUDA, unfused "
                        "without it, said at start-up)")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="attention backend (Transformer Engine chooses with auto); on CPU always PyTorch SDPA "
                        "(said at start-up)")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="FlashAttention (Megatron-LM no longer reads it: --attention-backend decides; said at "
                        "start-up)")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
                   help="do not fuse the weight-gradient accumulation into the linear layers' backward (APEX's "
                        "fused_weight_gradient_mlp_cuda); without that kernel (CPU) unfused is the only behaviour")
    g.add_argument("--enable-experimental", action="store_true",
                   help="enable Megatron-Core's experimental features (megatron.core.config.set_experimental_flag)")



def _cuda() -> bool:
    return torch.cuda.is_available()


# ----------------------------------------------------------------------------- rules (parser.validate_args's order)

def validate_shape(args: argparse.Namespace) -> None:
    """Derive Megatron-LM's architecture defaults and check them, before the head and MLP sizes are checked
    (--kv-channels relaxes hidden % heads)."""
    tp = args.tensor_model_parallel_size
    heads = args.num_attention_heads
    if args.kv_channels is None:
        if heads < 1 or args.hidden_size % heads:
            refuse(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {heads}; "
                  "change one, or set --kv-channels (channels per head) explicitly")
        args.kv_channels = args.hidden_size // heads
    elif args.kv_channels < 1:
        refuse(f"--kv-channels={args.kv_channels} must be at least 1")
    if args.num_query_groups is not None and not args.group_query_attention:
        refuse("--num-query-groups needs --group-query-attention (without it every head has its own keys "
              "and values)")
    if args.group_query_attention:
        groups = args.num_query_groups = args.num_query_groups or 1
        if groups < 1 or heads % groups:
            refuse(f"--num-query-groups {groups} must divide --num-attention-heads {heads}")
        if groups % tp:
            refuse(f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp}: every "
                  "tensor-parallel rank needs whole key/value groups")
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(args, name)
        if not 0.0 <= value < 1.0:
            refuse(f"--{name.replace('_', '-')}={value} must be in [0, 1)")
    if args.norm_epsilon <= 0:
        refuse(f"--norm-epsilon={args.norm_epsilon} must be positive")
    if args.position_embedding_type == "rope":
        if not 0.0 < args.rotary_percent <= 1.0:
            refuse(f"--rotary-percent={args.rotary_percent} must be in (0, 1]")
        rotated = int(args.kv_channels * args.rotary_percent)
        if rotated < 2 or rotated % 2:
            refuse(f"--rotary-percent {args.rotary_percent} x --kv-channels {args.kv_channels} = {rotated} rotated "
                  "channels per head; RoPE needs an even number of at least 2")
        if args.rotary_base < 1:
            refuse(f"--rotary-base={args.rotary_base} must be positive")
    if args.swiglu and args.ffn_hidden_size is None:
        args.ffn_hidden_size = swiglu_ffn_hidden_size(args.hidden_size)
        if args.ffn_hidden_size < 1:
            refuse(f"--swiglu: the default --ffn-hidden-size for --hidden-size {args.hidden_size} rounds to 0; "
                  "set --ffn-hidden-size")


def validate_mla_and_mtp(args: argparse.Namespace) -> None:
    """Megatron-LM's and Megatron-Core's rules for multi-latent attention and multi-token prediction."""
    if args.multi_latent_attention:
        if args.group_query_attention:
            refuse("--multi-latent-attention and --group-query-attention exclude each other (Megatron-LM's rule): "
                  "MLA compresses keys and values itself")
        for name in ("kv_lora_rank", "qk_head_dim", "v_head_dim", "qk_pos_emb_head_dim"):
            if getattr(args, name) < 1:
                refuse(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
        if args.qk_pos_emb_head_dim % 2:
            refuse(f"--qk-pos-emb-head-dim {args.qk_pos_emb_head_dim} must be even (RoPE rotates channel pairs)")
        if args.q_lora_rank is not None and args.q_lora_rank < 1:
            refuse(f"--q-lora-rank={args.q_lora_rank} must be at least 1 (or left out: a full-rank query)")
        if args.position_embedding_type != "rope":
            refuse("--multi-latent-attention applies its YaRN RoPE to the --qk-pos-emb-head-dim channels: it needs "
                  "--position-embedding-type rope")
    mtp = args.mtp_num_layers
    if mtp is not None:
        if mtp < 1:
            refuse(f"--mtp-num-layers={mtp} must be at least 1 (or left out)")
        if args.position_embedding_type not in ("learned_absolute", "rope", "none"):
            refuse("--mtp-num-layers needs --position-embedding-type learned_absolute, rope or none")


def derive_sizes(args: argparse.Namespace) -> None:
    """The MLP width and the position table's length where not given (after --swiglu's default)."""
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.max_position_embeddings < args.seq_length:
        refuse(f"--max-position-embeddings {args.max_position_embeddings} is shorter than --seq-length {args.seq_length}")


def validate_kernels(args: argparse.Namespace) -> None:
    """The deprecated position-embedding switch and what zero-centred norms need on CUDA."""
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        refuse("--no-position-embedding is deprecated (Megatron-LM refuses it too unless --position-embedding-type "
              "rope, where it has no effect): use --position-embedding-type none")
    if args.layernorm_zero_centered_gamma and _cuda() and args.transformer_impl == "local" \
            and importlib.util.find_spec("apex") is None:
        refuse("--apply-layernorm-1p on CUDA needs apex (FusedLayerNorm) or --transformer-impl transformer_engine: "
              "Megatron-Core's torch norm has no zero-centred gamma")


def fused_accumulation_kernel() -> bool:
    """Whether this machine has the kernel ``gradient_accumulation_fusion`` needs (APEX, on a GPU)."""
    return torch.cuda.is_available() and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def gradient_accumulation_fusion(args: argparse.Namespace) -> bool:
    """The value for ``TransformerConfig``: asked for (Megatron-LM's default) and possible here."""
    return bool(getattr(args, "gradient_accumulation_fusion", False)) and fused_accumulation_kernel()


def validate_gradient_accumulation_fusion(args: argparse.Namespace) -> None:
    """The fused accumulation writes ``param.main_grad``, which ``--use-megatron-fsdp`` replaces."""
    if args.gradient_accumulation_fusion and args.use_megatron_fsdp and fused_accumulation_kernel():
        refuse("gradient accumulation fusion (on by default) writes weight gradients into "
              "param.main_grad, which --use-megatron-fsdp replaces with flat sharded buffers: add "
              "--no-gradient-accumulation-fusion (a required flag of the Megatron-FSDP user guide)")


def enable_experimental(args: argparse.Namespace) -> None:
    if args.enable_experimental:
        from megatron.core.config import set_experimental_flag

        set_experimental_flag(True)


def resolve_transformer_impl(args: argparse.Namespace) -> None:
    """``--transformer-impl transformer_engine`` without Transformer Engine: Megatron-Core's own layers."""
    if args.transformer_impl == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
        # Only the layers' implementation differs (the same mathematics): Megatron-Core's own layers run instead,
        # said in the start-up substitution line (kernel_substitutions reads what was asked for).
        args.transformer_impl_requested, args.transformer_impl = args.transformer_impl, "local"


# ----------------------------------------------------------------------------- what Megatron-Core is given

def transformer_config_fields(args, cpu: bool) -> dict:
    """The TransformerConfig fields of the kernel, fusion, norm and recompute-module flags (Megatron-LM's
    core_transformer_config_from_args). Fused kernels need CUDA (and apex / Transformer Engine for some):
    on CPU every fusion is off, which computes the same function."""
    from megatron.core.transformer.enums import AttnBackend

    have_te = args.transformer_impl == "transformer_engine"
    bias_fusion = args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion
    return dict(
        masked_softmax_fusion=args.masked_softmax_fusion and not cpu,
        # Megatron-LM turns the bias-GeLU fusion off with --disable-bias-linear (SwiGLU's works without a bias).
        bias_activation_fusion=bias_fusion and (args.add_bias_linear or args.swiglu) and not cpu,
        apply_rope_fusion=args.apply_rope_fusion and have_te and args.position_embedding_type == "rope",
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion and not cpu,
        layernorm_zero_centered_gamma=args.layernorm_zero_centered_gamma,
        recompute_modules=args.recompute_modules,
        attention_backend=AttnBackend[args.attention_backend],
    )


# ----------------------------------------------------------------------------- substitutions (substitutions.py)

def kernel_substitutions(args: argparse.Namespace) -> List[Substitution]:
    """The layers, attention and loss kernels asked for that this machine lacks."""
    cpu = not _cuda()
    te = args.transformer_impl == "transformer_engine"
    out = []
    if getattr(args, "transformer_impl_requested", None) not in (None, args.transformer_impl):
        out.append(Substitution(f"--transformer-impl {args.transformer_impl_requested}",
                                f"--transformer-impl {args.transformer_impl} (Megatron-Core's own layers)",
                                "Transformer Engine not installed"))
    attention = "PyTorch SDPA" if cpu else "Megatron-Core's local DotProductAttention"
    if args.attention_backend not in ("auto", "local") and (cpu or not te):
        out.append(Substitution(f"--attention-backend {args.attention_backend}", attention,
                                "no CUDA" if cpu else "Transformer Engine not used"))
    if args.use_flash_attn:
        why = "no CUDA" if cpu else ("flash-attn not installed" if importlib.util.find_spec("flash_attn") is None
                                     else "Megatron-LM no longer reads this flag")
        out.append(Substitution("--use-flash-attn", attention, why))
    if args.cross_entropy_loss_fusion and cpu:
        out.append(Substitution("--cross-entropy-loss-fusion", "unfused vocab-parallel cross entropy", "no CUDA"))
    return out


def mcore_models_substitutions(args: argparse.Namespace) -> List[Substitution]:
    if args.use_mcore_models:
        return [Substitution("--use-mcore-models", "nothing", "models are always Megatron-Core's")]
    return []


def gradient_accumulation_substitutions(args: argparse.Namespace) -> List[Substitution]:
    if getattr(args, "gradient_accumulation_fusion", False) and not fused_accumulation_kernel():
        return [Substitution("gradient accumulation fusion (Megatron-LM's default)", "unfused accumulation by autograd",
                             "no fused_weight_gradient_mlp_cuda kernel: it needs APEX on a GPU")]
    return []

"""The mixture-of-experts flags: experts, shared experts, the router (DeepSeek-V3's sigmoid routing with an expert
bias, group-limited top-k), the token dispatcher, and the expert section's parallelism and levels.

Megatron-LM's names, defaults and meanings (its rules are checked here before any process group
exists); the ``TransformerConfig`` fields are ``model_shape.py``'s and ``model.py``'s (outside this
package). The dispatcher kernels this machine lacks are substituted: ``dispatcher_substitutions`` says
so with ``moe_dispatch.py``'s decisions, from which the configuration is built too. docs/moe.md says
what each does here.
"""

from __future__ import annotations

import argparse
import ast
from typing import List, Union

from megatron.fsdp.sharding.strategy import parse_mesh_strategy, parse_strategy

from ..errors import refuse
from ..model_shape import ROUTER_FIELDS, moe_layer_pattern
from ..moe_dispatch import FLEX_BACKEND_MODULES
from .substitutions import Substitution

SCORE_FUNCTIONS = ("softmax", "sigmoid")
ROUTER_DTYPES = ("fp32", "fp64")
_ROUTER_DEFAULTS = dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
                        moe_router_bias_update_rate=1e-3, moe_router_group_topk=None, moe_router_num_groups=None,
                        moe_router_topk_scaling_factor=None, moe_router_dtype=None,
                        moe_router_force_load_balancing=False)


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


def add_moe_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (default: dense MLPs)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts per token")
    g.add_argument("--moe-token-dispatcher-type", choices=["alltoall", "allgather", "flex"], default="allgather",
                   help="flex: DeepEP/HybridEP kernels (--moe-flex-dispatcher-backend), alltoall where missing")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="default: --ffn-hidden-size")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="EP: ranks the experts of a layer are split across")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="default: tensor parallel size")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="one grouped GEMM for the local experts (Megatron-Core 0.17+'s local layer spec has none: "
                        "SequentialMLP, said at start-up)")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="weight of the router's load-balancing loss (logged when > 0)")
    g.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"],
                   default="aux_loss", help="the router's balancing loss")
    g.add_argument("--expert-data-parallel-sharding-strategy", default=None,
                   help="level of the expert section (default: --data-parallel-sharding-strategy)")
    g.add_argument("--expert-outer-dp-sharding-strategy", default=None,
                   help="expert outer level (default: --outer-dp-sharding-strategy)")
    g.add_argument("--expert-num-distributed-optimizer-instances", type=int, default=None,
                   help="expert outer axis size (default: --num-distributed-optimizer-instances)")
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
    _add_router_args(g)


def _add_router_args(g) -> None:
    """DeepSeek-V3's router and dispatcher flags: sigmoid routing with a learned expert bias, group-limited top-k."""
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



# ----------------------------------------------------------------------------- rules (parser.validate_args's order)

def validate_layers(args: argparse.Namespace) -> None:
    """Shared experts and which layers are MoE layers."""
    moe_flags = (args.moe_shared_expert_intermediate_size is not None or args.moe_layer_freq != 1
                 or args.moe_shared_expert_gate or args.moe_router_pre_softmax)
    if args.num_experts is None:
        if moe_flags:
            refuse("--moe-shared-expert-intermediate-size, --moe-shared-expert-gate, --moe-router-pre-softmax "
                  "and --moe-layer-freq need --num-experts")
        return
    shared = args.moe_shared_expert_intermediate_size
    if args.moe_shared_expert_gate and shared is None:
        refuse("--moe-shared-expert-gate gates the shared expert: it needs --moe-shared-expert-intermediate-size")
    if shared is not None and shared < 1:
        refuse(f"--moe-shared-expert-intermediate-size={shared} must be at least 1")
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        if freq < 1:
            refuse(f"--moe-layer-freq={freq} must be at least 1")
    else:
        if len(freq) != args.num_layers or any(v not in (0, 1) for v in freq):
            refuse(f"--moe-layer-freq {freq}: needs one 0 (dense) or 1 (MoE) per layer, "
                  f"{args.num_layers} in all (--num-layers)")
    if not any(moe_layer_pattern(args.moe_layer_freq, args.num_layers)):
        refuse(f"--moe-layer-freq {freq} makes no layer an MoE layer; drop --num-experts for a dense model")


def validate_router(args: argparse.Namespace) -> None:
    """Megatron-LM's and Megatron-Core's rules for the router flags."""
    router = [f for f in ROUTER_FIELDS if getattr(args, f) != _ROUTER_DEFAULTS[f]]
    if args.num_experts is None:
        if router:
            refuse(f"--{router[0].replace('_', '-')} configures the MoE router: it needs --num-experts")
        return
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        refuse("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (Megatron-Core's rule)")
    groups, group_topk = args.moe_router_num_groups, args.moe_router_group_topk
    if group_topk is not None:
        if groups is None:
            refuse("--moe-router-group-topk needs --moe-router-num-groups")
        if not 1 <= group_topk <= groups:
            refuse(f"--moe-router-group-topk {group_topk} must be between 1 and --moe-router-num-groups {groups}")
    if groups is not None:
        if groups < 1 or args.num_experts % groups:
            refuse(f"--moe-router-num-groups {groups} must divide --num-experts {args.num_experts}")
        if group_topk is not None and args.moe_router_topk > group_topk * (args.num_experts // groups):
            refuse(f"--moe-router-topk {args.moe_router_topk} exceeds the experts of {group_topk} groups of "
                  f"{args.num_experts // groups} (--moe-router-group-topk x experts per group)")
    if args.moe_router_bias_update_rate < 0:
        refuse(f"--moe-router-bias-update-rate={args.moe_router_bias_update_rate} must not be negative")


def validate_experts(args: argparse.Namespace, world_size: int) -> None:
    """Expert parallelism and the expert section's levels (Megatron-LM's rules, checked up front)."""
    expert_flags = ("expert_data_parallel_sharding_strategy", "expert_outer_dp_sharding_strategy",
                    "expert_num_distributed_optimizer_instances")
    if args.num_experts is None:
        if args.expert_model_parallel_size != 1:
            refuse("--expert-model-parallel-size needs --num-experts")
        return
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size = args.expert_tensor_parallel_size or tp
    if args.add_bias_linear:
        refuse("--num-experts needs --disable-bias-linear (Megatron-Core 0.16.1's expert layers have no biases)")
    if args.num_experts % ep:
        refuse(f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}")
    if not 1 <= args.moe_router_topk <= args.num_experts:
        refuse(f"--moe-router-topk {args.moe_router_topk} must be between 1 and --num-experts {args.num_experts}")
    if world_size % (etp * ep * pp):
        refuse(f"expert tensor ({etp}) x expert model ({ep}) x pipeline ({pp}) parallel = {etp * ep * pp} does not "
              f"divide the {world_size} ranks")
    if tp > 1 and not args.sequence_parallel:
        refuse("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (Megatron-Core's rule)")
    import torch

    if tp > 1 and args.moe_token_dispatcher_type == "alltoall" and not torch.cuda.is_available():
        refuse(f"--moe-token-dispatcher-type alltoall with --tensor-model-parallel-size {tp} does not run on gloo "
              "(CPU): it gathers uneven token counts over the TP group, which gloo's all_gather cannot "
              "(docs/moe.md, Limits); use --moe-token-dispatcher-type allgather, or NCCL on GPUs")
    args.moe_ffn_hidden_size = args.moe_ffn_hidden_size or args.ffn_hidden_size
    args.expert_data_parallel_size = world_size // (etp * ep * pp)
    if any(getattr(args, f) is not None for f in expert_flags) and not args.use_megatron_fsdp:
        refuse("--expert-data-parallel-sharding-strategy and the other expert levels need --use-megatron-fsdp")
    instances = args.expert_num_distributed_optimizer_instances or args.num_distributed_optimizer_instances
    if args.expert_data_parallel_size % instances:
        refuse(f"expert optimizer instances ({instances}) do not divide the expert data-parallel size "
              f"{args.expert_data_parallel_size}; set --expert-num-distributed-optimizer-instances to a divisor")
    if args.use_megatron_fsdp:
        inner = args.expert_data_parallel_sharding_strategy or args.data_parallel_sharding_strategy
        outer = args.expert_outer_dp_sharding_strategy or (
            args.outer_dp_sharding_strategy if instances > 1 else "no_shard")
        try:
            parse_strategy(inner)
            parse_mesh_strategy(inner, outer, instances > 1)
        except ValueError as exc:
            refuse(f"--expert-data-parallel-sharding-strategy / --expert-outer-dp-sharding-strategy: {exc}")


# ----------------------------------------------------------------------------- substitutions (substitutions.py)

def dispatcher_substitutions(args: argparse.Namespace) -> List[Substitution]:
    """``--moe-token-dispatcher-type flex`` (DeepEP/HybridEP kernels) -> the alltoall dispatcher, and
    ``--moe-permute-fusion`` (Transformer Engine's kernels) -> the unfused permutation: the same tokens
    reach the same experts with the same weights, only the kernels differ."""
    if getattr(args, "num_experts", None) is None:
        return []
    from .. import moe_dispatch

    found = []
    if args.moe_token_dispatcher_type == "flex" and not moe_dispatch.flex_runs_here(
            getattr(args, "moe_flex_dispatcher_backend", "deepep")):
        backend = args.moe_flex_dispatcher_backend
        found.append(Substitution(f"--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend {backend}",
                                  "alltoall", f"{FLEX_BACKEND_MODULES[backend]} and a GPU are not here"))
    if getattr(args, "moe_permute_fusion", False) and not moe_dispatch.permute_fusion_runs_here():
        found.append(Substitution("--moe-permute-fusion", "unfused permute",
                                  "Transformer Engine's fused permute needs it and a GPU"))
    if getattr(args, "moe_grouped_gemm", False) and moe_dispatch.local_spec_without_grouped_gemm(
            getattr(args, "transformer_impl", "transformer_engine")):
        from megatron.fsdp.mcore_releases import MCORE_VERSION_STRING

        found.append(Substitution("--moe-grouped-gemm", "SequentialMLP (one GEMM per expert)",
                                  f"Megatron-Core {MCORE_VERSION_STRING}'s local layer spec has no grouped GEMM "
                                  "without Transformer Engine"))
    return found

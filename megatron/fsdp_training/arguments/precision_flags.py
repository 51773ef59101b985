"""Precision flags: bf16/fp16 compute, the gradient reduction's dtype, the precision-aware optimizer's dtypes, and
FP8 training, with Megatron-LM's names, defaults and meanings, their rules and what runs them here.

bf16 compute keeps fp32 main weights; fp16 is refused (no loss scaling). The precision-aware
optimizer's dtypes below fp32 are the engine's optimizer's (Megatron-Core's needs Transformer Engine).
Megatron-LM generates the FP8 flags from ``TransformerConfig``'s fp8 fields (``--fp8-format`` is
``fp8``, ``--no-fp8-wgrad`` clears ``fp8_wgrad``, ``--fp8-param-gather`` sets ``fp8_param``) and hands
them to Transformer Engine. Here, with Transformer Engine importable the same fields go to
Megatron-Core's TE layers (``fp8_config_fields``); without it the CPU layers of
``megatron.fsdp.mcore_cpu.fp8_linears`` run the recipe's GEMMs with ``megatron.fsdp.precision.fp8``'s
quantizers (``cpu_recipe``), said in one start-up line (``fp8_start_up_line``). docs/precision.md
("Precision-aware optimizer", "FP8") says what each flag does here.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import List, Optional

from ..errors import refuse
from .substitutions import Substitution

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise", "custom")
BUILT_ON_CPU = ("tensorwise", "delayed", "mxfp8")
MX_BLOCK = 32  # megatron.fsdp.precision.fp8.MX_BLOCK (not imported: the parser runs before torch is needed)


def add_precision_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("precision and FP8")
    g.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 main weights")
    g.add_argument("--fp16", action="store_true", help="fp16 (rejected: needs loss scaling)")
    g.add_argument("--no-grad-reduce-in-fp32", dest="grad_reduce_in_fp32", action="store_false",
                   help="reduce gradients in the compute dtype instead of fp32")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="reduce gradients in bf16 (half the reduce-scatter bytes; needs --bf16); the fp32 main "
                        "gradients they are added into stay fp32")
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="allow Adam's moments and the main grads below fp32 (with --use-megatron-fsdp)")
    for flag, what in (("--exp-avg-dtype", "Adam's first moment"), ("--exp-avg-sq-dtype", "Adam's second moment"),
                       ("--main-grads-dtype", "the main gradients (bf16: accumulated and reduced in bf16)")):
        g.add_argument(flag, choices=["fp32", "bf16"], default="fp32", help=f"dtype of {what}")
    g.add_argument("--main-params-dtype", choices=["fp32"], default="fp32",
                   help="dtype of the main weights (fp32 only: fp16 main params need Transformer Engine)")
    g.add_argument("--fp8-format", dest="fp8", choices=FORMATS, default=None,
                   help="FP8 GEMMs in the transformer layers: e4m3 everywhere, or hybrid (e4m3 inputs and weights, "
                        "e5m2 output gradients); Transformer Engine's layers where it is installed, the job's CPU "
                        "FP8 layers otherwise")
    g.add_argument("--fp8-recipe", choices=RECIPES, default="delayed",
                   help="scaling: tensorwise (current per-tensor amax), delayed (amax history), mxfp8 (32-element "
                        "blocks, E8M0 scales), blockwise (128x128 weight tiles; Transformer Engine only), custom "
                        "(Transformer Engine's quantizer factory; refused)")
    g.add_argument("--fp8-margin", type=int, default=0, help="scale = fp8 max / amax / 2^margin")
    g.add_argument("--fp8-amax-history-len", type=int, default=1,
                   help="delayed scaling: the amax history window, in optimizer steps here")
    g.add_argument("--fp8-amax-compute-algo", choices=("most_recent", "max"), default="most_recent",
                   help="delayed scaling: the amax a scale comes from (the window's max, or the newest)")
    g.add_argument("--no-fp8-wgrad", "--disable-fp8-wgrad", dest="fp8_wgrad", action="store_false",
                   help="weight-gradient GEMMs in the compute dtype instead of FP8 (Megatron-LM's fp8_wgrad=False)")
    g.add_argument("--fp8-param-gather", action="store_true",
                   help="keep the compute weights in FP8 and gather them in FP8 (needs --use-megatron-fsdp or "
                        "--use-distributed-optimizer; the latter without Transformer Engine gathers bf16 weights, "
                        "said at start-up)")
    g.add_argument("--first-last-layers-bf16", action="store_true",
                   help="keep the first and last transformer layers out of FP8 (not with --fp8-recipe delayed)")
    g.add_argument("--num-layers-at-start-in-bf16", type=int, default=1,
                   help="layers kept out of FP8 at the start, with --first-last-layers-bf16")
    g.add_argument("--num-layers-at-end-in-bf16", type=int, default=1,
                   help="layers kept out of FP8 at the end, with --first-last-layers-bf16")



# ----------------------------------------------------------------------------- rules (parser.validate_args's order)

def validate_fp16(args: argparse.Namespace) -> None:
    if args.fp16:
        refuse("--fp16 needs loss scaling, which is not implemented here; use --bf16")


def validate_grad_reduce_in_bf16(args: argparse.Namespace) -> None:
    if args.grad_reduce_in_bf16:
        if not args.bf16:
            refuse("--grad-reduce-in-bf16 needs --bf16 (an fp32 model's gradients are fp32)")
        args.grad_reduce_in_fp32 = False  # Megatron-LM: accumulate_allreduce_grads_in_fp32 = False


def validate_precision_aware_optimizer(args: argparse.Namespace) -> None:
    """Megatron-LM's rules for ``--use-precision-aware-optimizer`` and the dtype flags.

    The dtypes below fp32 need the flag and Adam; the engine's optimizer implements them
    (Megatron-Core's needs Transformer Engine). bf16 main grads imply gradients accumulated
    and reduced in bf16, as Megatron-LM does not turn on fp32 accumulation for them.
    """
    flags = {"--exp-avg-dtype": args.exp_avg_dtype, "--exp-avg-sq-dtype": args.exp_avg_sq_dtype,
             "--main-grads-dtype": args.main_grads_dtype}
    lowered = [f"{flag} {value}" for flag, value in flags.items() if value != "fp32"]
    if not args.use_precision_aware_optimizer:
        if lowered:
            refuse(f"{', '.join(lowered)} needs --use-precision-aware-optimizer (Megatron-LM's rule: the dtypes "
                  "can only be fp32 without it)")
        return
    if not args.use_megatron_fsdp:
        refuse("--use-precision-aware-optimizer is implemented by the megatron.fsdp optimizer: add --use-megatron-fsdp "
              "(Megatron-Core's own needs Transformer Engine's FusedAdam)")
    if args.optimizer != "adam":
        refuse(f"--use-precision-aware-optimizer only supports --optimizer adam, not {args.optimizer}")
    if args.main_grads_dtype == "bf16":
        if not args.bf16:
            refuse("--main-grads-dtype bf16 needs --bf16 (an fp32 model's gradients are fp32)")
        args.grad_reduce_in_fp32 = False


def transformer_engine_used(args: argparse.Namespace) -> bool:
    """Whether Megatron-Core's TE layers run (after ``validate_args`` fell back to local where TE is missing)."""
    return args.transformer_impl == "transformer_engine" and importlib.util.find_spec("transformer_engine") is not None


def _given_without_format(args: argparse.Namespace) -> List[str]:
    defaults = (("--fp8-recipe", args.fp8_recipe != "delayed"), ("--fp8-margin", args.fp8_margin != 0),
                ("--fp8-amax-history-len", args.fp8_amax_history_len != 1),
                ("--fp8-amax-compute-algo", args.fp8_amax_compute_algo != "most_recent"),
                ("--no-fp8-wgrad", not args.fp8_wgrad), ("--fp8-param-gather", args.fp8_param_gather),
                ("--first-last-layers-bf16", args.first_last_layers_bf16))
    return [flag for flag, given in defaults if given]


def validate_fp8(args: argparse.Namespace) -> None:
    """Megatron-LM's rules (``arguments.py``, ``TransformerConfig.__post_init__``), then what this job builds."""
    if args.fp8 is None:
        given = _given_without_format(args)
        if given:
            refuse(f"{', '.join(given)} configure FP8 training: add --fp8-format e4m3 or hybrid (without it the "
                  "model trains in --bf16 and these flags would do nothing)")
        return
    if args.fp8_param_gather and not (args.use_distributed_optimizer or args.use_megatron_fsdp):
        refuse("--fp8-param-gather only supported with distributed optimizer, torch fsdp2, megatron fsdp, or "
              "inference mode (Megatron-LM's rule): add --use-megatron-fsdp or --use-distributed-optimizer")
    if args.fp8_amax_history_len < 1:
        refuse(f"--fp8-amax-history-len {args.fp8_amax_history_len} must be at least 1")
    _check_delayed_only(args)
    if args.first_last_layers_bf16:
        if args.fp8_recipe == "delayed":
            refuse("--first-last-layers-bf16: Delayed scaling does not support first / last layer in BF16 "
                  "(Megatron-Core's rule): use --fp8-recipe tensorwise or mxfp8")
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        for flag, value in (("--num-layers-at-start-in-bf16", args.num_layers_at_start_in_bf16),
                            ("--num-layers-at-end-in-bf16", args.num_layers_at_end_in_bf16)):
            if not 0 <= value <= per_stage:
                refuse(f"{flag} {value} must be between 0 and the number of layers per pipeline stage ({per_stage})")
    if args.fp8_recipe == "custom":
        refuse("--fp8-recipe custom needs Transformer Engine's --fp8-quantizer-factory, which this job does not "
              "build: use --fp8-recipe delayed, tensorwise or mxfp8")
    if transformer_engine_used(args):
        if args.fp8_param_gather and args.use_megatron_fsdp and args.fp8_recipe == "blockwise":
            refuse("--fp8-param-gather with --fp8-recipe blockwise under --use-megatron-fsdp: megatron.fsdp does not "
                  "gather 128x128 tiles (a shard boundary may split one); drop --fp8-param-gather or use "
                  "--fp8-recipe mxfp8")
        return  # Transformer Engine checks its own recipes (and the GPU they need)
    if args.fp8_recipe not in BUILT_ON_CPU:
        refuse(f"--fp8-recipe {args.fp8_recipe}: without Transformer Engine the job's FP8 layers build "
              f"{', '.join(BUILT_ON_CPU)}; blockwise's 1x128 activation and gradient tiles are not built (its "
              "128x128 weight tiles are: megatron.fsdp.precision.fp8.quantize_blockwise): use --fp8-recipe mxfp8")
    import torch

    if torch.cuda.is_available():
        refuse("--fp8-format on a GPU needs Transformer Engine (--transformer-impl transformer_engine); the job's "
              "own FP8 layers are its CPU layers")
    if args.moe_grouped_gemm and args.num_experts is not None:
        refuse("--fp8-format with --moe-grouped-gemm: the CPU grouped GEMM has no FP8 path; drop --moe-grouped-gemm "
              "(each expert's GEMMs then run in FP8)")
    if args.fp8_recipe == "mxfp8":
        _check_mx_blocks(args)


def _check_delayed_only(args: argparse.Namespace) -> None:
    """Margin and amax history belong to delayed scaling alone: Megatron-Core's ``get_fp8_recipe`` hands them to
    Transformer Engine's ``DelayedScaling`` only (``Float8CurrentScaling``, ``MXFP8BlockScaling`` and
    ``Float8BlockScaling`` take the format alone), so under another recipe they would change nothing."""
    if args.fp8_recipe == "delayed":
        return
    given = [f"{flag} {value}" for flag, value, default in (
        ("--fp8-margin", args.fp8_margin, 0), ("--fp8-amax-history-len", args.fp8_amax_history_len, 1),
        ("--fp8-amax-compute-algo", args.fp8_amax_compute_algo, "most_recent")) if value != default]
    if given:
        scaling = {"tensorwise": "each tensor's current amax", "mxfp8": "each 32-element block's amax",
                   "blockwise": "each tile's amax"}.get(args.fp8_recipe, "its own rule")
        refuse(f"{', '.join(given)} would do nothing under --fp8-recipe {args.fp8_recipe}, which scales from "
              f"{scaling} (margin and amax history belong to --fp8-recipe delayed, as in Transformer Engine): "
              "drop them or use --fp8-recipe delayed")


def _check_mx_blocks(args: argparse.Namespace) -> None:
    """MXFP8 blocks run along every GEMM's reduction dimension (forward, input gradient, weight gradient): the
    dense layers' widths per tensor-parallel rank must be multiples of 32 (the layers check the others when built)."""
    tp = args.tensor_model_parallel_size
    heads = args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else heads
    widths = {"--hidden-size": args.hidden_size, "--ffn-hidden-size / tensor parallel": args.ffn_hidden_size // tp}
    if not args.multi_latent_attention:
        widths["attention heads x --kv-channels / tensor parallel"] = heads * args.kv_channels // tp
        widths["(heads + 2 x query groups) x --kv-channels / tensor parallel"] = (heads + 2 * groups) * args.kv_channels // tp
    if args.num_experts is not None:
        widths["--moe-ffn-hidden-size / expert tensor parallel"] = args.moe_ffn_hidden_size // args.expert_tensor_parallel_size
    bad = [f"{flag} ({value})" for flag, value in widths.items() if value % MX_BLOCK]
    if bad:
        refuse(f"--fp8-recipe mxfp8 quantizes blocks of {MX_BLOCK} along each GEMM's reduction dimension: "
              f"{', '.join(bad)} must be multiples of {MX_BLOCK}")


# ----------------------------------------------------------------------------- what the layers are given

def fp8_config_fields(args: argparse.Namespace) -> dict:
    """``TransformerConfig``'s fp8 fields: set for Transformer Engine's layers only. The CPU FP8 layers take
    ``cpu_recipe`` instead, so Megatron-Core's TE-only FP8 branches (``te_checkpoint``, FP8 padding, ...) stay off."""
    if args.fp8 is None or not transformer_engine_used(args):
        return {}
    return dict(fp8=args.fp8, fp8_recipe=args.fp8_recipe, fp8_margin=args.fp8_margin,
                fp8_amax_history_len=args.fp8_amax_history_len, fp8_amax_compute_algo=args.fp8_amax_compute_algo,
                fp8_wgrad=args.fp8_wgrad, first_last_layers_bf16=args.first_last_layers_bf16,
                num_layers_at_start_in_bf16=args.num_layers_at_start_in_bf16,
                num_layers_at_end_in_bf16=args.num_layers_at_end_in_bf16,
                # Megatron-LM's fp8_param = --fp8-param-gather: Transformer Engine's FP8 primary weights. Under
                # --use-megatron-fsdp the engine owns the weights and hands the TE layers its FP8 gather instead.
                fp8_param=args.fp8_param_gather and not args.use_megatron_fsdp)


def cpu_recipe(args: argparse.Namespace):
    """The recipe the CPU FP8 layers run (None without --fp8-format, or where Transformer Engine's layers run)."""
    if args.fp8 is None or transformer_engine_used(args):
        return None
    from megatron.fsdp.mcore_cpu.fp8_matmul import Fp8Recipe

    bf16 = args.first_last_layers_bf16
    return Fp8Recipe(format=args.fp8, recipe=args.fp8_recipe, margin=args.fp8_margin,
                     amax_history_len=args.fp8_amax_history_len, amax_compute_algo=args.fp8_amax_compute_algo,
                     wgrad=args.fp8_wgrad, param_gather=args.fp8_param_gather and args.use_megatron_fsdp,
                     layers_at_start_in_bf16=args.num_layers_at_start_in_bf16 if bf16 else 0,
                     layers_at_end_in_bf16=args.num_layers_at_end_in_bf16 if bf16 else 0)


def fp8_start_up_line(args: argparse.Namespace) -> Optional[str]:
    """The one start-up line that says how FP8 runs (None without --fp8-format)."""
    if args.fp8 is None:
        return None
    if transformer_engine_used(args):
        gather = " and --fp8-param-gather's weights from megatron.fsdp's FP8 gather" if (
            args.fp8_param_gather and args.use_megatron_fsdp) else ""
        return f"> FP8: {args.fp8} {args.fp8_recipe} recipe in Transformer Engine's layers{gather}"
    return "> FP8 (no Transformer Engine): " + cpu_recipe(args).describe(args.num_layers)


# ----------------------------------------------------------------------------- substitutions (substitutions.py)

def fp8_substitutions(args: argparse.Namespace) -> List[Substitution]:
    """--fp8-param-gather on Megatron-Core's DistributedOptimizer without Transformer Engine."""
    if args.fp8 is not None and args.fp8_param_gather and not args.use_megatron_fsdp and not transformer_engine_used(args):
        return [Substitution("--fp8-param-gather", "bf16 weights gathered, quantized by each layer every forward",
                             "Megatron-Core's DistributedOptimizer keeps FP8 weights only as Transformer Engine tensors")]
    return []

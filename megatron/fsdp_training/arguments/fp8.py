"""Megatron-LM's FP8 flags, with its names, defaults and meanings, their rules and what runs them here.

Megatron-LM generates these flags from ``TransformerConfig``'s fp8 fields (``--fp8-format`` is
``fp8``, ``--no-fp8-wgrad`` clears ``fp8_wgrad``, ``--fp8-param-gather`` sets ``fp8_param``) and
hands them to Transformer Engine (``megatron/core/fp8_utils.py``'s ``get_fp8_recipe``). Here:

* with Transformer Engine importable (``--transformer-impl transformer_engine`` kept), the same
  ``TransformerConfig`` fields go to Megatron-Core's TE layers (``transformer_config_fields``);
* without it, the CPU layers of ``megatron.fsdp.mcore.fp8_layers`` run the recipe's GEMMs with
  ``megatron.fsdp.precision.fp8``'s quantizers (``cpu_recipe`` is their value type), said in one
  start-up line (``fp8_start_up_line``).

``validate_fp8`` (called by ``validate_args``) holds Megatron-LM's rules and refuses, in one line
each, what is not built. docs/training.md ("FP8") says what each flag does here.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import List, Optional

from ..errors import ArgumentError
from .substitution_record import Substitution

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise", "custom")
BUILT_ON_CPU = ("tensorwise", "delayed", "mxfp8")
MX_BLOCK = 32  # megatron.fsdp.precision.fp8.MX_BLOCK (not imported: the parser runs before torch is needed)


def add_fp8_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("FP8 (Megatron-LM's flags; docs/training.md)")
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
                        "--use-distributed-optimizer)")
    g.add_argument("--first-last-layers-bf16", action="store_true",
                   help="keep the first and last transformer layers out of FP8 (not with --fp8-recipe delayed)")
    g.add_argument("--num-layers-at-start-in-bf16", type=int, default=1,
                   help="layers kept out of FP8 at the start, with --first-last-layers-bf16")
    g.add_argument("--num-layers-at-end-in-bf16", type=int, default=1,
                   help="layers kept out of FP8 at the end, with --first-last-layers-bf16")


def _fail(message: str) -> None:
    raise ArgumentError(message)


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
            _fail(f"{', '.join(given)} configure FP8 training: add --fp8-format e4m3 or hybrid (without it the "
                  "model trains in --bf16 and these flags would do nothing)")
        return
    if args.fp8_param_gather and not (args.use_distributed_optimizer or args.use_megatron_fsdp):
        _fail("--fp8-param-gather only supported with distributed optimizer, torch fsdp2, megatron fsdp, or "
              "inference mode (Megatron-LM's rule): add --use-megatron-fsdp or --use-distributed-optimizer")
    if args.fp8_amax_history_len < 1:
        _fail(f"--fp8-amax-history-len {args.fp8_amax_history_len} must be at least 1")
    if args.first_last_layers_bf16:
        if args.fp8_recipe == "delayed":
            _fail("--first-last-layers-bf16: Delayed scaling does not support first / last layer in BF16 "
                  "(Megatron-Core's rule): use --fp8-recipe tensorwise or mxfp8")
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        for flag, value in (("--num-layers-at-start-in-bf16", args.num_layers_at_start_in_bf16),
                            ("--num-layers-at-end-in-bf16", args.num_layers_at_end_in_bf16)):
            if not 0 <= value <= per_stage:
                _fail(f"{flag} {value} must be between 0 and the number of layers per pipeline stage ({per_stage})")
    if args.fp8_recipe == "custom":
        _fail("--fp8-recipe custom needs Transformer Engine's --fp8-quantizer-factory, which this job does not "
              "build: use --fp8-recipe delayed, tensorwise or mxfp8")
    if transformer_engine_used(args):
        if args.fp8_param_gather and args.use_megatron_fsdp and args.fp8_recipe == "blockwise":
            _fail("--fp8-param-gather with --fp8-recipe blockwise under --use-megatron-fsdp: megatron.fsdp does not "
                  "gather 128x128 tiles (a shard boundary may split one); drop --fp8-param-gather or use "
                  "--fp8-recipe mxfp8")
        return  # Transformer Engine checks its own recipes (and the GPU they need)
    if args.fp8_recipe not in BUILT_ON_CPU:
        _fail(f"--fp8-recipe {args.fp8_recipe}: without Transformer Engine the job's FP8 layers build "
              f"{', '.join(BUILT_ON_CPU)}; blockwise's 1x128 activation and gradient tiles are not built (its "
              "128x128 weight tiles are: megatron.fsdp.precision.fp8.quantize_blockwise): use --fp8-recipe mxfp8")
    import torch

    if torch.cuda.is_available():
        _fail("--fp8-format on a GPU needs Transformer Engine (--transformer-impl transformer_engine); the job's "
              "own FP8 layers are its CPU layers")
    if args.moe_grouped_gemm and args.num_experts is not None:
        _fail("--fp8-format with --moe-grouped-gemm: the CPU grouped GEMM has no FP8 path; drop --moe-grouped-gemm "
              "(each expert's GEMMs then run in FP8)")
    if args.fp8_recipe == "mxfp8":
        _check_mx_blocks(args)


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
        _fail(f"--fp8-recipe mxfp8 quantizes blocks of {MX_BLOCK} along each GEMM's reduction dimension: "
              f"{', '.join(bad)} must be multiples of {MX_BLOCK}")


def transformer_config_fields(args: argparse.Namespace) -> dict:
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
    from megatron.fsdp.mcore.fp8_gemm import Fp8Recipe

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


def fp8_substitutions(args: argparse.Namespace) -> List[Substitution]:
    """A provider of ``substitutions.py``: --fp8-param-gather on Megatron-Core's DistributedOptimizer without TE."""
    if args.fp8 is not None and args.fp8_param_gather and not args.use_megatron_fsdp and not transformer_engine_used(args):
        return [Substitution("--fp8-param-gather", "bf16 weights gathered, quantized by each layer every forward",
                             "Megatron-Core's DistributedOptimizer keeps FP8 weights only as Transformer Engine tensors")]
    return []

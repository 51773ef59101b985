"""The flags of Megatron-LM's Megatron-FSDP user guide, with Megatron-LM's names, defaults and meanings.

The guide's required flags are ``--use-megatron-fsdp --data-parallel-sharding-strategy
optim_grads_params --no-gradient-accumulation-fusion --use-distributed-optimizer --ckpt-format
fsdp_dtensor``; its recommended ones ``--calculate-per-token-loss --init-model-with-meta-device
--grad-reduce-in-bf16 --fsdp-double-buffer --use-nccl-ub``. The ones not defined elsewhere are
defined here, with their rules (``validate_fsdp_recipe``, called by ``validate_args``) and what
this machine substitutes for them (``fsdp_recipe_substitutions``, a provider of the start-up line of
``substitutions.py``). docs/training.md ("The Megatron-FSDP user guide's flags") says what each
does here.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import List

import torch

from ..errors import ArgumentError
from .substitution_record import Substitution


def add_fsdp_recipe_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Megatron-FSDP user guide (Megatron-LM's flags; docs/training.md)")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
                   help="do not fuse the weight-gradient accumulation into the linear layers' backward (APEX's "
                        "fused_weight_gradient_mlp_cuda); without that kernel (CPU) unfused is the only behaviour")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="reduce gradients in bf16 (half the reduce-scatter bytes; needs --bf16); the fp32 main "
                        "gradients they are added into stay fp32")
    g.add_argument("--fsdp-double-buffer", action="store_true",
                   help="ZeRO-3 units gather into persistent buffers allocated once and reused every step (two "
                        "per section and nesting depth, or prefetch depth + 1) instead of allocating per gather")
    g.add_argument("--megatron-fsdp-grad-comm-dtype", choices=("fp32", "fp16", "bf16", "auto"), default="auto",
                   help="dtype gradients are reduced in (Megatron-LM's newer spelling; bf16 = --grad-reduce-in-bf16); "
                        "auto: the main gradients' dtype")
    g.add_argument("--megatron-fsdp-main-grads-dtype", choices=("fp32", "bf16", "fp16", "auto"), default="auto",
                   help="dtype of the main-gradient accumulators (Megatron-LM's newer spelling of --main-grads-dtype "
                        "under Megatron-FSDP; bf16 = --use-precision-aware-optimizer --main-grads-dtype bf16); auto: "
                        "the main weights' dtype (fp32 unless --megatron-fsdp-main-params-dtype makes them bf16)")
    g.add_argument("--use-nccl-ub", dest="nccl_ub", action="store_true",
                   help="register the data-parallel buffers as NCCL user buffers; on gloo it has no effect (said "
                        "at start-up), on CUDA it is refused until implemented")


def fused_accumulation_kernel() -> bool:
    """Whether this machine has the kernel ``gradient_accumulation_fusion`` needs (APEX, on a GPU)."""
    return torch.cuda.is_available() and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def gradient_accumulation_fusion(args: argparse.Namespace) -> bool:
    """The value for ``TransformerConfig``: asked for (Megatron-LM's default) and possible here."""
    return bool(getattr(args, "gradient_accumulation_fusion", False)) and fused_accumulation_kernel()


def _map_megatron_fsdp_dtypes(args: argparse.Namespace) -> None:
    """``--megatron-fsdp-grad-comm-dtype`` / ``--megatron-fsdp-main-grads-dtype`` (the DeepSeek-V3 script's newest
    version) onto the flags that carry the same meaning here, so one rule and one code path serve both spellings."""
    comm, main = args.megatron_fsdp_grad_comm_dtype, args.megatron_fsdp_main_grads_dtype
    if (comm, main) == ("auto", "auto"):
        return
    if not args.use_megatron_fsdp:
        raise ArgumentError("--megatron-fsdp-grad-comm-dtype / --megatron-fsdp-main-grads-dtype configure "
                            "Megatron-FSDP: add --use-megatron-fsdp")
    if "fp16" in (comm, main):
        raise ArgumentError("--megatron-fsdp-grad-comm-dtype / --megatron-fsdp-main-grads-dtype fp16: this job trains "
                            "in bf16 or fp32 (no fp16 loss scaling); use bf16")
    if comm == "fp32" and args.grad_reduce_in_bf16:
        raise ArgumentError("--megatron-fsdp-grad-comm-dtype fp32 contradicts --grad-reduce-in-bf16: give one")
    if comm == "bf16":
        args.grad_reduce_in_bf16 = True
    if main == "bf16":
        if args.main_grads_dtype != "fp32" and args.main_grads_dtype != "bf16":
            raise ArgumentError(f"--megatron-fsdp-main-grads-dtype bf16 contradicts --main-grads-dtype "
                                f"{args.main_grads_dtype}: give one")
        if args.optimizer != "adam":
            raise ArgumentError("--megatron-fsdp-main-grads-dtype bf16 is the precision-aware optimizer's bf16 main "
                                f"gradients, which need --optimizer adam (not {args.optimizer})")
        args.use_precision_aware_optimizer, args.main_grads_dtype = True, "bf16"
        if comm == "fp32":
            raise ArgumentError("--megatron-fsdp-grad-comm-dtype fp32 with --megatron-fsdp-main-grads-dtype bf16: "
                                "bf16 main gradients are reduced in bf16 here; use auto or bf16")


def validate_fsdp_recipe(args: argparse.Namespace) -> None:
    """Megatron-LM's rules for these flags, and what this backend cannot do with them (one message each)."""
    if args.gradient_accumulation_fusion and args.use_megatron_fsdp and fused_accumulation_kernel():
        raise ArgumentError("gradient accumulation fusion (on by default) writes weight gradients into "
                            "param.main_grad, which --use-megatron-fsdp replaces with flat sharded buffers: add "
                            "--no-gradient-accumulation-fusion (a required flag of the Megatron-FSDP user guide)")
    _map_megatron_fsdp_dtypes(args)
    if args.grad_reduce_in_bf16:
        if not args.bf16:
            raise ArgumentError("--grad-reduce-in-bf16 needs --bf16 (an fp32 model's gradients are fp32)")
        args.grad_reduce_in_fp32 = False  # Megatron-LM: accumulate_allreduce_grads_in_fp32 = False
    if args.fsdp_double_buffer:
        levels = {args.data_parallel_sharding_strategy, getattr(args, "expert_data_parallel_sharding_strategy", None)}
        if not args.use_megatron_fsdp or "optim_grads_params" not in levels:
            raise ArgumentError("--fsdp-double-buffer keeps persistent buffers for the units ZeRO-3 gathers: it needs "
                                "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params")
    if args.nccl_ub and torch.cuda.is_available():
        raise ArgumentError("--use-nccl-ub (NCCL user-buffer registration through torch.cuda.MemPool) is not "
                            "implemented by megatron.fsdp yet: drop it (--fsdp-double-buffer alone gives the "
                            "persistent gather buffers)")


def fsdp_recipe_substitutions(args: argparse.Namespace) -> List[Substitution]:
    """A provider of ``substitutions.py``: each of these flags this machine cannot honour as asked."""
    out = []
    if getattr(args, "gradient_accumulation_fusion", False) and not fused_accumulation_kernel():
        out.append(Substitution("gradient accumulation fusion (Megatron-LM's default)", "unfused accumulation by autograd",
                                "no fused_weight_gradient_mlp_cuda kernel: it needs APEX on a GPU"))
    if getattr(args, "nccl_ub", False) and not torch.cuda.is_available():
        out.append(Substitution("--use-nccl-ub", "no effect", "gloo has no NCCL user buffers to register"))
    return out

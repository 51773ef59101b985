"""Megatron-FSDP's flags: ``--use-megatron-fsdp``, the data-parallel levels, meta-device initialisation, the
Megatron-FSDP user guide's flags and Megatron-LM 0.19/0.20's, with what ``--use-megatron-fsdp`` implies there.

Megatron-LM main (Megatron-Core 0.20) makes ``--use-megatron-fsdp`` mean, on both Megatron-Core
releases this job runs on: ``--data-parallel-sharding-strategy optim_grads_params`` (ZeRO-3), the
distributed optimizer (``--megatron-fsdp-version 1``, its default; version 2 refuses it) and
``--ckpt-format fsdp_dtensor`` (``checkpointing.py`` refuses another with the converter's command).
``apply_megatron_fsdp_defaults`` resolves those before any check reads them; a flag the user wrote is
kept as written. The user guide's required and recommended flags not defined elsewhere are here too.
Each flag is honoured, said in the start-up line (NCCL registration on gloo, fine-grained gathers) or
refused with one line. docs/arguments.md ("The Megatron-FSDP user guide's flags", "Megatron-LM
0.19/0.20's Megatron-FSDP flags") says what each does here.
"""

from __future__ import annotations

import argparse
from typing import List

import torch

from megatron.fsdp.sharding.strategy import parse_mesh_strategy, parse_strategy

from ..errors import refuse
from .substitutions import Substitution

ZERO3 = "optim_grads_params"
DTYPE_CHOICES = ("fp32", "bf16", "fp16", "auto")
# Flags that only configure Megatron-FSDP, with the value each has when not given.
_FSDP_ONLY = (("--megatron-fsdp-version", "megatron_fsdp_version", None),
              ("--megatron-fsdp-main-params-dtype", "megatron_fsdp_main_params_dtype", None),
              ("--fsdp-manual-registration", "fsdp_manual_registration", False),
              ("--fsdp-db-use-persist-buf-on-alloc-fail", "fsdp_db_use_persist_buf_on_alloc_fail", False),
              ("--megatron-fsdp-enable-fine-grained-param-gather", "megatron_fsdp_enable_fine_grained_param_gather",
               False),
              ("--megatron-fsdp-max-pool-double-buffer", "megatron_fsdp_max_pool_double_buffer", False),
              ("--enable-full-sharding-in-hsdp", "enable_full_sharding_in_hsdp", False))


def add_megatron_fsdp_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Megatron-FSDP")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="data parallelism by megatron.fsdp (default: off, Megatron-Core's DDP). As in Megatron-LM "
                        "main, it implies --data-parallel-sharding-strategy optim_grads_params (ZeRO-3), the "
                        "distributed optimizer and --ckpt-format fsdp_dtensor; flags written explicitly win "
                        "(--data-parallel-sharding-strategy no_shard: plain data parallel like DDP)")
    g.add_argument("--data-parallel-sharding-strategy", default=None,
                   help="level of the inner (dp_shard) axis with --use-megatron-fsdp: no_shard (DDP) | optim "
                        "(ZeRO-1) | optim_grads (ZeRO-2) | optim_grads_params (ZeRO-3) (default: "
                        "optim_grads_params with --use-megatron-fsdp, as Megatron-LM)")
    g.add_argument("--outer-dp-sharding-strategy", default=None,
                   help="level of the outer (dp_outer) axis: no_shard = HSDP, optim = HFSDP (needs "
                        "--num-distributed-optimizer-instances > 1) (default: no_shard)")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="size of the outer axis: the data-parallel ranks split into this many domains")
    g.add_argument("--init-model-with-meta-device", action="store_true",
                   help="build the model on the meta device; megatron.fsdp materialises and initialises it unit "
                        "by unit, keeping only this rank's shards (needs --use-megatron-fsdp)")
    _add_user_guide_args(g)
    _add_megatron_lm_019_args(g)


def _add_user_guide_args(g) -> None:
    """The Megatron-FSDP user guide's recommended flags not defined elsewhere (--grad-reduce-in-bf16 is
    ``precision.py``'s, --no-gradient-accumulation-fusion ``model.py``'s)."""
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


def _add_megatron_lm_019_args(g) -> None:
    """Megatron-LM 0.19/0.20's Megatron-FSDP flags."""
    g.add_argument("--megatron-fsdp-version", type=int, choices=(1, 2), default=None,
                   help="Megatron-LM's two Megatron-FSDP implementations; both run megatron.fsdp, which is the "
                        "version-2 design (fully_shard per layer, an optimizer over the shards). 1 (default, as "
                        "Megatron-LM): the distributed optimizer is implied, as version 1 does; 2: "
                        "--use-distributed-optimizer is refused, as Megatron-LM does (default: 1)")
    g.add_argument("--megatron-fsdp-main-params-dtype", choices=DTYPE_CHOICES, default=None,
                   help="dtype of the main weights the optimizer updates (megatron.fsdp's MixedPrecision main "
                        "dtype). bf16 (needs --bf16 and --optimizer adam): the bf16 compute weights are the main "
                        "weights, no fp32 copy, and the main gradients are bf16; Adam's moments and its update stay "
                        "fp32 (--exp-avg-dtype for bf16 moments); auto: the compute dtype (bf16 under --bf16, else "
                        "fp32); fp16 is refused (default: fp32)")
    g.add_argument("--fsdp-manual-registration", action="store_true",
                   help="register the FSDP buffers with NCCL in few calls (needs --use-nccl-ub, as in Megatron-LM); "
                        "on gloo it has no effect (said at start-up)")
    g.add_argument("--fsdp-db-use-persist-buf-on-alloc-fail", action="store_true",
                   help="double buffering: a persistent buffer for what does not fit the pool, for NCCL buffer "
                        "registration; no effect here (said at start-up): megatron.fsdp registers no NCCL buffers")
    g.add_argument("--megatron-fsdp-enable-fine-grained-param-gather", action="store_true",
                   help="gather each submodule's weights on its own; megatron.fsdp gathers per unit and prefetches "
                        "the next unit (said at start-up)")
    g.add_argument("--megatron-fsdp-max-pool-double-buffer", action="store_true",
                   help="double buffers that fit every unit (Megatron-LM's MaxPoolAllocator); implies "
                        "--fsdp-double-buffer, whose buffers are sized to each group's largest unit")
    g.add_argument("--enable-full-sharding-in-hsdp", action="store_true",
                   help="shard the optimizer state across the HSDP domains too: --outer-dp-sharding-strategy optim "
                        "(needs --num-distributed-optimizer-instances > 1; Megatron-LM defines the flag and reads "
                        "--outer-dp-sharding-strategy instead)")



# ----------------------------------------------------------------------------- rules (parser.validate_args's order)

def apply_megatron_fsdp_defaults(args: argparse.Namespace) -> None:
    """Megatron-LM main's implications of ``--use-megatron-fsdp``; flags the user wrote are kept.

    Without ``--use-megatron-fsdp`` the levels are the baseline's (``no_shard``); a level written
    there is refused by ``validate_levels``. Runs first in ``validate_args``.
    """
    given = [flag for flag, dest, unset in _FSDP_ONLY if getattr(args, dest) != unset]
    if given and not args.use_megatron_fsdp:
        refuse(f"{', '.join(given)} configure Megatron-FSDP: add --use-megatron-fsdp")
    if args.enable_full_sharding_in_hsdp:
        if args.outer_dp_sharding_strategy not in (None, "optim"):
            refuse(f"--enable-full-sharding-in-hsdp is --outer-dp-sharding-strategy optim, which contradicts "
                  f"--outer-dp-sharding-strategy {args.outer_dp_sharding_strategy}: give one")
        if args.num_distributed_optimizer_instances < 2:
            refuse("--enable-full-sharding-in-hsdp shards the optimizer state across HSDP domains: it needs "
                  "--num-distributed-optimizer-instances > 1 (the number of domains)")
        args.outer_dp_sharding_strategy = "optim"
    if args.data_parallel_sharding_strategy is None:
        args.data_parallel_sharding_strategy = ZERO3 if args.use_megatron_fsdp else "no_shard"
    if args.outer_dp_sharding_strategy is None:
        args.outer_dp_sharding_strategy = "no_shard"
    if not args.use_megatron_fsdp:
        return
    if args.megatron_fsdp_version is None:
        args.megatron_fsdp_version = 1
    if args.megatron_fsdp_main_params_dtype is None:
        args.megatron_fsdp_main_params_dtype = "fp32"
    if args.megatron_fsdp_version == 2:
        if args.use_distributed_optimizer:
            refuse("--megatron-fsdp-version 2 is not compatible with --use-distributed-optimizer (Megatron-LM's "
                  "rule: version 2 steps an optimizer over the sharded parameters): drop one of them")
    else:
        args.use_distributed_optimizer = True  # Megatron-LM: "Megatron-FSDP v1 ... Using DistributedOptimizer"
    if args.megatron_fsdp_max_pool_double_buffer:
        args.fsdp_double_buffer = True  # Megatron-LM: "MaxPoolAllocator is a type of FSDP double buffer"


def validate_levels(args: argparse.Namespace) -> None:
    """The inner and outer levels exist and compose, and the outer axis divides the data-parallel ranks."""
    if args.use_megatron_fsdp:
        try:
            parse_strategy(args.data_parallel_sharding_strategy)
            if args.num_distributed_optimizer_instances > 1:
                parse_mesh_strategy(args.data_parallel_sharding_strategy, args.outer_dp_sharding_strategy, True)
        except ValueError as exc:
            refuse(f"--data-parallel-sharding-strategy / --outer-dp-sharding-strategy: {exc}")
    elif args.data_parallel_sharding_strategy != "no_shard" or args.outer_dp_sharding_strategy != "no_shard":
        refuse("--data-parallel-sharding-strategy and --outer-dp-sharding-strategy need --use-megatron-fsdp")
    if args.outer_dp_sharding_strategy != "no_shard" and args.num_distributed_optimizer_instances < 2:
        refuse("--outer-dp-sharding-strategy needs an outer axis: set --num-distributed-optimizer-instances > 1")
    if args.num_distributed_optimizer_instances > 1 and args.data_parallel_size % args.num_distributed_optimizer_instances:
        refuse(f"--num-distributed-optimizer-instances {args.num_distributed_optimizer_instances} does not divide "
              f"the data-parallel size {args.data_parallel_size}")


def validate_initialisation(args: argparse.Namespace) -> None:
    if args.init_model_with_meta_device and not args.use_megatron_fsdp:
        refuse("--init-model-with-meta-device needs --use-megatron-fsdp (Megatron-Core's own DDP cannot "
              "materialise a meta-device model)")


def validate_megatron_fsdp(args: argparse.Namespace) -> None:
    """What these flags need (Megatron-LM's rules) and what this backend cannot do with them (one line each)."""
    if not args.use_megatron_fsdp:
        return
    if args.fsdp_manual_registration and not args.nccl_ub:
        refuse("--fsdp-manual-registration registers the NCCL user buffers of --use-nccl-ub: add --use-nccl-ub "
              "(Megatron-LM's rule) or drop it")
    if args.megatron_fsdp_max_pool_double_buffer:
        levels = {args.data_parallel_sharding_strategy, getattr(args, "expert_data_parallel_sharding_strategy", None)}
        if ZERO3 not in levels:
            refuse("--megatron-fsdp-max-pool-double-buffer is a double buffer for the units ZeRO-3 gathers: it needs "
                  "--data-parallel-sharding-strategy optim_grads_params")
    _validate_main_params_dtype(args)


def _validate_main_params_dtype(args: argparse.Namespace) -> None:
    dtype = args.megatron_fsdp_main_params_dtype
    if dtype == "fp16":
        refuse("--megatron-fsdp-main-params-dtype fp16: this job trains in bf16 or fp32 (no fp16 loss scaling); "
              "use bf16 or fp32")
    if main_params_dtype(args) != torch.bfloat16:
        return
    if not args.bf16:
        refuse("--megatron-fsdp-main-params-dtype bf16 makes the bf16 compute weights the main weights: it needs "
              "--bf16")
    if args.optimizer != "adam":
        refuse(f"--megatron-fsdp-main-params-dtype {dtype} under --bf16 (bf16 main weights) needs --optimizer adam, "
              f"whose update runs in fp32 over the bf16 weights (not {args.optimizer})")
    if args.megatron_fsdp_main_grads_dtype == "fp32":
        refuse(f"--megatron-fsdp-main-params-dtype {dtype} under --bf16 keeps the main gradients in bf16, the main "
              "weights' dtype: fp32 main gradients with bf16 main weights are not implemented; drop "
              "--megatron-fsdp-main-grads-dtype fp32")


def map_megatron_fsdp_dtypes(args: argparse.Namespace) -> None:
    """``--megatron-fsdp-grad-comm-dtype`` / ``--megatron-fsdp-main-grads-dtype`` (the DeepSeek-V3 script's newest
    version) onto the flags that carry the same meaning here, so one rule and one code path serve both spellings."""
    comm, main = args.megatron_fsdp_grad_comm_dtype, args.megatron_fsdp_main_grads_dtype
    if (comm, main) == ("auto", "auto"):
        return
    if not args.use_megatron_fsdp:
        refuse("--megatron-fsdp-grad-comm-dtype / --megatron-fsdp-main-grads-dtype configure "
              "Megatron-FSDP: add --use-megatron-fsdp")
    if "fp16" in (comm, main):
        refuse("--megatron-fsdp-grad-comm-dtype / --megatron-fsdp-main-grads-dtype fp16: this job trains "
              "in bf16 or fp32 (no fp16 loss scaling); use bf16")
    if comm == "fp32" and args.grad_reduce_in_bf16:
        refuse("--megatron-fsdp-grad-comm-dtype fp32 contradicts --grad-reduce-in-bf16: give one")
    if comm == "bf16":
        args.grad_reduce_in_bf16 = True
    if main == "bf16":
        if args.main_grads_dtype != "fp32" and args.main_grads_dtype != "bf16":
            refuse(f"--megatron-fsdp-main-grads-dtype bf16 contradicts --main-grads-dtype "
                  f"{args.main_grads_dtype}: give one")
        if args.optimizer != "adam":
            refuse("--megatron-fsdp-main-grads-dtype bf16 is the precision-aware optimizer's bf16 main "
                  f"gradients, which need --optimizer adam (not {args.optimizer})")
        args.use_precision_aware_optimizer, args.main_grads_dtype = True, "bf16"
        if comm == "fp32":
            refuse("--megatron-fsdp-grad-comm-dtype fp32 with --megatron-fsdp-main-grads-dtype bf16: "
                  "bf16 main gradients are reduced in bf16 here; use auto or bf16")


def validate_buffers(args: argparse.Namespace) -> None:
    """The double buffer needs ZeRO-3 units; NCCL user buffers are not implemented on CUDA."""
    if args.fsdp_double_buffer:
        levels = {args.data_parallel_sharding_strategy, getattr(args, "expert_data_parallel_sharding_strategy", None)}
        if not args.use_megatron_fsdp or ZERO3 not in levels:
            refuse("--fsdp-double-buffer keeps persistent buffers for the units ZeRO-3 gathers: it needs "
                  "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params")
    if args.nccl_ub and torch.cuda.is_available():
        refuse("--use-nccl-ub (NCCL user-buffer registration through torch.cuda.MemPool) is not "
              "implemented by megatron.fsdp yet: drop it (--fsdp-double-buffer alone gives the "
              "persistent gather buffers)")


# ----------------------------------------------------------------------------- what the engine is given

def main_params_dtype(args: argparse.Namespace) -> torch.dtype:
    """The engine's ``MixedPrecision.main_dtype`` for these arguments (fp32 without ``--use-megatron-fsdp``)."""
    name = getattr(args, "megatron_fsdp_main_params_dtype", None) or "fp32"
    if name == "auto":
        return torch.bfloat16 if args.bf16 else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


# ----------------------------------------------------------------------------- substitutions (substitutions.py)

def megatron_fsdp_substitutions(args: argparse.Namespace) -> List[Substitution]:
    """The flags of this module that this machine does not honour as asked."""
    gloo = not torch.cuda.is_available()
    out = []
    if getattr(args, "nccl_ub", False) and gloo:
        out.append(Substitution("--use-nccl-ub", "no effect", "gloo has no NCCL user buffers to register"))
    if not getattr(args, "use_megatron_fsdp", False):
        return out
    if args.fsdp_manual_registration and gloo:
        out.append(Substitution("--fsdp-manual-registration", "no effect", "gloo has no NCCL user buffers to register"))
    if args.fsdp_db_use_persist_buf_on_alloc_fail:
        out.append(Substitution("--fsdp-db-use-persist-buf-on-alloc-fail", "no effect",
                                "gloo has no NCCL user buffers to register" if gloo else
                                "megatron.fsdp registers no NCCL user buffers, the persistent buffers' purpose"))
    if args.megatron_fsdp_enable_fine_grained_param_gather:
        out.append(Substitution("--megatron-fsdp-enable-fine-grained-param-gather", "one gather per unit",
                                "megatron.fsdp gathers a unit's weights together and prefetches the next unit's"))
    return out

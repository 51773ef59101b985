"""Megatron-LM 0.19/0.20's Megatron-FSDP flags and what ``--use-megatron-fsdp`` implies there.

Megatron-LM main (d98e8a64, Megatron-Core 0.20) makes ``--use-megatron-fsdp`` mean, on both
Megatron-Core releases this job runs on:

* ``--data-parallel-sharding-strategy optim_grads_params`` (ZeRO-3): its argparse default;
* the distributed optimizer: ``--megatron-fsdp-version 1`` (its default) turns
  ``--use-distributed-optimizer`` on, version 2 refuses it;
* ``--ckpt-format fsdp_dtensor``: it refuses any other format (here the default there, and
  ``torch_dist`` refused with the converter's command, ``parser._validate_ckpt_format``).

``apply_megatron_fsdp_defaults`` resolves those before any check reads them; a flag the user wrote
is kept as written. The other flags of this module are honoured (the version, the main-weights
dtype, the max-pool double buffer, full sharding in HSDP), said in the start-up line of
``substitutions.py`` (``megatron_fsdp_substitutions``: NCCL registration on gloo, fine-grained
gathers) or refused with one line (``validate_megatron_fsdp``). docs/training.md ("Megatron-LM
0.19/0.20's Megatron-FSDP flags") says what each does here.
"""

from __future__ import annotations

import argparse
from typing import List

import torch

from ..errors import ArgumentError
from .substitution_record import Substitution

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
    g = parser.add_argument_group("Megatron-FSDP (Megatron-LM 0.19/0.20's flags; docs/training.md)")
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


def _fail(message: str) -> None:
    raise ArgumentError(message)


def apply_megatron_fsdp_defaults(args: argparse.Namespace) -> None:
    """Megatron-LM main's implications of ``--use-megatron-fsdp``; flags the user wrote are kept.

    Without ``--use-megatron-fsdp`` the levels are the baseline's (``no_shard``); a level written
    there is refused by ``validate_args``. Runs first in ``validate_args``.
    """
    given = [flag for flag, dest, unset in _FSDP_ONLY if getattr(args, dest) != unset]
    if given and not args.use_megatron_fsdp:
        _fail(f"{', '.join(given)} configure Megatron-FSDP: add --use-megatron-fsdp")
    if args.enable_full_sharding_in_hsdp:
        if args.outer_dp_sharding_strategy not in (None, "optim"):
            _fail(f"--enable-full-sharding-in-hsdp is --outer-dp-sharding-strategy optim, which contradicts "
                  f"--outer-dp-sharding-strategy {args.outer_dp_sharding_strategy}: give one")
        if args.num_distributed_optimizer_instances < 2:
            _fail("--enable-full-sharding-in-hsdp shards the optimizer state across HSDP domains: it needs "
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
            _fail("--megatron-fsdp-version 2 is not compatible with --use-distributed-optimizer (Megatron-LM's "
                  "rule: version 2 steps an optimizer over the sharded parameters): drop one of them")
    else:
        args.use_distributed_optimizer = True  # Megatron-LM: "Megatron-FSDP v1 ... Using DistributedOptimizer"
    if args.megatron_fsdp_max_pool_double_buffer:
        args.fsdp_double_buffer = True  # Megatron-LM: "MaxPoolAllocator is a type of FSDP double buffer"


def validate_megatron_fsdp(args: argparse.Namespace) -> None:
    """What these flags need (Megatron-LM's rules) and what this backend cannot do with them (one line each)."""
    if not args.use_megatron_fsdp:
        return
    if args.fsdp_manual_registration and not args.nccl_ub:
        _fail("--fsdp-manual-registration registers the NCCL user buffers of --use-nccl-ub: add --use-nccl-ub "
              "(Megatron-LM's rule) or drop it")
    if args.megatron_fsdp_max_pool_double_buffer:
        levels = {args.data_parallel_sharding_strategy, getattr(args, "expert_data_parallel_sharding_strategy", None)}
        if ZERO3 not in levels:
            _fail("--megatron-fsdp-max-pool-double-buffer is a double buffer for the units ZeRO-3 gathers: it needs "
                  "--data-parallel-sharding-strategy optim_grads_params")
    _validate_main_params_dtype(args)


def _validate_main_params_dtype(args: argparse.Namespace) -> None:
    dtype = args.megatron_fsdp_main_params_dtype
    if dtype == "fp16":
        _fail("--megatron-fsdp-main-params-dtype fp16: this job trains in bf16 or fp32 (no fp16 loss scaling); "
              "use bf16 or fp32")
    if main_params_dtype(args) != torch.bfloat16:
        return
    if not args.bf16:
        _fail("--megatron-fsdp-main-params-dtype bf16 makes the bf16 compute weights the main weights: it needs "
              "--bf16")
    if args.optimizer != "adam":
        _fail(f"--megatron-fsdp-main-params-dtype {dtype} under --bf16 (bf16 main weights) needs --optimizer adam, "
              f"whose update runs in fp32 over the bf16 weights (not {args.optimizer})")
    if args.megatron_fsdp_main_grads_dtype == "fp32":
        _fail(f"--megatron-fsdp-main-params-dtype {dtype} under --bf16 keeps the main gradients in bf16, the main "
              "weights' dtype: fp32 main gradients with bf16 main weights are not implemented; drop "
              "--megatron-fsdp-main-grads-dtype fp32")


def main_params_dtype(args: argparse.Namespace) -> torch.dtype:
    """The engine's ``MixedPrecision.main_dtype`` for these arguments (fp32 without ``--use-megatron-fsdp``)."""
    name = getattr(args, "megatron_fsdp_main_params_dtype", None) or "fp32"
    if name == "auto":
        return torch.bfloat16 if args.bf16 else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def megatron_fsdp_substitutions(args: argparse.Namespace) -> List[Substitution]:
    """A provider of ``substitutions.py``: the flags of this module that this machine does not honour as asked."""
    if not getattr(args, "use_megatron_fsdp", False):
        return []
    gloo = not torch.cuda.is_available()
    out = []
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

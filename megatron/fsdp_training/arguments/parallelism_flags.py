"""The parallel layout's flags: tensor, pipeline (virtual stages), context and sequence parallelism, the
distributed optimizer, and the data-parallel communication overlap and buckets.

Megatron-LM's names, defaults and meanings; the sizes must tile the world before any process group
exists (one ``ArgumentError`` otherwise). The data-parallel levels and ``--use-megatron-fsdp`` are
``megatron_fsdp.py``'s flags, the expert section's ``moe.py``'s. docs/arguments.md ("Arguments",
"Coming from Megatron-LM") and docs/mesh.md say what each does here.
"""

from __future__ import annotations

import argparse
from typing import List

from ..errors import refuse
from .substitutions import Substitution


def add_parallelism_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP size")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per virtual stage (VPP; needs PP > 1)")
    g.add_argument("--context-parallel-size", type=int, default=1, help="CP size (sequence split across ranks)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="sequence parallelism within TP (needed for MoE with TP > 1)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="without --use-megatron-fsdp: Megatron-Core's DistributedOptimizer (ZeRO-1)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="Megatron-Core DDP: reduce gradient buckets during the backward pass. --use-megatron-fsdp "
                        "always overlaps each unit's reduction with the backward of the next")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="distributed optimizer: gather updated weights during the next forward. --use-megatron-fsdp "
                        "always prefetches the next unit's gather")
    g.add_argument("--overlap-param-gather-with-optimizer-step", action="store_true",
                   help="start the first bucket's weight gather inside the optimizer step (Megatron-LM needs "
                        "--ckpt-format torch for it, which this job does not have: refused with the reason)")
    g.add_argument("--no-align-param-gather", dest="align_param_gather", action="store_false",
                   help="with --overlap-param-gather and virtual pipeline stages: each stage starts its weight "
                        "gathers when it needs them instead of all stages together (aligned, as without the flag). "
                        "--use-megatron-fsdp always gathers per stage (each unit's pre-forward hook)")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="Megatron-Core DDP: parameters per gradient bucket with --overlap-grad-reduce; "
                        "--use-megatron-fsdp reduces per unit (default: Megatron-Core's, 40M or 1M x the "
                        "data-parallel size if larger)")
    g.add_argument("--ddp-num-buckets", type=int, default=None,
                   help="Megatron-Core DDP: gradient buckets with --overlap-grad-reduce, i.e. a bucket size of this "
                        "rank's parameters / N (Megatron-LM's resolve_ddp_bucket_size); --use-megatron-fsdp reduces "
                        "per unit")
    g.add_argument("--disable-gloo-process-groups", action="store_true",
                   help="do not create Megatron-Core's gloo twin of every process group (Megatron-LM's flag); "
                   "on CPU the groups are gloo already and the twins are never created")



# ----------------------------------------------------------------------------- rules (parser.validate_args's order)

def validate_world(args: argparse.Namespace, world_size: int) -> None:
    """Every size at least 1, and tensor x pipeline x context parallel dividing the world: the data-parallel size."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    for name, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--context-parallel-size", cp), ("--micro-batch-size", args.micro_batch_size),
                        ("--num-layers", args.num_layers),
                        ("--expert-model-parallel-size", args.expert_model_parallel_size),
                        ("--expert-tensor-parallel-size", args.expert_tensor_parallel_size),
                        ("--num-distributed-optimizer-instances", args.num_distributed_optimizer_instances)):
        if value is not None and value < 1:
            refuse(f"{name}={value} must be at least 1")
    if world_size % (tp * pp * cp):
        refuse(f"tensor ({tp}) x pipeline ({pp}) x context ({cp}) parallel = {tp * pp * cp} does not divide the "
              f"{world_size} ranks; choose sizes whose product divides the world size")
    args.data_parallel_size = world_size // (tp * pp * cp)


def validate_pipeline(args: argparse.Namespace) -> None:
    """Whole layers per stage, and the virtual stages of the interleaved schedule."""
    pp = args.pipeline_model_parallel_size
    if args.num_layers % pp:
        refuse(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers // pp
        if pp < 2 or per_stage % args.num_layers_per_virtual_pipeline_stage:
            refuse(f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage} needs "
                  f"--pipeline-model-parallel-size > 1 and must divide the {per_stage} layers per stage")
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage


def validate_tensor_and_context(args: argparse.Namespace) -> None:
    """Whole heads per tensor-parallel rank, sequence parallelism only with TP, and CP's sequence split."""
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    if args.num_attention_heads % tp:
        refuse(f"--num-attention-heads {args.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}")
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # Megatron-LM turns it off silently too: nothing to split
    if args.seq_length % (2 * cp) and cp > 1:
        refuse(f"--seq-length {args.seq_length} must be divisible by 2 x --context-parallel-size ({2 * cp})")


def validate_overlap(args: argparse.Namespace) -> None:
    """The gather overlap, the DDP buckets, gather alignment and gather-in-step flags: Megatron-LM's rules, in
    its order."""
    if args.overlap_param_gather and not (args.use_distributed_optimizer or args.use_megatron_fsdp):
        refuse("--overlap-param-gather needs --use-distributed-optimizer (or --use-megatron-fsdp), as in Megatron-LM")
    if args.ddp_bucket_size is not None and args.ddp_num_buckets is not None:
        refuse("--ddp-bucket-size and --ddp-num-buckets both size the gradient buckets (Megatron-Core's rule): give one")
    for flag, value in (("--ddp-bucket-size", args.ddp_bucket_size), ("--ddp-num-buckets", args.ddp_num_buckets)):
        if value is not None and value < 1:
            refuse(f"{flag} {value} must be at least 1")
    if args.virtual_pipeline_model_parallel_size is None:
        args.align_param_gather = False  # Megatron-LM: only the interleaved schedule aligns gathers
    if args.overlap_param_gather_with_optimizer_step:
        for needed, rule in ((args.use_distributed_optimizer, "needs the distributed optimizer "
                                                               "(--use-distributed-optimizer)"),
                             (args.overlap_param_gather, "needs --overlap-param-gather"),
                             (args.virtual_pipeline_model_parallel_size is not None,
                              "needs virtual pipeline stages (--num-layers-per-virtual-pipeline-stage)"),
                             (False, f"is not supported with distributed checkpointing (--ckpt-format "
                                     f"{args.ckpt_format or 'torch_dist'}) but only with --ckpt-format torch, which "
                                     "this job does not implement: drop it")):
            if not needed:
                refuse(f"--overlap-param-gather-with-optimizer-step {rule} (Megatron-LM's rule)")


# ----------------------------------------------------------------------------- substitutions (substitutions.py)

def bucket_substitutions(args: argparse.Namespace) -> List[Substitution]:
    """The DDP bucket sizes under --use-megatron-fsdp, which reduces per unit."""
    out = []
    if args.use_megatron_fsdp:
        for flag, value in (("--ddp-bucket-size", args.ddp_bucket_size), ("--ddp-num-buckets", args.ddp_num_buckets)):
            if value is not None:
                out.append(Substitution(f"{flag} {value}", "one reduction per FSDP unit",
                                        "megatron.fsdp reduces each unit's gradients together"))
    return out

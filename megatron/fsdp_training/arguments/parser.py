"""The job's parser, assembled from the concern modules, and ``validate_args``, which runs their rules in order.

Validation runs before any process group exists and reports each inconsistency in one message that
names the arguments and the fix. The order of the rules is part of the behaviour (the first problem
found is the one reported, and later rules read what earlier ones derived), so it is written out
once, here; the rules themselves live with their flags (docs/arguments.md, "Arguments").
"""

from __future__ import annotations

import argparse
from typing import List, Optional

from ..errors import ArgumentError
from . import (checkpointing_flags, data_flags, logging_flags, megatron_fsdp_flags, model_flags, moe_flags,
               optimizer_flags, parallelism_flags, precision_flags, substitutions, training_flags)
from .help import DefaultsHelpFormatter, show_every_default
from .not_built import parse_error_line

DESCRIPTION = ("Pretrain a GPT with Megatron-Core (--use-megatron-fsdp for megatron.fsdp). The flags are "
               "Megatron-LM's, with its names, defaults and meanings: where one means something else here, or "
               "runs a substitute on a machine without its kernel (said in one start-up line), its help says so "
               "(docs/arguments.md).")

# The start-up line's providers, in the order the line says them.
substitutions.register_providers((
    model_flags.kernel_substitutions, data_flags.tokenizer_substitutions, training_flags.memory_substitutions,
    checkpointing_flags.format_substitutions, model_flags.mcore_models_substitutions,
    training_flags.cuda_substitutions, data_flags.reader_substitutions, parallelism_flags.bucket_substitutions,
    checkpointing_flags.non_persistent_substitutions, logging_flags.profiling_substitutions,
    model_flags.gradient_accumulation_substitutions, megatron_fsdp_flags.megatron_fsdp_substitutions,
    moe_flags.dispatcher_substitutions, precision_flags.fp8_substitutions))


class JobArgumentParser(argparse.ArgumentParser):
    """A parse error is one ``ArgumentError`` (one line, rank 0), not argparse's usage on every rank."""

    def error(self, message: str):
        raise ArgumentError(parse_error_line(message))


def build_parser() -> argparse.ArgumentParser:
    """Every flag, one ``--help`` group per concern."""
    p = JobArgumentParser(description=DESCRIPTION, allow_abbrev=False, formatter_class=DefaultsHelpFormatter)
    model_flags.add_model_args(p)
    moe_flags.add_moe_args(p)
    parallelism_flags.add_parallelism_args(p)
    megatron_fsdp_flags.add_megatron_fsdp_args(p)
    precision_flags.add_precision_args(p)
    optimizer_flags.add_optimizer_args(p)
    data_flags.add_data_args(p)
    training_flags.add_training_args(p)
    checkpointing_flags.add_checkpointing_args(p)
    logging_flags.add_logging_args(p)
    return show_every_default(p)


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Derive defaults and check consistency against ``world_size``; raise ArgumentError on the first problem."""
    megatron_fsdp_flags.apply_megatron_fsdp_defaults(args)
    optimizer_flags.validate_muon(args)
    parallelism_flags.validate_world(args, world_size)
    training_flags.resolve_batch_size(args)
    training_flags.resolve_train_length(args)
    megatron_fsdp_flags.validate_levels(args)
    parallelism_flags.validate_pipeline(args)
    model_flags.validate_shape(args)
    moe_flags.validate_layers(args)
    model_flags.validate_mla_and_mtp(args)
    moe_flags.validate_router(args)
    parallelism_flags.validate_tensor_and_context(args)
    precision_flags.validate_fp16(args)
    data_flags.validate_sources(args)
    model_flags.derive_sizes(args)
    optimizer_flags.validate_learning_rate(args)
    training_flags.default_eval_interval(args)
    moe_flags.validate_experts(args, world_size)
    megatron_fsdp_flags.validate_initialisation(args)
    megatron_fsdp_flags.validate_megatron_fsdp(args)
    model_flags.validate_gradient_accumulation_fusion(args)
    megatron_fsdp_flags.map_megatron_fsdp_dtypes(args)
    precision_flags.validate_grad_reduce_in_bf16(args)
    megatron_fsdp_flags.validate_buffers(args)
    precision_flags.validate_precision_aware_optimizer(args)
    checkpointing_flags.validate_checkpointing(args)
    data_flags.validate_datasets(args)
    logging_flags.validate_writers(args)
    parallelism_flags.validate_overlap(args)
    training_flags.validate_cuda_only(args)
    model_flags.validate_kernels(args)
    training_flags.validate_recompute_and_memory(args)
    checkpointing_flags.validate_non_persistent(args)
    data_flags.validate_split_paths(args)
    logging_flags.validate_scalars(args)
    model_flags.enable_experimental(args)
    logging_flags.validate_profiling(args)
    checkpointing_flags.validate_async_save(args)
    checkpointing_flags.validate_fault_tolerance(args, world_size)
    model_flags.resolve_transformer_impl(args)
    precision_flags.validate_fp8(args)  # with the layer implementation known: Transformer Engine's FP8 or the CPU layers
    return args


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)

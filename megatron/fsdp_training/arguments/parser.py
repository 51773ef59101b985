"""The job's parser, assembled from the concern modules, and ``validate_args``, which runs their rules in order.

Validation runs before any process group exists and reports each inconsistency in one message that
names the arguments and the fix. The order of the rules is part of the behaviour (the first problem
found is the one reported, and later rules read what earlier ones derived), so it is written out
once, here; the rules themselves live with their flags (docs/training.md, "Arguments").
"""

from __future__ import annotations

import argparse
from typing import List, Optional

from ..errors import ArgumentError
from . import (checkpointing, data, logging, megatron_fsdp, model, moe, optimizer, parallelism, precision,
               substitutions, training)
from .help import DefaultsHelpFormatter, show_every_default
from .not_built import parse_error_line

DESCRIPTION = ("Pretrain a GPT with Megatron-Core (--use-megatron-fsdp for megatron.fsdp). The flags are "
               "Megatron-LM's, with its names, defaults and meanings: where one means something else here, or "
               "runs a substitute on a machine without its kernel (said in one start-up line), its help says so "
               "(docs/training.md).")

# The start-up line's providers, in the order the line says them.
substitutions.register_providers((
    model.kernel_substitutions, data.tokenizer_substitutions, training.memory_substitutions,
    checkpointing.format_substitutions, model.mcore_models_substitutions, training.cuda_substitutions,
    data.reader_substitutions, parallelism.bucket_substitutions, checkpointing.non_persistent_substitutions,
    logging.profiling_substitutions, model.gradient_accumulation_substitutions,
    megatron_fsdp.megatron_fsdp_substitutions, moe.dispatcher_substitutions, precision.fp8_substitutions))


class JobArgumentParser(argparse.ArgumentParser):
    """A parse error is one ``ArgumentError`` (one line, rank 0), not argparse's usage on every rank."""

    def error(self, message: str):
        raise ArgumentError(parse_error_line(message))


def build_parser() -> argparse.ArgumentParser:
    """Every flag, one ``--help`` group per concern."""
    p = JobArgumentParser(description=DESCRIPTION, allow_abbrev=False, formatter_class=DefaultsHelpFormatter)
    model.add_model_args(p)
    moe.add_moe_args(p)
    parallelism.add_parallelism_args(p)
    megatron_fsdp.add_megatron_fsdp_args(p)
    precision.add_precision_args(p)
    optimizer.add_optimizer_args(p)
    data.add_data_args(p)
    training.add_training_args(p)
    checkpointing.add_checkpointing_args(p)
    logging.add_logging_args(p)
    return show_every_default(p)


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Derive defaults and check consistency against ``world_size``; raise ArgumentError on the first problem."""
    megatron_fsdp.apply_megatron_fsdp_defaults(args)
    optimizer.validate_muon(args)
    parallelism.validate_world(args, world_size)
    training.resolve_batch_size(args)
    training.resolve_train_length(args)
    megatron_fsdp.validate_levels(args)
    parallelism.validate_pipeline(args)
    model.validate_shape(args)
    moe.validate_layers(args)
    model.validate_mla_and_mtp(args)
    moe.validate_router(args)
    parallelism.validate_tensor_and_context(args)
    precision.validate_fp16(args)
    data.validate_sources(args)
    model.derive_sizes(args)
    optimizer.validate_learning_rate(args)
    training.default_eval_interval(args)
    moe.validate_experts(args, world_size)
    megatron_fsdp.validate_initialisation(args)
    megatron_fsdp.validate_megatron_fsdp(args)
    model.validate_gradient_accumulation_fusion(args)
    megatron_fsdp.map_megatron_fsdp_dtypes(args)
    precision.validate_grad_reduce_in_bf16(args)
    megatron_fsdp.validate_buffers(args)
    precision.validate_precision_aware_optimizer(args)
    checkpointing.validate_checkpointing(args)
    data.validate_datasets(args)
    logging.validate_writers(args)
    parallelism.validate_overlap(args)
    training.validate_cuda_only(args)
    model.validate_kernels(args)
    training.validate_recompute_and_memory(args)
    checkpointing.validate_non_persistent(args)
    data.validate_split_paths(args)
    logging.validate_scalars(args)
    model.enable_experimental(args)
    logging.validate_profiling(args)
    checkpointing.validate_async_save(args)
    checkpointing.validate_fault_tolerance(args, world_size)
    model.resolve_transformer_impl(args)
    precision.validate_fp8(args)  # with the layer implementation known: Transformer Engine's FP8 or the CPU layers
    return args


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)

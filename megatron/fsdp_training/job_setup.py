"""Everything a checkpoint restores, built from the arguments: process groups, tokenizer, model chunks wrapped by
the chosen data-parallel implementation, optimizer and learning-rate schedule (``setup``).

``setup`` is where the namespace becomes typed values: it validates it, sets the vocabulary sizes the tokenizer
decides (``true_vocab_size``, ``padded_vocab_size``), then hands it to the mappers (``ParallelConfig``,
``model.transformer_config``, ``model.ModelBuildConfig``, ``model.ddp_config``, ...); the builders take their results.
"""

from __future__ import annotations

from .checkpointing import non_persistent, save_load as checkpointing
from .checkpointing.checkpoint_config import CheckpointConfig
from .data import datasets as data
from .data.data_config import DataConfig
from . import model as model_lib
from .arguments import validate_args
from .arguments.precision_flags import fp8_start_up_line
from .arguments.substitutions import substitution_line
from .initialize import gloo_twin_groups, initialize, launch_world_size
from .logs.lines import memory_line, print_rank_0
from .parallel_config import ParallelConfig


def setup(args, hold_save: bool = False):
    """Entry point of the build, the one place that writes the namespace (the vocabulary sizes) before mapping it.

    Process groups, tokenizer, model chunks, optimizer and LR schedule: everything a checkpoint restores.

    ``hold_save``: take the locks of ``--save`` and the non-persistent directories first (the training job; tests
    that build the pieces do not), as soon as the arguments are validated and the process groups exist.
    Returns ``(device, tokenizer, model chunks, optimizer, scheduler)``.
    """
    validate_args(args, launch_world_size())  # before any process group: a bad set stops every rank alike
    parallel = ParallelConfig.from_args(args)
    device = initialize(parallel, args.seed)
    if hold_save:
        # for its directories only, before anything is built: the Trainer reads its own view after the build,
        # which completes arguments a checkpoint records (the padded vocabulary)
        checkpoint = CheckpointConfig.from_args(args)
        checkpointing.hold_save_directory(checkpoint)  # a second job with this --save stops here, naming the first
        non_persistent.hold(checkpoint)  # and one with these non-persistent directories
    substitutions = substitution_line(args)  # which kernels and backends the job substituted, in one line
    if substitutions:
        print_rank_0(substitutions)
    fp8_line = fp8_start_up_line(args)
    if fp8_line:
        print_rank_0(fp8_line)
    cpu = device.type == "cpu"
    data_config = DataConfig.from_args(args)
    tokenizer = data.build_tokenizer(data_config.tokenizer)
    try:
        data.check_vocabulary(data_config, tokenizer.vocab_size)
    except ValueError as exc:  # the same on every rank: one line, as the start-up checks give
        from .errors import ArgumentError

        raise ArgumentError(str(exc)) from None
    args.true_vocab_size = tokenizer.vocab_size  # checkpoints cut or add padding rows against it
    vocab = args.padded_vocab_size = data.padded_vocab_size(
        tokenizer.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    config = model_lib.transformer_config(args, cpu)
    chunks = model_lib.build_model_chunks(config, model_lib.ModelBuildConfig.from_args(args, cpu), vocab)
    ddp_config = model_lib.ddp_config(args, model_lib.parameter_count(chunks))
    model, optimizer, wire = model_lib.wrap_and_optimize(
        config, chunks, ddp_config, model_lib.optimizer_config(args), model_lib.optimizer_precision(args),
        gloo_twin_groups(parallel.disable_gloo_process_groups))
    print_rank_0(f" > model built{' on the meta device, materialised unit by unit' if args.init_model_with_meta_device else ''}"
                 f" | build {memory_line()}")
    scheduler = model_lib.scheduler(model_lib.ScheduleConfig.from_args(args), optimizer)
    wire()
    return device, tokenizer, model, optimizer, scheduler

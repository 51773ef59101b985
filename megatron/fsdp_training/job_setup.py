"""Everything a checkpoint restores, built from the arguments: process groups, tokenizer, model chunks wrapped by
the chosen data-parallel implementation, optimizer and learning-rate schedule (``setup``)."""

from __future__ import annotations

from .checkpointing import non_persistent, save_load as checkpointing
from .data import datasets as data
from . import model as model_lib
from .arguments.precision_flags import fp8_start_up_line
from .initialize import announce_substitutions, initialize
from .logs.lines import memory_line, print_rank_0


def setup(args, hold_save: bool = False):
    """Process groups, tokenizer, model chunks, optimizer and LR schedule: everything a checkpoint restores.

    ``hold_save``: take ``--save``'s lock first (the training job; tests that build the pieces do not).
    Returns ``(device, tokenizer, model chunks, optimizer, scheduler)``.
    """
    device = initialize(args)
    if hold_save:
        checkpointing.hold_save_directory(args)  # a second job with this --save stops here, naming the first
        non_persistent.hold(args)  # and one with these non-persistent directories
    announce_substitutions(args)
    fp8_line = fp8_start_up_line(args)
    if fp8_line:
        print_rank_0(fp8_line)
    cpu = device.type == "cpu"
    tokenizer = data.build_tokenizer(args)
    try:
        data.check_vocabulary(args, tokenizer.vocab_size)
    except ValueError as exc:  # the same on every rank: one line, as the start-up checks give
        from .errors import ArgumentError

        raise ArgumentError(str(exc)) from None
    args.true_vocab_size = tokenizer.vocab_size  # checkpoints cut or add padding rows against it
    vocab = args.padded_vocab_size = data.padded_vocab_size(tokenizer.vocab_size, args)
    config = model_lib.transformer_config(args, cpu)
    chunks = model_lib.build_model_chunks(args, config, vocab, cpu)
    model, optimizer, wire = model_lib.wrap_and_optimize(args, config, chunks)
    print_rank_0(f" > model built{' on the meta device, materialised unit by unit' if args.init_model_with_meta_device else ''}"
                 f" | build {memory_line()}")
    scheduler = model_lib.scheduler(args, optimizer)
    wire()
    return device, tokenizer, model, optimizer, scheduler

"""The job's pieces around the loop: the forward step and its loss, evaluation, ``setup`` (everything a checkpoint
restores) and the entry point. The loop itself is ``trainer.Trainer``."""

from __future__ import annotations

if __name__ == "__main__":  # `python -m megatron.fsdp_training.training`: the job, as `-m megatron.fsdp_training`
    from megatron.fsdp.commands import set_command_defaults  # before this file imports Megatron-Core

    set_command_defaults()
    from megatron.fsdp_training.training import main

    raise SystemExit(main())

from typing import Sequence

import torch.distributed as dist

from .checkpointing.files import CheckpointError
from .initialize import shutdown
from .logs.lines import print_rank_0
from .trainer import Trainer, TrainingObserver


def pretrain(args, observers: Sequence[TrainingObserver] = ()) -> None:
    """Train a GPT as Megatron-LM does (``trainer.Trainer``); ``observers`` see each step, validation and the end.

    ``--save``'s lock (``checkpointing/ownership.py``) is held from ``setup`` to the end, however it ends.
    """
    trainer = Trainer(args, observers)
    try:
        trainer.setup()
        trainer.run()
    finally:
        trainer.close()


def main(argv=None) -> None:
    from .arguments import parse_args

    run_entry_point(lambda command_line: pretrain(parse_args(command_line)), argv)


def run_entry_point(body, args):
    """``body(args)`` as a command runs it: a user error is one line (rank 0) and exit code 2, and the
    process groups are shut down however it ends (the training job, the generation tool)."""
    from .errors import ArgumentError

    try:
        return body(args)
    except (ArgumentError, CheckpointError) as exc:
        print_rank_0(f"error: {exc}")
        raise SystemExit(2)
    finally:
        if dist.is_initialized():
            shutdown()

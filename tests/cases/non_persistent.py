"""Worker side of the non-persistent checkpoint tests: a run that crashes after an iteration, inside a gloo pool."""

from __future__ import annotations

import contextlib
import io
from typing import Dict, List


class Crash(RuntimeError):
    """What stops the run: as if the job had been killed after the iteration's saves."""


def crashed_after(ctx, argv: List[str], iteration: int) -> Dict[str, object]:
    """``pretrain`` on ``argv``, stopped at the start of iteration ``iteration + 1`` (after iteration ``iteration``
    and its saves): whether it crashed there, and rank 0's log."""
    from megatron.fsdp_training import trainer, training
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.testing.megatron_case import megatron_case

    original = trainer.global_batch_at  # what the loop asks for each iteration's batch

    def crashing(args, consumed):
        if consumed >= iteration * args.global_batch_size:
            raise Crash(f"stopped after iteration {iteration}")
        return original(args, consumed)

    log = io.StringIO()
    crashed = False
    trainer.global_batch_at = crashing
    try:
        with megatron_case(), contextlib.redirect_stdout(log):
            training.pretrain(parse_args(argv))
    except Crash:
        crashed = True
    finally:
        trainer.global_batch_at = original
    return {"crashed": crashed, "log": log.getvalue()}


def local_write_fails(ctx, argv: List[str], rank: int, iteration: int) -> Dict[str, object]:
    """``pretrain`` on ``argv`` (local non-persistent saves), with ``rank``'s write of ``iteration`` failing: the
    one-line error every rank stops with."""
    import torch.distributed as dist

    from megatron.fsdp_training import training
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.checkpointing import non_persistent
    from megatron.fsdp_training.checkpointing.files import CheckpointError
    from megatron.fsdp_training.testing.megatron_case import megatron_case

    original = non_persistent._write_local

    def failing(args, root, at, *rest):
        if at == iteration and dist.get_rank() == rank:
            raise OSError(28, "No space left on device")
        return original(args, root, at, *rest)

    non_persistent._write_local = failing
    error = None
    try:
        with megatron_case(), contextlib.redirect_stdout(io.StringIO()):
            training.pretrain(parse_args(argv))
    except CheckpointError as exc:
        error = str(exc)
    finally:
        non_persistent._write_local = original
    return {"error": error}

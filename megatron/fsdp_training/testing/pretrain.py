"""``pretrain_gpt``'s training function run inside a Megatron pool (no new processes)."""

from __future__ import annotations

import contextlib
import io
from typing import List


def pretrain_in_pool(ctx, argv: List[str], capture_log: bool = False) -> dict:
    """``pretrain(parse_args(argv))`` on the whole pool; ``capture_log``: also return rank 0's printed log
    (``"log"``), the lines a torchrun launch would print."""
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.training import pretrain
    from megatron.fsdp_training.testing.megatron_case import megatron_case

    log = io.StringIO()
    with megatron_case(), (contextlib.redirect_stdout(log) if capture_log else contextlib.nullcontext()):
        history = pretrain(parse_args(argv))
    if capture_log:
        history = dict(history, log=log.getvalue())
    return history

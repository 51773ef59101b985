"""``pretrain_gpt``'s training function run inside the 4-rank Megatron pool (no new processes)."""

from __future__ import annotations

from typing import List


def pretrain_in_pool(ctx, argv: List[str]) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.fsdp.mcore.cpu_mode import disable_cpu_mode
    from megatron.training.arguments import parse_args
    from megatron.training.training import pretrain
    from tests.harness.pool import releasing_new_groups

    with releasing_new_groups():
        try:
            return pretrain(parse_args(argv))
        finally:
            disable_cpu_mode()
            ps.destroy_model_parallel()


def pretrain_logged(ctx, argv: List[str]) -> dict:
    """``pretrain_in_pool`` that also returns what rank 0 printed (the log lines), under ``"stdout"``."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        history = pretrain_in_pool(ctx, argv)
    return {**history, "stdout": out.getvalue()}

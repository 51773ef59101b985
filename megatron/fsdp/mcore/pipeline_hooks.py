"""Wiring for ``megatron.core.pipeline_parallel.get_forward_backward_func``."""

from __future__ import annotations

from typing import List

from .finalize import finalize_model_grads


def configure_schedule_hooks(config, model_chunks: List) -> None:
    """Set ``no_sync_func``, ``grad_sync_func`` and ``finalize_model_grads_func`` on ``config``.

    ``no_sync`` defers the once-per-step reductions of every chunk; the last
    micro-batch's backward (outside ``no_sync``) issues them from the backward
    hooks; ``grad_sync_func`` (called by the interleaved schedule when a chunk
    has finished its last backward) issues any that are left; and
    ``finalize_model_grads`` completes them before the optimizer step.
    Parameter gathers are the engine's own (prefetching), so
    ``param_sync_func`` stays unset.
    """
    no_sync = [chunk.no_sync for chunk in model_chunks]
    grad_sync = [chunk.start_grad_sync for chunk in model_chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.param_sync_func = None

"""``pretrain_gpt``'s training function in a Megatron pool, with what its data-parallel wrappers counted."""

from __future__ import annotations

from typing import List


def pretrain_with_ledger(ctx, argv: List[str]) -> dict:
    """Rank 0's history and log, plus the engine's ledger (reduce-scatter and all-gather bytes of the
    whole run, summed over model chunks) and the dtypes its gradients travel and accumulate in.

    The wrappers are taken from ``model.wrap_and_optimize`` as the job builds them; Megatron-Core's
    DDP has no ledger (``None``).
    """
    from megatron.fsdp_training import model as model_lib
    from megatron.fsdp_training.testing.pretrain import pretrain_in_pool

    built = []
    original = model_lib.wrap_and_optimize

    def capture(*args, **kwargs):
        out = original(*args, **kwargs)
        built.append(out[0])
        return out

    model_lib.wrap_and_optimize = capture
    try:
        history = pretrain_in_pool(ctx, argv, capture_log=True)
    finally:
        model_lib.wrap_and_optimize = original
    chunks = [chunk.fsdp for chunk in built[-1] if hasattr(chunk, "fsdp")]
    if not chunks:
        return dict(history, reduce_scatter_bytes=None)
    storages = [unit.storage for fsdp in chunks for unit in fsdp.units if unit.storage.trainable_params]
    return dict(history,
                reduce_scatter_bytes=sum(f.ledger.bytes("reduce_scatter") for f in chunks),
                reduce_scatter_calls=sum(f.ledger.calls("reduce_scatter") for f in chunks),
                reduce_dtypes=sorted({str(s.reduce_dtype) for s in storages}),
                main_grad_dtypes=sorted({str(s.main_grad.dtype) for s in storages}),
                gather_buffers=sum(1 for s in storages if s.gather_buffer is not None))

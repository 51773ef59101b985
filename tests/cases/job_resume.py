"""Worker side of the resume cases: the free-space estimate against what a save writes, inside a gloo pool."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import torch.distributed as dist

from megatron.fsdp_training.testing.megatron_case import megatron_case


def save_size_estimate(ctx, argv: List[str]) -> Dict[str, int]:
    """Train and save once (``argv`` has ``--save``): the save's size estimate, and the bytes it wrote."""
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.checkpointing import files, paths, save_load
    from megatron.fsdp_training.training import pretrain

    args = parse_args(argv)
    estimates = []
    estimate = save_load.estimate_bytes

    def recording(state, group=None):
        estimates.append(estimate(state, group))
        return estimates[-1]
    save_load.estimate_bytes = recording
    try:
        with megatron_case():
            pretrain(args)
    finally:
        save_load.estimate_bytes = estimate
    dist.barrier()
    root = Path(args.save)
    written = paths.directory_bytes(files.checkpoint_dir(root, files.read_tracker(root)))
    return {"estimate": estimates[-1], "written": written}


def start_error(ctx, argv: List[str], capture_log: bool = False) -> Dict[str, object]:
    """Run the job's ``pretrain`` on ``argv``: the one-line error it stops with (None if it trained), its history,
    and (``capture_log``) rank 0's printed log. Any other exception fails the case."""
    import contextlib
    import io

    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.checkpointing.files import CheckpointError
    from megatron.fsdp_training.errors import ArgumentError
    from megatron.fsdp_training.testing.pretrain import HistoryRecorder
    from megatron.fsdp_training.training import pretrain

    log, recorder = io.StringIO(), HistoryRecorder()
    out: Dict[str, object] = {"error": None, "history": None}
    with megatron_case(), (contextlib.redirect_stdout(log) if capture_log else contextlib.nullcontext()):
        try:
            pretrain(parse_args(argv), observers=[recorder])
            out["history"] = recorder.history
        except (ArgumentError, CheckpointError) as exc:
            out["error"] = str(exc)
    out["log"] = log.getvalue()
    return out

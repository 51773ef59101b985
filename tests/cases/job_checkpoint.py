"""Worker side of the training job's checkpoint tests: the job's pieces inside a gloo pool (no new processes).

Shared by test_checkpointing, test_resume, test_non_persistent and test_checkpoint_failures; a case
only one of them runs lives in that module."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron.fsdp_training.testing.megatron_case import megatron_case


def _snapshot(model, optimizer) -> Dict[str, torch.Tensor]:
    """Full weights and this rank's optimizer state (copies), to show a failed load changed nothing."""
    out = {f"model.{k}": v for chunk in model for k, v in chunk.full_state_dict().items()}
    for k, v in optimizer.state_dict().items():
        local = v._local_tensor if hasattr(v, "_local_tensor") else v
        out[f"optimizer.{k}"] = local.clone() if isinstance(local, torch.Tensor) else local
    return out


def same_values(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def load_error(ctx, argv: List[str]) -> Dict[str, object]:
    """Build the model of ``argv``, try ``--load``: the error, and whether anything changed."""
    from megatron.fsdp_training.checkpointing import save_load as checkpointing
    from megatron.fsdp_training.checkpointing.checkpoint_config import CheckpointConfig
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.job_setup import setup

    args = parse_args(argv)
    with megatron_case():
        _, _, model, optimizer, scheduler = setup(args)
        before = _snapshot(model, optimizer)
        lr = optimizer.param_groups[0]["lr"]
        try:
            checkpointing.load_checkpoint(CheckpointConfig.from_args(args), model, optimizer, scheduler)
            error = None
        except checkpointing.CheckpointError as exc:
            error = str(exc)
        after = _snapshot(model, optimizer)
        unchanged = sorted(before) == sorted(after) and all(same_values(before[k], after[k]) for k in before)
        return {"error": error, "unchanged": unchanged and optimizer.param_groups[0]["lr"] == lr}


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


def full_disk_saves(ctx, argv: List[str], directory: str, local: bool = False) -> Dict[str, object]:
    """Save into a size-limited ``directory`` (``--save``; ``local``: ``argv`` names it as the local non-persistent
    directory, and the save is a local non-persistent one): the size check, then a write that really hits ENOSPC.
    Each one's error, and the files left in ``directory``."""
    from megatron.fsdp_training.checkpointing import non_persistent, save_load as checkpointing
    from megatron.fsdp_training.checkpointing.checkpoint_config import CheckpointConfig
    from megatron.fsdp_training.checkpointing import paths as checkpoint_paths
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.job_setup import setup

    args = parse_args(argv if local else argv + ["--save", directory])
    save = non_persistent.save if local else checkpointing.save_checkpoint
    out: Dict[str, object] = {}
    with megatron_case():
        _, _, model, optimizer, scheduler = setup(args)
        for label, patched in (("checked", False), ("enospc", True)):
            original = checkpoint_paths.space_problem
            if patched:  # pretend the estimate fitted: the write itself runs out of space
                checkpoint_paths.space_problem = lambda *a, **k: None
            try:
                save(CheckpointConfig.from_args(args), 2, 16, model, optimizer, scheduler)
                out[label] = None
            except checkpointing.CheckpointError as exc:
                out[label] = str(exc)
            finally:
                checkpoint_paths.space_problem = original
            dist.barrier()
            out[label + "_leftovers"] = sorted(str(p.relative_to(directory)) for p in Path(directory).rglob("*")
                                               if p.is_file())
    return out

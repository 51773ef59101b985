"""Worker side of the checkpoint failure cases: damaged checkpoints and a full disk, inside a gloo pool."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Dict, List

import torch.distributed as dist

from megatron.fsdp_training.testing.megatron_case import megatron_case


def _damage(directory: Path, how: str) -> None:
    root = directory.parent
    distcp = sorted(directory.glob("*.distcp"))[0]
    if how == "truncate":
        with open(distcp, "r+b") as f:
            f.truncate(distcp.stat().st_size // 2)
    elif how == "overwrite":  # same size, finite floats: only a checksum can tell
        import struct
        with open(distcp, "r+b") as f:
            f.seek(min(4096, distcp.stat().st_size // 4))
            f.write(struct.pack("<4096f", *([0.5] * 4096)))
    elif how == "no_metadata":
        (directory / ".metadata").unlink()
    elif how == "binary_tracker":
        (root / "latest_checkpointed_iteration.txt").write_bytes(b"\x00\x9f\xff garbage")


def damaged_loads(ctx, argv: List[str], directory: str, damages: List[str]) -> Dict[str, str]:
    """For each kind of damage: apply it to the newest checkpoint (a pristine copy restored first), try --load."""
    from megatron.fsdp_training.checkpointing import save_load as checkpointing
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.job_setup import setup

    root = Path(directory)
    newest = root / f"iter_{int((root / 'latest_checkpointed_iteration.txt').read_text()):07d}"
    pristine = root.parent / (root.name + "_pristine")
    args = parse_args(argv + ["--load", directory])
    out = {}
    with megatron_case():
        _, _, model, optimizer, scheduler = setup(args)
        if dist.get_rank() == 0:
            shutil.copytree(root, pristine)
        for how in damages:
            if dist.get_rank() == 0:
                shutil.rmtree(root)
                shutil.copytree(pristine, root)
                _damage(newest, how)
            dist.barrier()
            try:
                checkpointing.load_checkpoint(args, model, optimizer, scheduler)
                out[how] = None
            except checkpointing.CheckpointError as exc:
                out[how] = str(exc)
            dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root)
            shutil.copytree(pristine, root)
    return out


def full_disk_saves(ctx, argv: List[str], directory: str, local: bool = False) -> Dict[str, object]:
    """Save into a size-limited ``directory`` (``--save``; ``local``: ``argv`` names it as the local non-persistent
    directory, and the save is a local non-persistent one): the size check, then a write that really hits ENOSPC.
    Each one's error, and the files left in ``directory``."""
    from megatron.fsdp_training.checkpointing import non_persistent, save_load as checkpointing
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
                save(args, 2, 16, model, optimizer, scheduler)
                out[label] = None
            except checkpointing.CheckpointError as exc:
                out[label] = str(exc)
            finally:
                checkpoint_paths.space_problem = original
            dist.barrier()
            out[label + "_leftovers"] = sorted(str(p.relative_to(directory)) for p in Path(directory).rglob("*")
                                               if p.is_file())
    return out


def sigterm_mid_training(ctx, argv: List[str], at_iteration: int) -> Dict[str, object]:
    """Rank 1 (only) gets SIGTERM during iteration ``at_iteration``; with --exit-signal-handler all ranks save and stop."""
    import os
    import signal

    from megatron.fsdp_training import forward_step
    from megatron.fsdp_training.testing.pretrain import pretrain_in_pool

    calls = {"n": 0}
    original = forward_step.mean_loss

    def mean_loss(reduced):
        calls["n"] += 1
        if calls["n"] == at_iteration and dist.get_rank() == dist.get_world_size() - 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only records it
        return original(reduced)

    forward_step.mean_loss = mean_loss
    try:
        history = pretrain_in_pool(ctx, argv)
    finally:
        forward_step.mean_loss = original
    return {"iterations": len(history["losses"]), "handler_restored": signal.getsignal(signal.SIGTERM)}

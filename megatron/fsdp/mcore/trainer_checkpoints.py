"""Whose ``fsdp_dtensor`` checkpoint is this: Megatron-LM's trainer's or this project's job's.

Both write the same tensors under the same keys through this adapter; Megatron-LM's trainer keeps ``args``,
``iteration`` and ``checkpoint_version`` as entries of its DCP files, this project's job keeps them in
``common.json`` beside them. Each trainer reading the other's gets one line naming the converter
(``megatron-fsdp-convert from-megatron-lm`` / ``to-megatron-lm``, docs/trainers.md) instead of DCP's
missing-key traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Set

from megatron.fsdp.commands import CONVERT

MEGATRON_LM_ENTRIES = ("args", "iteration", "checkpoint_version")
JOB_COMMON = "common.json"  # this project's job's (megatron/fsdp_training/checkpointing/files.py names it too)
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's name, both trainers'


def dcp_keys(directory: Path) -> Set[str]:
    """The keys of a DCP checkpoint's metadata (empty: not a DCP directory)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return set(FileSystemReader(str(directory)).read_metadata().state_dict_metadata)
    except Exception:  # noqa: BLE001 - no or unreadable .metadata: not one of these checkpoints
        return set()


def is_megatron_lm_checkpoint(directory: Path) -> bool:
    return set(MEGATRON_LM_ENTRIES) <= dcp_keys(directory)


def is_job_checkpoint(directory: Path) -> bool:
    return (Path(directory) / JOB_COMMON).is_file() and not is_megatron_lm_checkpoint(directory)


def megatron_lm_checkpoint_in_job(directory: Path) -> Optional[str]:
    """The line for this project's job asked to load a checkpoint of Megatron-LM's trainer (None: it is not one)."""
    if not is_megatron_lm_checkpoint(directory):
        return None
    return (f"{directory} was written by Megatron-LM's trainer (args and iteration inside its DCP files, no "
            f"{JOB_COMMON}): convert it with `{CONVERT} from-megatron-lm {directory} NEW_DIR`, then --load NEW_DIR")


def job_checkpoint_in_megatron_lm(load_dir: str, step: Optional[int] = None) -> Optional[str]:
    """The line for Megatron-LM's trainer asked to ``--load`` a checkpoint of this project's job (None: it is not)."""
    root = Path(load_dir)
    if step is None:
        try:
            step = int((root / TRACKER).read_text().strip())
        except (OSError, ValueError):
            return None
    directory = root / f"iter_{step:07d}"
    if not is_job_checkpoint(directory):
        return None
    return (f"{directory} was written by this project's training job ({JOB_COMMON} beside the DCP files), which "
            f"Megatron-LM's trainer does not read: convert it with `{CONVERT} to-megatron-lm {root} NEW_DIR`, then "
            "--load NEW_DIR")

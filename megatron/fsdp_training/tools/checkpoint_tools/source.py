"""What a converter reads: the source checkpoint, checked before anything is written to the destination.

Why: ``from-torch-dist`` of a truncated ``.distcp`` gave 16-30 frames of DCP traceback once it had begun
writing; a garbage ``common.pt`` or a missing ``.metadata`` gave tracebacks too. Each is now one line naming
the file, raised before the destination is touched: every file DCP's ``.metadata`` points into must be
there and long enough for the byte ranges it names. What cannot be checked is said instead: torch_dist
(and HuggingFace safetensors, and a torch file) carry no checksums, so a flipped bit converts undetected;
the converted checkpoint's manifest records its source as unverified (``manifest.unverified_source``) and
``inspect.py --verify`` says what its checksums do and do not vouch for. An fsdp_dtensor source has a
manifest: it is verified (sizes and CRC-32) before it is converted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from megatron.fsdp.commands import PRETRAIN

# What a converter says of a layout-1 checkpoint written at TP > 1 (its keys per tensor-parallel rank).
LAYOUT_V1 = (f"this checkpoint has layout version 1 (keys per tensor-parallel rank): load it with {PRETRAIN} at the "
             "TP size it was saved with and save it again, then convert that")

NO_CHECKSUMS = "carries no checksums"


def first_line(exc: BaseException) -> str:
    """The exception's type and first line; for DCP's ``CheckpointException`` (a traceback per rank), its cause's."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        if isinstance(inner, BaseException):
            return first_line(inner)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def dcp_problems(directory: Path) -> List[str]:
    """What is missing or short in a DCP checkpoint, read from its ``.metadata`` alone (no tensor is read)."""
    from torch.distributed.checkpoint import FileSystemReader

    directory = Path(directory)
    if not (directory / ".metadata").is_file():
        return [f"{directory / '.metadata'} is missing"]
    try:
        storage = FileSystemReader(str(directory)).read_metadata().storage_data
    except Exception as exc:  # noqa: BLE001 - a damaged file: any unpickling error
        return [f"{directory / '.metadata'} is unreadable ({first_line(exc)})"]
    ends: Dict[str, int] = {}
    for info in (storage or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, end in sorted(ends.items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif path.stat().st_size < end:
            problems.append(f"{path} has {path.stat().st_size} bytes, its .metadata names bytes up to {end} "
                            "(truncated)")
    return problems


def _refuse(directory: Path, problems: List[str]) -> None:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise SystemExit(f"error: checkpoint {directory} is damaged: {problems[0]}{more}; nothing was converted "
                     "(pass --iteration N to convert another iteration of its directory)")


def check_torch_dist(directory: Path) -> Dict[str, Any]:
    """A torch_dist source's common state (iteration, args, schedule), after its DCP files are checked."""
    from megatron.fsdp_training.checkpointing.torch_dist import read_common
    from megatron.fsdp.mcore_releases import torch_dist_common_place

    problems = dcp_problems(directory)
    if problems:
        _refuse(directory, problems)
    try:
        common = read_common(directory)
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign common state: any unpickling error
        _refuse(directory, [f"{torch_dist_common_place(directory)} is unreadable ({first_line(exc)})"])
    if not isinstance(common, dict) or "args" not in common or "iteration" not in common:
        _refuse(directory, [f"{torch_dist_common_place(directory)} holds no iteration and args (not Megatron-LM's)"])
    return common


def check_fsdp_dtensor(directory: Path) -> None:
    """An fsdp_dtensor source verifies against its manifest (sizes and CRC-32 of every file) before it converts."""
    from megatron.fsdp_training.checkpointing import manifest

    problems = manifest.verify(directory) + dcp_problems(directory)
    if problems:
        _refuse(directory, problems)


def torch_dist_record(directory: Path) -> Dict[str, object]:
    from megatron.fsdp_training.checkpointing import manifest

    return manifest.unverified_source("torch_dist", str(Path(directory).resolve()), NO_CHECKSUMS)


def torch_file_record(path: Path) -> Dict[str, object]:
    from megatron.fsdp_training.checkpointing import manifest

    return manifest.unverified_source("a torch file", str(Path(path).resolve()), "was not checked against checksums")


def fsdp_dtensor_record(directory: Path) -> Dict[str, object]:
    """The source record of a conversion from this project's checkpoint: its manifest was verified first."""
    return {"format": "fsdp_dtensor", "path": str(Path(directory).resolve()), "verified": True}


def megatron_lm_record(directory: Path) -> Dict[str, object]:
    from megatron.fsdp_training.checkpointing import manifest

    return manifest.unverified_source("Megatron-LM's trainer's fsdp_dtensor", str(Path(directory).resolve()),
                                      NO_CHECKSUMS)


def tp_global_fsdp_dtensor(source: str, iteration=None):
    """A checkpoint of this project's job to convert: its directory and ``common.json``, after its manifest is
    verified, refusing layout version 1 (keys per tensor-parallel rank), which the converters do not merge."""
    from megatron.fsdp_training.checkpointing import files
    from megatron.fsdp_training.checkpointing.save_load import tp_global
    from .inspect import resolve

    directory = resolve(source, iteration)
    check_fsdp_dtensor(directory)
    common = files.read_common(directory)
    if not tp_global(common):
        raise SystemExit(LAYOUT_V1)
    return directory, common

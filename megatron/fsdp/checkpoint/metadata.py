"""Checkpoint metadata validation: does a state dict fit a DCP checkpoint, before anything is read.

One rule for the engine (``check_checkpoint_keys``, one rank's state dict) and the
training job (``megatron.fsdp_training.checkpointing.save_load.validate_keys``, the union over ranks):
keys are described as ``(shape, dtype)`` or ``("bytes",)`` after DCP's own flattening
of nested dicts, and :func:`key_mismatches` compares two descriptions. An optimizer
moment may load into another dtype (fp32 <-> bf16 state: ``converts_on_load``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..precision.optimizer_state import converts_on_load

Description = Tuple  # (shape, dtype name) of a tensor, or ("bytes",)
BYTES: Description = ("bytes",)


def mismatch_error(what: str, missing: Sequence[str], unexpected: Sequence[str],
                   wrong: Sequence[str]) -> Optional[ValueError]:
    """One error naming every missing, unexpected and mismatched key (or None)."""
    parts = []
    for label, keys in (("missing", missing), ("unexpected", unexpected), ("mismatched", wrong)):
        if keys:
            shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
            parts.append(f"{label} keys: {shown}")
    return ValueError(f"{what}: " + "; ".join(parts)) if parts else None


def _shape_of(value: Any) -> Optional[Tuple[int, ...]]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def check_against(what: str, state_dict: Mapping[str, Any], expected: Mapping[str, Optional[Tuple[int, ...]]],
                  strict: bool = True) -> None:
    """Raise one ValueError if ``state_dict`` lacks keys, has extra keys or wrong shapes (``None``: not a tensor)."""
    missing = [k for k in expected if k not in state_dict] if strict else []
    unexpected = [k for k in state_dict if k not in expected] if strict else []
    wrong = [f"{k} (state dict {_shape_of(state_dict[k])}, model {shape})" for k, shape in expected.items()
             if k in state_dict and _shape_of(state_dict[k]) != shape]
    error = mismatch_error(what, missing, unexpected, wrong)
    if error is not None:
        raise error


def describe_state_dict(state: Mapping[str, Any]) -> Dict[str, Description]:
    """``{flattened key: description}`` of a state dict, as DCP will see it."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(dict(state))
    return {k: (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else BYTES for k, v in flat.items()}


def describe_checkpoint(checkpoint_dir, reader=None) -> Dict[str, Description]:
    """``{key: description}`` of a DCP checkpoint, from its metadata file only (as ``reader`` gives it, when given)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = (reader or FileSystemReader(str(checkpoint_dir))).read_metadata()
    return {k: (tuple(md.size), str(md.properties.dtype)) if isinstance(md, TensorStorageMetadata) else BYTES
            for k, md in metadata.state_dict_metadata.items()}


def show(desc: Description) -> str:
    return "bytes" if desc == BYTES else f"{desc[0]} {desc[1].replace('torch.', '')}"


def loads_as(key: str, saved: Description, wanted: Description) -> bool:
    """The same description, or an optimizer moment of the same shape in another dtype."""
    if saved == wanted:
        return True
    if saved == BYTES and wanted == ((), "torch.bool"):  # a flag written as a Python bool (before it was a tensor)
        return True
    return len(saved) == len(wanted) == 2 and saved[0] == wanted[0] and converts_on_load(key, saved[1], wanted[1])


def key_mismatches(wanted: Mapping[str, Description], saved: Mapping[str, Description], unexpected_under=(),
                   label: str = "state dict") -> Tuple[List[str], List[str], List[str]]:
    """``(missing, unexpected, wrong)``: asked-for keys the checkpoint lacks; checkpoint keys starting
    with one of ``unexpected_under`` (``""``: every key; ``()``: none) nobody asked for; keys whose
    shape, dtype or kind differ (``label`` names the asking side in the message)."""
    prefixes = (unexpected_under,) if isinstance(unexpected_under, str) else tuple(unexpected_under)
    missing = [k for k in wanted if k not in saved]
    unexpected = [k for k in saved if prefixes and k.startswith(prefixes) and k not in wanted]
    wrong = [f"{k} (checkpoint {show(saved[k])}, {label} {show(d)})"
             for k, d in wanted.items() if k in saved and not loads_as(k, saved[k], d)]
    return missing, unexpected, wrong


def check_checkpoint_keys(state_dict: Mapping[str, Any], checkpoint_dir, allow_unexpected: bool = False) -> None:
    """Compare ``state_dict`` with a DCP checkpoint's metadata before ``dcp.load``; raise one ValueError.

    ``dcp.load`` fails on the first key it lacks and silently skips keys of the
    checkpoint the state dict does not ask for; this names every missing key
    (in the state dict, not the checkpoint), every unexpected key (in the
    checkpoint, not the state dict; ``allow_unexpected`` skips those, for
    loading part of a checkpoint) and every shape, dtype or kind mismatch.
    """
    missing, unexpected, wrong = key_mismatches(describe_state_dict(state_dict), describe_checkpoint(checkpoint_dir),
                                                () if allow_unexpected else "")
    error = mismatch_error(f"checkpoint {checkpoint_dir} does not match the state dict", missing, unexpected, wrong)
    if error is not None:
        raise error

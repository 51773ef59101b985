"""What the job pickles into a checkpoint (each rank's RNG states) in a form every supported release unpickles.

Megatron-Core 0.18 replaces ``torch.storage._load_from_bytes`` with its own ``safe_load_from_bytes`` once it is
imported, so a tensor pickled with ``pickle`` under 0.18+ cannot be unpickled under 0.16.1. The job's
checkpoints, and the converters that write them, hold NumPy arrays instead (``portable``); ``as_tensor`` turns
them back. The release differences themselves are in ``megatron/fsdp/mcore_releases.py``.
"""

from __future__ import annotations

import torch


# 0.18.0 replaces ``torch.storage._load_from_bytes`` with ``megatron.core.safe_globals.safe_load_from_bytes`` when
# it is imported, so a tensor pickled with ``pickle`` (not ``torch.save``) under 0.18+ names that function, which
# 0.16.1 lacks: the unpickling fails there. What the job pickles into a checkpoint (each rank's RNG states) holds
# NumPy arrays instead (``portable``), which every release reads; ``as_tensor`` turns them back (a tensor that an
# older checkpoint pickled passes through).
def portable(value):
    """``value`` with every tensor in it (in dicts, lists, tuples) replaced by a NumPy copy."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(portable(v) for v in value)
    return value


def as_tensor(value):
    """A tensor of ``portable``'s NumPy array (a tensor or None as it is)."""
    import numpy as np

    return torch.from_numpy(value.copy()) if isinstance(value, np.ndarray) else value


__all__ = ["as_tensor", "portable"]

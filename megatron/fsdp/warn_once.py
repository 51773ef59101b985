"""Warnings said once per process, by one rank: the one "warn once" state of the engine and its adapter.

A training loop calls ``fully_shard`` once per unit and may build several optimizers, and every rank
builds the same ones: a warning per call and per rank would repeat one sentence hundreds of times.
"""

from __future__ import annotations

import warnings
from typing import Optional, Set, Type

import torch

_said: Set[str] = set()


def warn_once(message: str, category: Type[Warning] = UserWarning, stacklevel: int = 1,
              key: Optional[str] = None) -> None:
    """``warnings.warn(message, category)`` the first time ``key`` (default: the message) is seen in this
    process, on rank 0 only when torch.distributed runs (every rank sees the same configuration).

    ``key`` names what is warned about when the sentence varies (an API called with different old
    keywords is one deprecation). ``stacklevel`` counts from the caller, as ``warnings.warn``'s does.
    """
    key = message if key is None else key
    if key in _said:
        return
    _said.add(key)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        warnings.warn(message, category, stacklevel=stacklevel + 1)

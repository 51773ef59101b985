"""Checks that must fail before the first collective, with a message that names the fix."""

from __future__ import annotations

import hashlib
from typing import List, Sequence, Tuple

import torch

from ..collectives.comm import CommAxis
from ..collectives.simulation import is_fake

Signature = Tuple[str, Tuple[int, ...], str, bool]


def module_signature(named_params: Sequence[Tuple[str, torch.nn.Parameter]]) -> List[Signature]:
    return [(name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in named_params]


def _digest(signature: List[Signature]) -> torch.Tensor:
    h = hashlib.sha256(repr(signature).encode()).digest()[:8]
    return torch.tensor([int.from_bytes(h, "little", signed=True)], dtype=torch.int64)


def _first_difference(mine: List[Signature], theirs: List[Signature]) -> str:
    for a, b in zip(mine, theirs):
        if a != b:
            fields = ("name", "shape", "dtype", "requires_grad")
            diff = ", ".join(f"{f} {x!r} vs {y!r}" for f, x, y in zip(fields, a, b) if x != y)
            return f"parameter {a[0]!r}: {diff}"
    if len(mine) != len(theirs):
        longer = mine if len(mine) > len(theirs) else theirs
        return f"parameter count {len(mine)} vs {len(theirs)} (first extra: {longer[min(len(mine), len(theirs))][0]!r})"
    return "identical"


def check_same_module_on_all_ranks(axis: CommAxis, signature: List[Signature], device: torch.device) -> None:
    """One small all-gather of a digest; only on a mismatch, gather the lists to name it.

    Every rank sees every digest, so all ranks take the same branch and raise
    the same error together: nobody is left waiting in a later collective.
    """
    if axis.size == 1:
        return
    mine = _digest(signature).to(device)
    digests = torch.empty(axis.size, dtype=torch.int64, device=device)
    axis.all_gather(digests, mine, tag="module digest").wait()  # a rank that never called fully_shard: timeout
    if is_fake(digests) or bool((digests == digests[0]).all()):
        return  # (simulated, every rank is this one: its digest is everyone's)
    everyone: List[List[Signature]] = axis.all_gather_object(signature, tag="module signature")
    bad = next(r for r in range(axis.size) if everyone[r] != everyone[0])
    raise ValueError(
        f"the module differs across data-parallel ranks (rank 0 vs rank {bad} of the group): "
        f"{_first_difference(everyone[0], everyone[bad])}; build the same model on every rank before fully_shard")

"""Full (unsharded) state of a wrapped model: ``full_state_dict``, ``load_full_state_dict``, ``broadcast_params``.

Apart from the DCP path (``checkpoint/state_dict.py``: per-rank pieces, any mesh at load time),
``full_state_dict`` and ``broadcast_params`` move whole buffers: every rank builds a unit's
full buffer in main dtype (summing the owners' pieces over each axis whose level shards
optimizer state), and after the broadcast a rank that holds the full buffer writes its own
ranges from it without further collectives. Loading full tensors takes the DCP load's
path: each rank cuts its owned pieces out of them and ``checkpoint.install_pieces``
writes them and rebuilds the compute weights, the one place loaded values reach storage.
"""

from __future__ import annotations

from typing import Dict

import torch

from ..sharding.buffers import UnitStorage
from .state_dict import install_pieces, owned_pieces


def gathered_main(s: UnitStorage) -> torch.Tensor:
    """The full buffer in main dtype: main weights where trainable, compute weights where frozen.

    Summed over each axis whose level shards optimizer state; there every
    trainable element has exactly one owner, and frozen elements are
    contributed by one rank unless the level also shards parameters.
    """
    flat = torch.zeros(s.layout.padded_size, dtype=s.main_dtype, device=s.full.device)
    axes = [(ax, lvl) for ax, lvl in ((s.inner, s.levels.inner), (s.outer, s.levels.outer))
            if lvl.shard_optim and ax.size > 1]
    if all(lvl.shard_params or ax.rank == 0 for ax, lvl in axes):
        f0, f1 = max(s.kept[0], s.layout.trainable_end), s.kept[1]
        if f0 < f1:
            flat[f0:f1].copy_(s.compute_slice(f0, f1))
    a, b = s.regions.main
    flat[a:b].copy_(s.main)
    for ax, _ in axes:
        ax.all_reduce(flat, tag="state_dict").wait()
    return flat


@torch.no_grad()
def load_flat(s: UnitStorage, flat: torch.Tensor) -> None:
    """Write a full main-dtype buffer that every rank of the unit holds (after ``broadcast_params``'
    broadcast) into this rank's main and compute storage (no collective)."""
    a, b = s.regions.main
    if not s.shares_main:
        s.main.copy_(flat[a:b])
    if s.releases:
        s.shard.copy_(flat[s.kept[0]:s.kept[1]])
    if s.resident:
        s.full.copy_(flat)


def broadcast_params(model) -> None:
    """Make replicas equal to rank 0 of every axis whose level keeps them replicated.

    A collective. Shards owned by one rank are already the single truth;
    only copies along axes that do not shard optimizer state can diverge.
    """
    model.wait_weights()
    for unit in model.units:
        s = unit.storage
        flat = gathered_main(s)
        changed = False
        for axis, level in ((s.inner, s.levels.inner), (s.outer, s.levels.outer)):
            if axis.size > 1 and not level.shard_optim:
                axis.broadcast(flat, tag="broadcast_params").wait()
                changed = True
        if changed:
            load_flat(s, flat)
            if s.fp8 is not None:  # the same weights quantized again (compute weights are their dequantization)
                s.install_main_weights(tag="broadcast_params").wait()


def full_state_dict(model) -> Dict[str, torch.Tensor]:
    """Full tensors by parameter name, then the module's buffers as they are (a collective)."""
    model.wait_weights()
    out: Dict[str, torch.Tensor] = {}
    for unit in model.units:
        s = unit.storage
        flat = gathered_main(s)
        for name, slot in zip(unit.param_names, s.layout.slots):
            out[name] = flat[slot.start:slot.end].view(slot.spec.shape).clone()
    for name, buf in model.module.named_buffers():
        out[name] = buf.detach().clone()
    return out


def load_full_state_dict(model, state_dict: Dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load full tensors (as produced by ``full_state_dict``); every rank takes its own piece."""
    names = [n for unit in model.units for n in unit.param_names]
    missing = [n for n in names if n not in state_dict]
    buffers = dict(model.module.named_buffers())
    unexpected = [k for k in state_dict if k not in names and k not in buffers]
    if strict and (missing or unexpected):
        raise KeyError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    pieces = {}
    for unit in model.units:  # every check before anything is written
        for p in owned_pieces(unit):
            if p.name in state_dict:
                value = state_dict[p.name].detach()
                if tuple(value.shape) != p.shape:
                    raise ValueError(f"{p.name}: shape {tuple(value.shape)} in the state dict, {p.shape} in the model")
                pieces[p.name] = value.reshape(-1)[p.param_lo:p.param_lo + p.b - p.a]
    install_pieces(model, pieces)
    with torch.no_grad():
        for name, buf in buffers.items():
            if name in state_dict:
                buf.copy_(state_dict[name])

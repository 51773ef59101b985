"""Checkpoint entries of the matrix optimizer: main weights and momentum per matrix, in logical coordinates.

The same scheme as the elementwise optimizer (``checkpoint/state_dict.py``): ``main.<param>``
and ``state.<param>.momentum_buffer`` (one entry per parameter, also for a
grouped-GEMM weight that holds one matrix per expert) are DTensors of the parameter's global
shape holding this rank's piece, so DCP reshards them to any world size, level
or mesh; ``matrix_groups.0.<hyperparameter>`` holds the matrix optimizer's
hyperparameters. The momentum exists from the start (zeros are exactly the
state ``torch.optim.Muon`` creates on its first step). Another per-matrix
optimizer (``matrix_whole.py``) saves ``state.<matrix>.<key>`` for each state
tensor, held whole by the matrix's owner.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Mapping, Tuple

import torch

from ..checkpoint.state_dict import _qualified, _shape_of, agreed, check_against, install_pieces
from ..checkpoint.pieces import local_piece, sharded_piece
from ..checkpoint.staging import staged_copy

def _entries(optimizer):
    """``(key, entry)`` of every matrix checkpoint tensor on this rank (a grouped parameter is one entry)."""
    for e in optimizer.matrix.checkpoint_entries():
        key = _qualified(optimizer, e.model, e.name)
        yield (f"main.{key}" if e.state is None else f"state.{key}.{e.state}"), e


def matrix_keys(optimizer) -> Dict[str, Any]:
    """Every key of the matrix entries with its expected shape (``None``: not a tensor)."""
    keys: Dict[str, Any] = {key: e.shape for key, e in _entries(optimizer)}
    for hp, value in optimizer.matrix.param_groups[0].items():
        if hp != "params":
            keys[f"matrix_groups.0.{hp}"] = _shape_of(value)
    return keys


def matrix_state_dict(optimizer) -> Dict[str, Any]:
    """Copies of this rank's pieces (collective-free)."""
    out: Dict[str, Any] = {}
    with torch.no_grad():
        for key, e in _entries(optimizer):
            out[key] = sharded_piece(staged_copy(e.tensor.reshape(-1)), e.shape, e.offset)
    for hp, value in optimizer.matrix.param_groups[0].items():
        if hp != "params":
            out[f"matrix_groups.0.{hp}"] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
    return out


def split_state_dict(optimizer, state_dict: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(elementwise entries, matrix entries)`` of a full optimizer state dict."""
    mine = set(matrix_keys(optimizer))
    matrix = {k: v for k, v in state_dict.items() if k in mine or k.startswith("matrix_groups.")}
    return {k: v for k, v in state_dict.items() if k not in matrix}, matrix


def check_matrix_state_dict(optimizer, state_dict: Mapping[str, Any]) -> List[tuple]:
    """Validate every matrix entry on every rank before anything is written; the writes to make."""
    def check():
        check_against("optimizer load_state_dict (matrix optimizer)", state_dict, matrix_keys(optimizer))
        writes = []
        for key, e in _entries(optimizer):
            writes.append((e.tensor, local_piece(state_dict[key], e.offset, e.offset + e.tensor.numel(), key)))
        return writes
    return agreed(optimizer.models, check)


@torch.no_grad()
def write_matrix_state(optimizer, state_dict: Mapping[str, Any], writes: List[tuple]) -> None:
    """Write the validated pieces and hyperparameters, then rebuild compute weights (a collective)."""
    for target, piece in writes:
        target.copy_(piece.view_as(target))
    group = optimizer.matrix.param_groups[0]
    for hp in [hp for hp in group if hp != "params"]:
        value = state_dict[f"matrix_groups.0.{hp}"]
        group[hp] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
    for model in optimizer.models:
        install_pieces(model, {})

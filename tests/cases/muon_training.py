"""Muon + AdamW: one unsharded process (torch.optim.Muon on the matrices) against the sharded engine.

The matrices are the trainable 2-D parameters of the blocks (the engine's
default rule: non-root units); everything else (embedding, positions, norms,
biases) is stepped by AdamW. Both sides clip by one global norm over all of them.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

import megatron.fsdp as mfsdp
from megatron.fsdp.testing.engine_training import GLOBAL_MICRO_BATCH, OPTIMIZERS, RunConfig, build_model, reference_training, train_step, wrap
from megatron.fsdp.testing.models import make_batches


MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5)
# A second per-matrix optimizer (factored second moment: needs whole rows and columns), run whole
# on each matrix's owner (megatron/fsdp/optim/matrix_whole.py).
ADAFACTOR = dict(lr=0.02, weight_decay=0.1)
# Megatron-LM's Muon as the adapter builds it: one Newton-Schulz coefficient triple per iteration (quintic).
MEGATRON_MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True, ns_steps=5, extra_scale_factor=0.2,
                     coefficient_type="quintic")


def _muon_class(matrix: str):
    """The Muon class and its arguments for ``matrix`` "muon" (torch's) or "megatron" (the adapter's)."""
    if matrix == "megatron":
        from megatron.fsdp.mcore.muon import MegatronMuon

        return MegatronMuon, MEGATRON_MUON
    return torch.optim.Muon, MUON


def is_matrix(name: str, param) -> bool:
    return param.requires_grad and param.dim() == 2 and name.startswith("blocks.")


def grouped_blocks(name: str, param) -> Optional[Tuple[int, int]]:
    """Grouped-GEMM-like weights, two "experts" each, split as Megatron's GroupedMLP views them:
    ``mlp.up`` [2 F, h] as ``view(2, F, h)`` (like weight2), ``mlp.down`` [h, 2 F] as
    ``view(2, h, F)`` (like weight1: blocks of the storage, not column slices)."""
    rows, cols = param.shape
    if name.endswith("mlp.up.weight"):
        return rows // 2, cols
    if name.endswith("mlp.down.weight"):
        return rows, cols // 2
    return None


class BlockMuon:
    """The unsharded reference for split matrices: ``torch.optim.Muon`` on each block of a parameter's
    storage as its own leaf (sharing the storage, so Muon's in-place update lands in the parameter)."""

    def __init__(self, named: List[Tuple[str, torch.nn.Parameter]], split, cls=torch.optim.Muon, **muon):
        self.originals = [p for _, p in named]
        self.blocks = []  # (original, block shape or None, index, leaf)
        for name, p in named:
            block = split(name, p) if split is not None else None
            if block is None:
                self.blocks.append((p, None, 0, p))
                continue
            views = p.detach().view(-1, *block)
            self.blocks += [(p, block, k, torch.nn.Parameter(views[k])) for k in range(views.shape[0])]
        self.muon = cls([leaf for *_, leaf in self.blocks], **muon)

    def step(self):
        for p, block, k, leaf in self.blocks:
            if block is not None:
                leaf.grad = p.grad.view(-1, *block)[k]
        self.muon.step()

    def zero_grad(self):
        for p in self.originals:
            p.grad = None
        for *_, leaf in self.blocks:
            leaf.grad = None


def muon_reference(cfg: RunConfig, muon: Optional[dict] = None, split=None, matrix: str = "muon") -> Dict[str, object]:
    model = build_model(cfg)
    cls, kwargs = OPTIMIZERS["adamw"]
    matrices = [(n, p) for n, p in model.named_parameters() if is_matrix(n, p)]
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.requires_grad and not is_matrix(n, p):
            (no_decay if mfsdp.megatron_no_weight_decay(n, p) else decay).append(p)
    adamw = cls([{"params": decay, "weight_decay": kwargs["weight_decay"]},
                 {"params": no_decay, "weight_decay": 0.0}], **kwargs)
    if matrix == "adafactor":
        return reference_training(model, cfg, [torch.optim.Adafactor([p for _, p in matrices], **ADAFACTOR), adamw])
    cls, default = _muon_class(matrix)
    return reference_training(model, cfg, [BlockMuon(matrices, split, cls, **(muon or default)), adamw])


def muon_wrap(ctx, cfg: RunConfig, muon: Optional[dict] = None, split=None, matrix: str = "muon"):
    fsdp, _ = wrap(ctx, cfg)
    cls, kwargs = OPTIMIZERS["adamw"]
    matrix_cls, matrix_kwargs = (torch.optim.Adafactor, ADAFACTOR) if matrix == "adafactor" else _muon_class(matrix)
    matrix_kwargs = muon or matrix_kwargs
    opt = mfsdp.FullyShardedOptimizer(fsdp, cls, clip_grad=cfg.clip_grad, matrix_optimizer=matrix_cls,
                                      matrix_kwargs=matrix_kwargs, matrix_split=split, **kwargs)
    return fsdp, opt


def muon_run(ctx, cfg: RunConfig, muon: Optional[dict] = None, grouped: bool = False,
             matrix: str = "muon") -> Dict[str, object]:
    """Worker side: losses, norms, full parameters (rank 0), per-step matrix traffic and step counts
    (``grouped``: the MLP weights split per "expert", ``grouped_blocks``; ``matrix``: "muon", "megatron" or
    "adafactor")."""
    fsdp, opt = muon_wrap(ctx, cfg, muon, grouped_blocks if grouped else None, matrix)
    losses: List[float] = []
    norms: List[float] = []
    wire: List[int] = []
    calls: List[int] = []
    for step in make_batches(cfg.steps, cfg.micro_batches, GLOBAL_MICRO_BATCH):
        fsdp.ledger.reset()
        loss, norm = train_step(ctx, fsdp, opt, step, cfg)
        wire.append(fsdp.ledger.wire_bytes("all_to_all"))
        calls.append(fsdp.ledger.calls("all_to_all"))
        losses.append(loss)
        norms.append(norm)
    matrix = opt.matrix
    params = fsdp.full_state_dict()  # a collective
    return {
        "losses": losses, "grad_norms": norms,
        "params": params if ctx.rank == 0 else None,
        "wire": wire, "calls": calls, "steps": dict(matrix.steps),
        "matrix_bytes": _matrix_bf16_bytes(matrix),
        "matrix_units": len(matrix.units),
        "planned": _planned_bf16_bytes(matrix),
    }


def _matrix_bf16_bytes(matrix) -> Dict[str, int]:
    """Per section, the bf16 bytes of every matrix (the theory the ledger's all-to-all bytes are held to)."""
    out: Dict[str, int] = {}
    for mu in matrix.units:
        out[mu.storage.section] = out.get(mu.storage.section, 0) + 2 * sum(m.numel for m in mu.matrices)
    return out


def _planned_bf16_bytes(matrix) -> int:
    """What this rank should send per step over one-stage exchanges: its pieces of the matrices others
    own, and all but its own piece of each matrix it owns (bf16, both directions)."""
    total = 0
    for mu in matrix.units:
        if len(mu.stages) != 1:
            continue
        for m, (a, b) in zip(mu.matrices, mu.pieces):
            total += (m.numel - (b - a)) if m.owner == mu.me else (b - a)
    return 2 * total


def replace(cfg: RunConfig, **kw) -> RunConfig:
    return dataclasses.replace(cfg, **kw)

"""``--optimizer muon`` for chunks wrapped by ``FullyShardedDataParallel``: Megatron-LM's flags on the engine.

Megatron-Core 0.16.1's own Muon (``TensorParallelMuon``) subclasses
``emerging_optimizers``' ``OrthogonalizedOptimizer``; that package cannot be
installed for Python 3.11 here, and Megatron-Core refuses Muon with its
distributed optimizer anyway. This module maps Megatron-LM's flags onto
``torch.optim.Muon`` semantics run by the engine (``megatron/fsdp/optim/matrix_optimizer.py``):

* which parameters: Megatron's rule, trainable 2-D parameters that are not the
  embedding or output layer (``is_embedding_or_output_parameter``); AdamW (Megatron's
  Adam config) steps the rest;
* ``--muon-momentum``, ``--muon-nesterov`` (``--muon-use-nesterov``), ``--muon-num-ns-steps``: torch's
  ``momentum``, ``nesterov``, ``ns_steps`` (the same EMA momentum and Nesterov blend);
* ``--muon-scale-mode`` x ``--muon-extra-scale-factor``: the update scale, as
  ``adjusted_lr`` of ``MegatronMuon`` below (``spectral`` with factor 0.2 is torch's
  ``match_rms_adamw``, ``shape_scaling`` with factor 1 is torch's ``original``);
* grouped-GEMM experts (``--moe-grouped-gemm``, legacy ``GroupedMLP``): each expert's
  block of ``weight1``/``weight2`` is its own matrix (``grouped_gemm_split``);
* ``--muon-tp-mode``: ``blockwise`` (each TP shard is its own matrix) or ``duplicated``
  (the owner gathers the TP shards along ``partition_dim``, orthogonalises the whole
  matrix, keeps its shard; the scale sees the whole shape);
* ``--muon-coefficient-type``: the Newton-Schulz coefficients, one triple per iteration
  (``megatron/fsdp/optim/newton_schulz.py``; Megatron-LM's default ``"quintic"``, ``"simple"`` is
  torch's fixed triple) in torch's bf16 arithmetic.

``--muon-split-qkv`` is not reproduced (docs/muon.md).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from megatron.fsdp.collectives.comm import CommAxis
from megatron.fsdp.optim.matrix_optimizer import TensorShards
from megatron.fsdp.optim.newton_schulz import newton_schulz, per_step_coefficients

from megatron.fsdp import mcore_releases as compat

SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")
TP_MODES = ("blockwise", "duplicated")


def muon_scale(mode: str, rows: int, cols: int) -> float:
    """Megatron's (emerging_optimizers') update scale for a ``rows x cols`` matrix."""
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    raise ValueError(f"--muon-scale-mode {mode!r}: expected one of {', '.join(SCALE_MODES)}")


@dataclasses.dataclass(frozen=True)
class MuonScale:
    """The update scale: ``extra_factor * muon_scale(mode, rows, cols)`` (``--muon-scale-mode``,
    ``--muon-extra-scale-factor``)."""

    mode: str = "spectral"
    extra_factor: float = 1.0

    def __post_init__(self):
        muon_scale(self.mode, 1, 1)  # validates the mode
        object.__setattr__(self, "extra_factor", float(self.extra_factor))


class MegatronMuon(torch.optim.Muon):
    """``torch.optim.Muon`` whose step size is ``lr * scale.extra_factor * muon_scale(scale.mode, shape)`` and
    whose Newton-Schulz iterations take ``coefficient_type``'s triples (one per iteration)."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.9,
                 nesterov: bool = False, ns_steps: int = 5, scale: MuonScale = MuonScale(),
                 coefficient_type: str = "quintic"):
        scale_mode, extra_scale_factor = scale.mode, scale.extra_factor
        if ns_steps < 1:
            raise ValueError(f"--muon-num-ns-steps must be at least 1, got {ns_steps}")
        super().__init__(params, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                         ns_steps=ns_steps, ns_coefficients=per_step_coefficients(coefficient_type, ns_steps))
        self.defaults.update(scale_mode=scale_mode, extra_scale_factor=extra_scale_factor)
        for group in self.param_groups:
            group.setdefault("scale_mode", scale_mode)
            group.setdefault("extra_scale_factor", extra_scale_factor)

    @staticmethod
    def adjusted_lr(group, shape) -> float:
        lr = group["lr"]
        lr = lr.item() if isinstance(lr, torch.Tensor) else lr
        return lr * group["extra_scale_factor"] * muon_scale(group["scale_mode"], shape[0], shape[1])

    @torch.no_grad()
    def step(self, closure=None):
        """The unsharded step (torch's, with this class's step size); the engine runs its sharded form."""
        for group in self.param_groups:
            lr = group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-self.adjusted_lr(group, p.shape))
        return None


def megatron_matrix_params(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's Muon rule: trainable 2-D parameters except the embedding and the output layer."""
    return param.requires_grad and param.dim() == 2 and not getattr(param, "is_embedding_or_output_parameter", False)


def grouped_gemm_split(modules):
    """``PerMatrixOptimizer.split`` for the engine: legacy ``GroupedMLP`` weights hold one matrix per local expert.

    Its forward views ``weight1`` [hidden, experts x ffn'] as ``(experts, hidden, ffn')`` and
    ``weight2`` [experts x ffn, hidden] as ``(experts, ffn, hidden)``: each expert's matrix is a
    consecutive block of the storage, stepped as its own matrix. With SwiGLU an expert's fc1 block
    keeps gate and up together (``[hidden, 2 ffn]``), as Megatron-Core's Muon treats every fc1
    (it splits only QKV, under ``--muon-split-qkv``). ``TEGroupedMLP``/``SequentialMLP`` already
    have one parameter per expert. ``None`` when no module is a ``GroupedMLP`` (always from Megatron-Core
    0.17.0, which has none).
    """
    GroupedMLP = compat.legacy_grouped_mlp_class()
    if GroupedMLP is None:
        return None
    experts = {}
    for module in modules:
        for prefix, m in module.named_modules():
            if isinstance(m, GroupedMLP):
                for w in ("weight1", "weight2"):
                    experts[f"{prefix}.{w}" if prefix else w] = m.num_local_experts
    if not experts:
        return None

    def split(name: str, param):
        count = experts.get(name)
        if count is None or count == 1:
            return None
        rows, cols = param.shape
        return (rows, cols // count) if name.endswith("weight1") else (rows // count, cols)
    return split


def muon_kwargs(config) -> dict:
    return dict(lr=config.lr, weight_decay=config.weight_decay, momentum=config.muon_momentum,
                nesterov=compat.muon_nesterov(config), ns_steps=config.muon_num_ns_steps,
                scale=MuonScale(config.muon_scale_mode, config.muon_extra_scale_factor),
                coefficient_type=compat.muon_coefficient_type(config))


def tensor_parallel_shards(mode: str, ledger, tp_group, expert_tp_group):
    """``PerMatrixOptimizer.shards`` for the engine: ``None`` (blockwise) or the TP shards of each matrix (duplicated)."""
    if mode not in TP_MODES:
        raise ValueError(f"--muon-tp-mode {mode!r} is not supported by megatron.fsdp; use one of {', '.join(TP_MODES)}")
    if mode == "blockwise":
        return None
    axes = {False: CommAxis("tp", tp_group, ledger), True: CommAxis("expert_tp", expert_tp_group, ledger)}

    def shards(name: str, param) -> Optional[TensorShards]:
        dim = getattr(param, "partition_dim", -1)
        if not getattr(param, "tensor_model_parallel", False) or dim not in (0, 1):
            return None
        expert = not getattr(param, "allreduce", True)  # Megatron marks expert parameters allreduce=False
        return TensorShards(axes[expert], dim)
    return shards

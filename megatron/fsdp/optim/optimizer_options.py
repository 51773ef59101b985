"""``FullyShardedOptimizer``'s options, one value per concern: the gradient norm, the per-matrix
optimizer (Muon) and the labelled parameter groups (``OptimizerPrecision`` is the state's dtypes).

Values, not behaviour: the optimizer reads them once at construction.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional, Sequence

import torch

ParamRule = Callable[[str, torch.nn.Parameter], object]  # (name, parameter) -> a decision about it


@dataclasses.dataclass(frozen=True)
class GradNorm:
    """What the global gradient norm counts and over which process groups it is summed.

    ``counts_in_norm(name, param)`` says whether a parameter's gradient counts on this rank
    (default: all); ``groups`` are further process groups the squared norm is summed over (e.g.
    tensor and pipeline model-parallel groups, whose ranks hold different parameters), and
    ``expert_groups`` the same for the expert section (default: ``groups``).
    """

    counts_in_norm: Optional[ParamRule] = None
    groups: Sequence = ()
    expert_groups: Optional[Sequence] = None

    def __post_init__(self):
        object.__setattr__(self, "groups", tuple(self.groups))
        if self.expert_groups is not None:
            object.__setattr__(self, "expert_groups", tuple(self.expert_groups))


@dataclasses.dataclass(frozen=True)
class PerMatrixOptimizer:
    """A per-matrix optimizer (Muon, or another) for the parameters ``params(name, param)`` selects
    (default: trainable 2-D parameters outside the root unit), each matrix stepped on one owner rank
    (docs/muon.md).

    ``optimizer`` is the ``torch.optim.Optimizer`` class and ``kwargs`` its keyword arguments;
    ``split(name, param)`` may return the ``(rows, cols)`` of the consecutive row-major matrices one
    parameter's storage holds (grouped-GEMM expert weights: one matrix per expert); ``shards`` the
    tensor-parallel shards of a matrix (Muon's ``duplicated`` mode).
    """

    optimizer: Callable
    kwargs: Mapping[str, object] = dataclasses.field(default_factory=dict)
    params: Optional[ParamRule] = None
    shards: Optional[Callable] = None
    split: Optional[ParamRule] = None

    def __post_init__(self):
        object.__setattr__(self, "kwargs", dict(self.kwargs or {}))  # a copy: later edits of the caller's dict do not leak in


@dataclasses.dataclass(frozen=True)
class LabelledGroups:
    """Parameter groups of their own with their own hyperparameters.

    ``label(name, param)`` puts a parameter in a labelled group (``""`` or ``None``: the default
    group) and ``options`` give each label its hyperparameters (e.g. ``{"decoupled": {"lr": 5e-4}}``:
    Megatron-LM's ``--decoupled-lr`` for the embedding and output layer).
    """

    label: Optional[ParamRule] = None
    options: Mapping[str, Mapping[str, object]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        options = {name: dict(values) for name, values in dict(self.options or {}).items()}
        if "" in options:
            raise ValueError("LabelledGroups.options: the label '' is the default group (its options are "
                             "FullyShardedOptimizer's keyword arguments)")
        object.__setattr__(self, "options", options)

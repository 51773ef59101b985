"""Expert parameters: their own data-parallel mesh, their own levels, their own gradient scale.

In a mixture-of-experts model with expert parallelism, each expert lives on a
few ranks only, so its replicas form a smaller data-parallel group than the
dense layers' (``world / (EP x expert TP x PP)`` instead of ``world / (TP x PP)``).
The two sections also want different levels: experts are large and each is
touched by few tokens, dense layers are small and hot. ``fully_shard`` therefore
splits every unit into a dense section and an expert section; the expert
section has its own flat buffers on ``mesh`` with ``strategy`` /
``outer_strategy``, and everything else (state machine, prefetch, reduction
overlap) is shared.

Gradient semantics: the token dispatcher already sums each expert's gradient
over the expert-parallel ranks whose tokens it processed, so averaging over the
expert data-parallel group alone would over-weight them. ``average_grads=False``
with ``grad_scale = 1 / dense data-parallel size`` gives exactly the gradient of
the unsharded model (Megatron-Core's own rule); ``grad_scale`` is applied once
per step, after the reductions.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from ..collectives.comm import CommAxis
from .mesh import DataParallelMesh
from .strategy import MeshStrategy


@dataclasses.dataclass(frozen=True)
class ExpertSharding:
    """Which parameters are experts, and how their section is sharded.

    ``strategy``/``outer_strategy`` default to the dense levels; ``average_grads``
    defaults to the dense setting. In the global gradient norm each section is
    summed over its own axes (and its own model-parallel groups) exactly once.
    """

    is_expert: Callable[[str, torch.nn.Parameter], bool]
    mesh: DataParallelMesh
    strategy: Optional[str] = None
    outer_strategy: Optional[str] = None
    average_grads: Optional[bool] = None
    grad_scale: float = 1.0

    def __post_init__(self):
        if not callable(self.is_expert):
            raise TypeError("ExpertSharding.is_expert must be a callable (name, param) -> bool")
        if not isinstance(self.mesh, DataParallelMesh):
            raise TypeError(f"ExpertSharding.mesh must be a megatron.fsdp.DataParallelMesh, got {type(self.mesh).__name__}")
        if not self.grad_scale > 0.0:
            raise ValueError(f"ExpertSharding.grad_scale must be positive, got {self.grad_scale}")


DENSE, EXPERT = "dense", "expert"


@dataclasses.dataclass(frozen=True, eq=False)
class Section:
    """The axes, levels and gradient rule shared by every storage of one section."""

    name: str
    inner: CommAxis
    outer: CommAxis
    levels: MeshStrategy
    average_grads: bool
    grad_scale: float

"""``FullyShardedOptimizer``: any elementwise torch optimizer over the local fp32 shards.

The inner optimizer sees a few long flat tensors (one run per unit and weight
decay class), not one tensor per parameter, so its per-tensor overhead does not
grow with the parameter count. Gradient norm and clipping use the true global
norm: every gradient element is owned by exactly one rank of each axis whose
level shards optimizer state (or by every rank of an axis that does not, where
it is counted once) and is counted once.

One optimizer may drive several wrapped models that share a mesh (the model
chunks of virtual pipeline parallelism).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..checkpoint.state_dict import load_optimizer_state_dict, optimizer_state_dict
from ..collectives.comm import CommAxis, collective
from ..collectives.simulation import is_fake
from ..sharding.experts import EXPERT
from .matrix_checkpoint import check_matrix_state_dict, matrix_state_dict, split_state_dict, write_matrix_state
from .matrix_whole import make_matrix_optimizer
from ..wrap.build import checked_option
from ..wrap.module import FullyShardedModule
from ..precision.optimizer_state import OptimizerPrecision, attach_grad, detach_grad
from .optimizer_options import GradNorm, LabelledGroups, PerMatrixOptimizer

Models = Union[FullyShardedModule, Sequence[FullyShardedModule]]
MATRIX = "matrix"  # the decay-class flag of matrix parameters: kept out of the elementwise optimizer


def _real_groups(groups: Sequence) -> list:
    return [g for g in groups if g is not None and dist.get_world_size(g) > 1]


def _mesh_key(model: FullyShardedModule):
    return [(name, s.levels, s.inner.size, s.outer.size) for name, s in model.sections.items()]


class FullyShardedOptimizer:
    """Wraps ``optimizer_cls`` over the main-weight shards of ``models``.

    ``clip_grad`` clips the global gradient norm; ``grad_norm=GradNorm(counts_in_norm, groups,
    expert_groups)`` says which gradients count in it on this rank and over which further process
    groups it is summed (``optimizer_options.py``).

    ``matrix=PerMatrixOptimizer(optimizer, kwargs, params, shards, split)`` (Muon, or another
    per-matrix optimizer) steps the parameters ``params(name, param)`` selects, each matrix on one
    owner rank (docs/muon.md).

    ``precision=OptimizerPrecision(exp_avg_dtype, exp_avg_sq_dtype, main_grads_dtype)`` other than
    fp32 keeps Adam/AdamW state or gradients in bf16 and updates in fp32
    (``precision/optimizer_state.py``); the default runs ``optimizer_cls`` unchanged.

    ``labelled_groups=LabelledGroups(label, options)``: ``label(name, param)`` may put a parameter in a
    labelled group of its own and ``options`` give each label its hyperparameters (e.g.
    ``{"decoupled": {"lr": 5e-4}}``: Megatron-LM's ``--decoupled-lr`` for the embedding and output
    layer); ``""`` is the default group. The inner optimizer's groups are the default's (decay, no
    decay) then each label's in ``options`` order, the same on every rank (empty ones kept);
    ``group_labels[g]`` says the ``(label, no_weight_decay)`` of group ``g``. Their hyperparameters are
    checkpointed per group like the default ones.
    """

    def __init__(self, models: Models, optimizer_cls: Callable = torch.optim.AdamW, clip_grad: float = 0.0,
                 no_weight_decay: Optional[Callable] = None, grad_norm: Optional[GradNorm] = None,
                 matrix: Optional[PerMatrixOptimizer] = None, precision: Optional[OptimizerPrecision] = None,
                 labelled_groups: Optional[LabelledGroups] = None, **optimizer_kwargs):
        grad_norm = checked_option(grad_norm, GradNorm, "grad_norm") or GradNorm()
        matrix = checked_option(matrix, PerMatrixOptimizer, "matrix")
        precision = checked_option(precision, OptimizerPrecision, "precision") or OptimizerPrecision()
        labelled_groups = checked_option(labelled_groups, LabelledGroups, "labelled_groups") or LabelledGroups()
        self.models: List[FullyShardedModule] = [models] if isinstance(models, FullyShardedModule) else list(models)
        if not self.models or not all(isinstance(m, FullyShardedModule) for m in self.models):
            raise TypeError("FullyShardedOptimizer needs the model(s) returned by megatron.fsdp.fully_shard")
        first = self.models[0]
        for m in self.models[1:]:
            if _mesh_key(m) != _mesh_key(first):
                raise ValueError("all models of one FullyShardedOptimizer must share the same meshes and levels")
        self.model = first
        self.precision = precision
        main_dtype = first.mixed_precision.main_dtype
        optimizer_cls = self.precision.optimizer_class(optimizer_cls, main_dtype)
        for model in self.models:
            for unit in model.units:
                unit.storage.set_main_grads_dtype(self.precision.main_grads_dtype or main_dtype)
        self.clip_grad = float(clip_grad)
        self.norm_groups = _real_groups(grad_norm.groups)
        self.expert_norm_groups = (self.norm_groups if grad_norm.expert_groups is None
                                   else _real_groups(grad_norm.expert_groups))
        # The model-parallel groups the squared norm is also summed over, as ledger axes.
        self._norm_axes = {section: [CommAxis(f"{section}_norm_group{k}", group, first.ledger)
                                     for k, group in enumerate(self.expert_norm_groups if section == EXPERT
                                                               else self.norm_groups)]
                           for section in first.sections}
        # Given expert norm groups but no expert section here (a pipeline stage of dense layers only,
        # DeepSeek's first layers): this rank still joins the expert norm's sums over those groups,
        # with nothing to add, or the stages that hold experts would wait for it.
        self._absent_expert_axes = [] if grad_norm.expert_groups is None or EXPERT in first.sections else [
            CommAxis(f"{EXPERT}_norm_group{k}", group, first.ledger) for k, group in enumerate(self.expert_norm_groups)]
        weight_decay = optimizer_kwargs.get("weight_decay", 0.0)
        group_options = labelled_groups.options
        labels = [""] + list(group_options)
        groups = {MATRIX: []}
        groups.update({(label, nwd): [] for label in labels for nwd in (False, True)})
        self._grads: List[torch.Tensor] = []
        # (optimizer tensor, its gradient view): attached by ``finish_grad_sync`` (after the
        # models' own ``finish_grad_sync`` has allocated every accumulator), detached when
        # ``zero_grad`` releases them.
        self._grad_of: List[tuple] = []
        self._grads_attached = False
        self._norm_grads: Dict[str, List[torch.Tensor]] = {name: [] for name in first.sections}
        self._norm_weights: Dict[str, List[torch.Tensor]] = {name: [] for name in first.sections}
        # Matrix parameters (Muon): stepped by matrix_optimizer.py, outside the elementwise runs.
        self.matrix = None if matrix is None else make_matrix_optimizer(
            self.models, matrix.optimizer, matrix.kwargs, matrix.params, matrix.shards, matrix.split)
        for k, model in enumerate(self.models):
            for unit in model.units:
                s = unit.storage
                flags = [MATRIX if self.matrix is not None and self.matrix.is_matrix(k, name)
                         else (self._label(labelled_groups.label, slot.spec, labels),
                               self._no_decay(no_weight_decay, slot.spec))
                         for name, slot in zip(unit.param_names, s.layout.slots)]
                lo, hi = s.regions.main
                for a, b, key in s.layout.runs(lo, hi, flags):  # key: (label, no decay) or MATRIX
                    weight = s.main[a - lo:b - lo]
                    grad = s.grad_slice(a - lo, b - lo)
                    self._grad_of.append((weight, grad))
                    groups[key].append(weight)
                    self._grads.append(grad)
                    if grad_norm.counts_in_norm is None:
                        self._norm_grads[s.section].append(grad)
                        self._norm_weights[s.section].append(weight)
                if grad_norm.counts_in_norm is not None:
                    for name, slot, param in zip(unit.param_names, s.layout.slots, s.params):
                        if slot.spec.trainable and grad_norm.counts_in_norm(name, param):
                            piece = model.main_grad_piece(name)
                            if piece.numel():
                                self._norm_grads[s.section].append(piece)
                                self._norm_weights[s.section].append(model.main_weight_piece(name))
        device = first.units[0].storage.full.device if first.units else torch.device("cpu")
        param_groups = []
        self.group_labels = [(label, nwd) for label in labels for nwd in (False, True)]
        for label, nwd in self.group_labels:
            params = groups[label, nwd]
            if not params:  # keep the same groups on every rank, even one that owns nothing
                empty = torch.zeros(0, device=device)
                empty.grad = torch.zeros(0, device=device)
                params = [empty]
            options = dict(group_options.get(label, {}))
            decay = options.pop("weight_decay", weight_decay)
            param_groups.append({"params": params, **options, "weight_decay": 0.0 if nwd else decay})
        self.optimizer = optimizer_cls(param_groups, **optimizer_kwargs)

    @staticmethod
    def _label(rule: Optional[Callable], spec, labels: List[str]) -> str:
        """The labelled group of one parameter ("" without a rule); the rule sees what ``_no_decay``'s sees."""
        if rule is None:
            return ""
        label = rule(spec.name, torch.nn.Parameter(torch.empty(spec.shape, device="meta"), spec.trainable)) or ""
        if label not in labels:
            raise ValueError(f"LabelledGroups.label put {spec.name} in group {label!r}, which "
                             "LabelledGroups.options does not define")
        return label

    @staticmethod
    def _no_decay(rule: Optional[Callable], spec) -> bool:
        """The decay class of one parameter; a custom rule sees a meta tensor of the true shape
        (a ZeRO-3 parameter is an empty placeholder between uses)."""
        if rule is None:
            return spec.no_weight_decay
        return bool(rule(spec.name, torch.nn.Parameter(torch.empty(spec.shape, device="meta"), spec.trainable)))

    @property
    def norm_grads(self) -> Dict[str, List[torch.Tensor]]:
        """Per section, the gradient pieces that count in the global norm on this rank."""
        return self._norm_grads

    @property
    def param_groups(self):
        """The elementwise optimizer's groups, then the matrix optimizer's one (an LR scheduler edits both)."""
        return self.optimizer.param_groups + (self.matrix.param_groups if self.matrix is not None else [])

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self, main_weights: bool = True) -> Dict[str, object]:
        """Main weights and optimizer state per parameter, for ``torch.distributed.checkpoint`` (see checkpoint/state_dict.py)."""
        out = optimizer_state_dict(self, main_weights)
        if self.matrix is not None:
            out.update(matrix_state_dict(self))
        return out

    def load_state_dict(self, state_dict) -> None:
        """Load a ``state_dict()`` filled by ``dcp.load`` at any world size, level or mesh (a collective)."""
        if self.matrix is None:
            load_optimizer_state_dict(self, state_dict)
            return
        elementwise, matrix = split_state_dict(self, state_dict)
        writes = check_matrix_state_dict(self, matrix)  # every check before anything is written
        load_optimizer_state_dict(self, elementwise)
        write_matrix_state(self, matrix, writes)

    def state_bytes(self) -> int:
        matrix = self.matrix.state_bytes() if self.matrix is not None else 0
        return matrix + sum(v.untyped_storage().nbytes() for st in self.optimizer.state.values()
                            for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)

    def reduce_over_section(self, value: torch.Tensor, section: str) -> torch.Tensor:
        """Sum a per-rank statistic of one section's gradients over every rank holding a distinct part.

        That is the section's axes whose level shards optimizer state (replicas
        along the other axes hold identical gradients and must not be counted
        twice) and its model-parallel groups.
        """
        s = self.model.sections[section]
        if s.levels.inner.shard_optim:
            s.inner.all_reduce(value, tag="grad_norm").wait()
        if s.levels.outer.shard_optim:
            s.outer.all_reduce(value, tag="grad_norm").wait()
        for axis in self._norm_axes[section]:
            axis.all_reduce(value, tag="grad_norm").wait()
        return value

    def _attach_grads(self) -> None:
        """Point every optimizer tensor's gradient at its accumulator view (once per step).

        The accumulators exist by now: each model's ``finish_grad_sync`` allocates the
        ones no gradient reached (zeros), the one place that rule lives (``runtime.py``).
        """
        if not self._grads_attached:
            for weight, grad in self._grad_of:
                attach_grad(weight, grad)
            self._grads_attached = True

    def _require_synced_grads(self, call: str) -> None:
        """``call`` reads the reduced gradients: refuse before ``finish_grad_sync`` instead of
        reading unreduced or released accumulators."""
        if not self._grads_attached:
            raise RuntimeError(f"FullyShardedOptimizer.{call}() needs the reduced gradients: call "
                               "finish_grad_sync() first (step() does)")

    def grad_norm(self) -> float:
        """Global L2 norm of the gradients: every element of every section counted exactly once."""
        self._require_synced_grads("grad_norm")
        return self._global_norm(self._norm_grads)

    @torch.no_grad()
    def params_norm(self) -> float:
        """Global L2 norm of the fp32 main weights, each element counted once as in ``grad_norm``
        (Megatron-LM's ``--log-params-norm``)."""
        return self._global_norm(self._norm_weights)

    def _global_norm(self, pieces: Dict[str, List[torch.Tensor]]) -> float:
        """sqrt of the squares of ``pieces`` (per section) summed over every rank holding a distinct part.

        Simulated (fake tensors) the same collectives run and the norm is NaN: there are no values to sum."""
        sums = []
        for section, tensors in pieces.items():
            device = self._grads[0].device if self._grads else torch.device("cpu")
            sq = torch.zeros(1, dtype=torch.float32, device=device)
            if tensors:
                sq += torch.stack([t.float().pow(2).sum() for t in tensors]).sum()
            sums.append(self.reduce_over_section(sq, section))
        if self._absent_expert_axes:
            sq = torch.zeros(1, dtype=torch.float32, device=self._grads[0].device if self._grads else "cpu")
            for axis in self._absent_expert_axes:
                axis.all_reduce(sq, tag="grad_norm").wait()
            sums.append(sq)
        if any(is_fake(t) for t in sums):
            return math.nan
        return math.sqrt(sum(float(t.item()) for t in sums))

    def finish_grad_sync(self) -> None:
        """Complete every gradient reduction of this step; raise if no backward ran."""
        for model in self.models:
            if model.backwards_since_step == 0:
                raise RuntimeError("optimizer.step() called without a backward pass since the last step; "
                                   "run loss.backward() on the wrapped model first")
        for model in self.models:
            model.finish_grad_sync()
        self._attach_grads()

    def clip_grads(self, norm: float) -> None:
        self._require_synced_grads("clip_grads")
        if self.clip_grad > 0.0 and math.isfinite(norm):
            coef = self.clip_grad / (norm + 1.0e-6)
            if coef < 1.0:
                torch._foreach_mul_(self._grads, coef)

    @torch.no_grad()
    def step_with_ready_grads(self) -> None:
        """Update the shards and install the new weights (gathers overlap the next forward)."""
        self._require_synced_grads("step_with_ready_grads")
        if self.matrix is None:
            self.optimizer.step()
        else:  # the elementwise step runs while the first unit's matrix pieces travel
            self.matrix.step(overlap_with=self.optimizer.step)
        for model in self.models:
            model.install_updated_weights()

    @torch.no_grad()
    @collective("optimizer.step")
    def step(self) -> float:
        """Finish gradient sync, clip, update the shards, install the new weights.

        Returns the global gradient norm before clipping.
        """
        self.finish_grad_sync()
        norm = self.grad_norm()
        self.clip_grads(norm)
        self.step_with_ready_grads()
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients. ``set_to_none`` (the default, as torch optimizers and FSDP2):
        release the flat gradient accumulators until the next backward's first reduction
        allocates them zeroed, so between steps a rank keeps weights and optimizer state only;
        ``False``: zero them in place and keep them."""
        if set_to_none:
            for weight, _ in self._grad_of:
                detach_grad(weight)
            self._grads_attached = False
        for model in self.models:
            model.zero_grad_buffers(set_to_none)

"""Any per-matrix optimizer on fully-sharded state: each matrix stepped whole, on its owner.

``torch.optim.Muon`` splits into an elementwise part (its momentum, kept sharded)
and a matrix part (Newton-Schulz) and runs here in that split form
(``matrix_optimizer.py``). Another optimizer that needs whole matrices (Adafactor's
factored second moment, Shampoo-, SOAP-like preconditioners) is a black box: its
owner (``matrix_plan.py``, the same owners and exchange stages as Muon) receives
the other ranks' pieces of the fp32 main weights and gradients, steps the whole
matrix with the optimizer class, and sends the pieces of the new weights back.

The contract for such a class (docs/muon.md):

* it is a ``torch.optim.Optimizer`` over 2-D parameters, constructed once per rank
  with ``matrix_kwargs`` over that rank's owned matrices (plus a placeholder that
  never has a gradient; its one param group is the live hyperparameters, which an
  LR scheduler may edit between steps);
* ``step()`` is called once per optimizer step, on every rank (a rank that owns no
  matrix steps only the placeholder), after every owned matrix was handed its
  whole fp32 weights as the parameter's data and its whole (reduced, clipped)
  gradient as ``.grad``; the parameter objects stay the same between steps;
* its state is ``state[param]``: a dict of tensors per parameter (``step`` counters
  included), which the checkpoint saves as ``state.<matrix>.<key>`` held whole by
  the owner and reshards to any other owner; keys and shapes must follow from the
  matrix's shape (a matrix not stepped yet gets them from one probe step on zeros,
  zero-filled, which is the state torch's optimizers create on a first step);
* no collectives, no tensor-parallel gathering (``matrix_shards`` needs Muon).

Traffic per step: fp32 weights and gradients toward the owner, fp32 weights back,
one all-to-all-v per unit, direction and stage, as for Muon (3x its bf16 bytes: 8 + 4 bytes per element).
Memory: each owner keeps its owned matrices whole (weights, gradients, state):
about ``1/N`` of the matrices per rank.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from .matrix_optimizer import CheckpointEntry, MatrixOptimizer, _MatrixUnit


class WholeMatrixOptimizer(MatrixOptimizer):
    """``matrix_cls`` (any per-matrix ``torch.optim.Optimizer``) on whole matrices; see the module docstring."""

    keeps_momentum = False

    def __init__(self, models, matrix_cls: Callable, matrix_kwargs: Optional[dict] = None,
                 matrix_params: Optional[Callable] = None, matrix_shards: Optional[Callable] = None,
                 matrix_split: Optional[Callable] = None):
        super().__init__(models, matrix_cls, matrix_kwargs, matrix_params, matrix_shards, matrix_split)
        if any(mu.shards for mu in self.units):
            raise ValueError(f"PerMatrixOptimizer.shards (duplicated tensor parallelism) needs torch.optim.Muon; "
                             f"{matrix_cls.__name__} steps each tensor-parallel shard as its own matrix")
        self.whole: Dict[Tuple[int, int], torch.nn.Parameter] = {}  # (unit index, matrix index) -> owned matrix
        for u, mu in enumerate(self.units):
            for j, m in enumerate(mu.matrices):
                if m.owner == mu.me:
                    self.whole[(u, j)] = torch.nn.Parameter(
                        torch.zeros(m.shape, dtype=mu.storage.main_dtype, device=mu.storage.main.device))
        self.hyper = matrix_cls([self._placeholder] + list(self.whole.values()), **self.kwargs)

    @staticmethod
    def _check_class(matrix_cls) -> None:
        if not (isinstance(matrix_cls, type) and issubclass(matrix_cls, torch.optim.Optimizer)):
            raise TypeError(f"PerMatrixOptimizer.optimizer must be a torch.optim.Optimizer class, got {matrix_cls!r}")

    @property
    def _placeholder(self) -> torch.nn.Parameter:
        return self.hyper.param_groups[0]["params"][0]

    def state_bytes(self) -> int:
        tensors = [t for st in self.hyper.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        return sum(t.untyped_storage().nbytes() for t in tensors + list(self.whole.values()))

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, overlap_with: Optional[Callable[[], None]] = None) -> None:
        """Gather every owned matrix (the next unit's pieces travel while one is unpacked), one
        ``step()``, then send the new weights back (two units in flight)."""
        pending = self._gather(self.units[0]) if self.units else None
        if overlap_with is not None:
            overlap_with()
        for u, mu in enumerate(self.units):
            held = pending()
            pending = self._gather(self.units[u + 1]) if u + 1 < len(self.units) else None
            for j, m in enumerate(mu.matrices):
                whole = self.whole.get((u, j))
                if whole is not None:
                    pair = held[j].view(*m.shape, 2)
                    whole.copy_(pair[..., 0])
                    whole.grad = pair[..., 1].clone()
        self.hyper.step()
        finishing: List[Tuple[_MatrixUnit, Dict[int, torch.Tensor], Callable[[], None]]] = []
        for u, mu in enumerate(self.units):
            held = {}
            for j, m in enumerate(mu.matrices):
                whole = self.whole.get((u, j))
                if whole is not None:
                    held[j] = whole.detach().reshape(-1).clone()
                    whole.grad = None
                    self.steps[m.name] += 1
            finishing.append((mu, held, self._from_owner(mu, held, dtype=mu.storage.main_dtype)))
            if len(finishing) > 2:
                self._install(*finishing.pop(0))
        for item in finishing:
            self._install(*item)

    def _gather(self, mu: _MatrixUnit) -> Callable[[], Dict[int, torch.Tensor]]:
        """Start moving this rank's (weight, gradient) pieces, interleaved per element, toward the owners."""
        held = {j: torch.stack([p, g], dim=1).reshape(-1) for j, (p, g) in enumerate(zip(mu.params, mu.grads))}
        return self._exchange_toward(mu, held, width=2, dtype=mu.storage.main_dtype)

    @staticmethod
    def _install(mu: _MatrixUnit, held: Dict[int, torch.Tensor], finish: Callable[[], None]) -> None:
        finish()
        for j, param in enumerate(mu.params):
            param.copy_(held[j])

    # ------------------------------------------------------------ checkpoints
    def checkpoint_entries(self) -> List[CheckpointEntry]:
        """Main-weight pieces per parameter; each matrix's state tensors, whole on its owner and empty
        elsewhere (every rank lists every key: DCP and the key check see one state dict layout)."""
        out = []
        for mu in self.units:
            for piece in mu.by_param:
                out.append(CheckpointEntry(mu.model, piece.name, None, piece.shape, piece.offset, piece.main))
        for u, mu in enumerate(self.units):
            for j, m in enumerate(mu.matrices):
                whole = self.whole.get((u, j))
                state = self._state_of(whole) if whole is not None else self._probe(m.shape)
                for key, value in sorted(state.items()):
                    if isinstance(value, torch.Tensor):  # a 0-d tensor (a step counter) is saved as shape (1,)
                        local = value if whole is not None else value.new_empty(0)
                        out.append(CheckpointEntry(mu.model, m.name, key, tuple(value.shape) or (1,), 0, local))
        return out

    def _state_of(self, whole: torch.nn.Parameter) -> dict:
        """The optimizer's state of ``whole``; before its first step, the probe's, zeroed."""
        state = self.hyper.state[whole]
        if not state:
            state.update(self._probe(tuple(whole.shape)))
        return state

    def _probe(self, shape: Tuple[int, int]) -> dict:
        """Zeroed state of one step of the optimizer on a zero matrix of ``shape`` (keys, shapes, dtypes)."""
        cache = self.__dict__.setdefault("_probes", {})
        if shape not in cache:
            main = self.units[0].storage.main if self.units else torch.zeros(0)
            probe = torch.nn.Parameter(main.new_zeros(shape))
            probe.grad = main.new_zeros(shape)
            group = self.hyper.param_groups[0]
            trial = self.cls([probe], **{k: v for k, v in group.items() if k in self.hyper.defaults})
            trial.step()
            cache[shape] = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
                            for k, v in trial.state[probe].items()}
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in cache[shape].items()}


def make_matrix_optimizer(models, matrix_cls: Callable, *args, **kwargs) -> MatrixOptimizer:
    """Muon (and subclasses) in its split, sharded-momentum form; any other class whole on the owners."""
    if isinstance(matrix_cls, type) and issubclass(matrix_cls, torch.optim.Muon):
        return MatrixOptimizer(models, matrix_cls, *args, **kwargs)
    return WholeMatrixOptimizer(models, matrix_cls, *args, **kwargs)

"""Muon on fully-sharded state: the elementwise part on this rank's pieces, the matrix part on one owner.

Why: ``torch.optim.Muon``'s momentum and update are elementwise, so they run on each rank's flat
pieces like any optimizer state; only Newton-Schulz needs the whole matrix, so its owner
(``matrix_plan.py``) receives the other pieces of ``bf16(U)`` (exact: torch casts to bf16 first), and
sends the pieces of ``O`` back, one all-to-all-v per unit and direction, the next unit's in flight
while the owner computes. Other per-matrix optimizers run whole on the owners (``matrix_whole.py``).
The algorithm, the contract for a Muon subclass (``adjusted_lr``, per-iteration ``ns_coefficients``)
and tensor-parallel ``duplicated`` mode (``TensorShards``): docs/muon.md.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.optim._muon import _adjust_lr

from ..collectives.comm import CommAxis, Handle
from .newton_schulz import newton_schulz
from .matrix_plan import MatrixSlot, Stage, exchange_stages, matrix_blocks, matrix_slots, overlap, owner_set


@dataclasses.dataclass(frozen=True, eq=False)
class TensorShards:
    """A parameter that is shard ``axis.rank`` of ``axis.size`` of a larger matrix, concatenated along ``dim``."""

    axis: CommAxis
    dim: int


def default_matrix_params(name: str, param: torch.nn.Parameter, in_root: bool) -> bool:
    """Megatron's rule: trainable 2-D weights outside the root unit (not embeddings, not the output layer)."""
    return param.requires_grad and param.dim() == 2 and not in_root


def _view_param(spec, original: torch.nn.Parameter) -> torch.nn.Parameter:
    """A meta parameter of the true shape carrying the original's attributes (under ZeRO-3 the real
    one is an empty placeholder between uses)."""
    meta = torch.nn.Parameter(torch.empty(spec.shape, device="meta"), spec.trainable)
    meta.__dict__.update(getattr(original, "__dict__", {}))
    return meta


MOMENTUM = "momentum_buffer"


@dataclasses.dataclass(frozen=True, eq=False)
class CheckpointEntry:
    """One checkpoint tensor of this rank: flat elements ``[offset, offset + tensor.numel())`` of a
    tensor of ``shape``, the main weights (``state`` None) or state ``state`` of parameter ``name``."""

    model: int
    name: str
    state: Optional[str]
    shape: Tuple[int, ...]
    offset: int
    tensor: torch.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class ParamPiece:
    """This rank's piece of one matrix parameter (all its matrices): main weights and momentum views."""

    name: str
    slot: int
    shape: Tuple[int, ...]
    offset: int  # of the piece in the flattened parameter
    main: torch.Tensor
    momentum: torch.Tensor


class _MatrixUnit:
    """One unit's matrices on this rank: pieces of main weights, gradients and momentum; exchange stages."""

    def __init__(self, model: int, unit, matrices: List[MatrixSlot], owners, shards: Dict[int, TensorShards],
                 momentum: bool = True):
        s = unit.storage
        self.model, self.unit, self.storage, self.matrices = model, unit, s, matrices
        self.tag = f"matrix:{unit.name}"
        self.axes = {"inner": s.inner, "outer": s.outer}
        self.stages: Tuple[Stage, ...] = exchange_stages(s.layout, s.levels, s.inner.rank, s.outer.size)
        self.owners = owners
        self.me = owners.index(s.inner.rank, s.outer.rank)
        self.shards = shards  # matrix index -> TensorShards (duplicated tensor parallelism)
        m0, m1 = s.regions.main
        self.pieces = [overlap((m0, m1), m.start, m.end) for m in matrices]
        total = sum(b - a for a, b in self.pieces)
        self.momentum = torch.zeros(total if momentum else 0, dtype=s.main_dtype, device=s.main.device)
        self.bufs, self.params, self.grads = [], [], []
        offset = 0
        self.by_param: List[ParamPiece] = []  # per parameter (several matrices of a grouped one share it)
        for j, (a, b) in enumerate(self.pieces):
            self.bufs.append(self.momentum[offset:offset + b - a] if momentum else None)
            self.params.append(s.main[a - m0:b - m0])
            self.grads.append(s.grad_slice(a - m0, b - m0))
            m = matrices[j]
            if not self.by_param or self.by_param[-1].slot != m.slot:
                slot = s.layout.slots[m.slot]
                lo, hi = overlap((m0, m1), slot.start, slot.end)
                self.by_param.append(ParamPiece(m.param, m.slot, tuple(slot.spec.shape), lo - slot.start,
                                                s.main[lo - m0:hi - m0],
                                                self.momentum[offset:offset + hi - lo] if momentum else None))
            offset += b - a

    def coordinate(self, m: MatrixSlot, axis: str) -> int:
        inner, outer = self.owners.coordinates(m.owner)
        return inner if axis == "inner" else outer

    def active(self, stage: Stage) -> List[int]:
        if not stage.outer_owner_only:
            return list(range(len(self.matrices)))
        mine = self.storage.outer.rank
        return [j for j, m in enumerate(self.matrices) if self.coordinate(m, "outer") == mine]

    def full_shape(self, j: int) -> Tuple[int, int]:
        shape = list(self.matrices[j].shape)
        spec = self.shards.get(j)
        if spec is not None:
            shape[spec.dim] *= spec.axis.size
        return tuple(shape)


class MatrixOptimizer:
    """Steps the selected matrices of ``models`` with ``matrix_cls`` semantics; see the module docstring.

    This class runs ``torch.optim.Muon`` (and subclasses) with its momentum sharded;
    ``matrix_whole.WholeMatrixOptimizer`` runs any other per-matrix optimizer on whole
    matrices on their owners (``make_matrix_optimizer`` picks).
    """

    keeps_momentum = True  # sharded momentum_buffer per matrix (Muon's elementwise part)

    def __init__(self, models: Sequence, matrix_cls: Callable, matrix_kwargs: Optional[dict] = None,
                 matrix_params: Optional[Callable] = None, matrix_shards: Optional[Callable] = None,
                 matrix_split: Optional[Callable] = None):
        self._check_class(matrix_cls)
        self.cls = matrix_cls
        self.kwargs = dict(matrix_kwargs or {})
        placeholder = torch.nn.Parameter(torch.zeros(1, 1))
        # The constructor validates the hyperparameters; its one param group is the live copy
        # (an LR scheduler edits it); the placeholder is never stepped.
        self.hyper = matrix_cls([placeholder], **self.kwargs)
        if len(self.hyper.param_groups) != 1:
            raise ValueError("the matrix optimizer takes one param group")
        self.steps = collections.Counter()  # matrix name -> Newton-Schulz runs on this rank
        self.units: List[_MatrixUnit] = []
        self.names = set()  # (model index, parameter name) of every matrix
        by_section: Dict[str, list] = collections.OrderedDict()
        for k, model in enumerate(models):
            root = model.root_unit
            for unit in model.units:
                s = unit.storage
                chosen = []
                for name, slot, p in zip(unit.param_names, s.layout.slots, s.params):
                    view = _view_param(slot.spec, p)
                    pick = default_matrix_params(name, view, unit is root) if matrix_params is None \
                        else bool(matrix_params(name, view))
                    if pick and (len(slot.spec.shape) != 2 or not slot.spec.trainable):
                        what = "frozen" if slot.spec.trainable is False else f"{len(slot.spec.shape)}-D"
                        raise ValueError(
                            f"PerMatrixOptimizer.params selected {name!r} of shape {tuple(slot.spec.shape)}, a {what} "
                            "parameter; the matrix optimizer steps trainable 2-D parameters only: make the "
                            "selector return False for it (the elementwise optimizer then steps it)")
                    block = None if not pick or matrix_split is None else matrix_split(name, view)
                    chosen.append(matrix_blocks(name, slot.spec.shape, block) if pick else None)
                by_section.setdefault(s.section, []).append((k, unit, chosen))
        for section, entries in by_section.items():
            s0 = entries[0][1].storage
            owners = owner_set(s0.levels, s0.inner.size, s0.outer.size)
            slots = matrix_slots([(k, u.index, u.storage.layout, u.param_names) for k, u, _ in entries],
                                 [c for _, _, c in entries], owners)
            for k, unit, _ in entries:
                mine = [m for m in slots if m.model == k and m.unit == unit.index]
                if not mine:
                    continue
                shards = {}
                if matrix_shards is not None:
                    for j, m in enumerate(mine):
                        spec = matrix_shards(m.name, _view_param(unit.storage.layout.slots[m.slot].spec,
                                                                  unit.storage.params[m.slot]))
                        if spec is not None and spec.axis.size > 1:
                            shards[j] = spec
                self.units.append(_MatrixUnit(k, unit, mine, owners, shards, self.keeps_momentum))
                self.names.update((k, m.param) for m in mine)

    @staticmethod
    def _check_class(matrix_cls) -> None:
        if not (isinstance(matrix_cls, type) and issubclass(matrix_cls, torch.optim.Muon)):
            raise TypeError(f"MatrixOptimizer runs torch.optim.Muon or a subclass of it, got {matrix_cls!r}; "
                            "use make_matrix_optimizer for other per-matrix optimizers")

    # ---------------------------------------------------------------- queries
    @property
    def param_groups(self) -> List[dict]:
        return self.hyper.param_groups

    def is_matrix(self, model: int, name: str) -> bool:
        return (model, name) in self.names

    def state_bytes(self) -> int:
        return sum(mu.momentum.untyped_storage().nbytes() for mu in self.units)

    def checkpoint_entries(self) -> List["CheckpointEntry"]:
        """This rank's pieces for the checkpoint: main weights and momentum, per parameter."""
        out = []
        for mu in self.units:
            for piece in mu.by_param:
                out.append(CheckpointEntry(mu.model, piece.name, None, piece.shape, piece.offset, piece.main))
                out.append(CheckpointEntry(mu.model, piece.name, MOMENTUM, piece.shape, piece.offset,
                                           piece.momentum))
        return out

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, overlap_with: Optional[Callable[[], None]] = None) -> None:
        """One Muon step of every matrix; ``overlap_with`` (the elementwise optimizer's step) runs while
        the first unit's pieces travel."""
        group = self.hyper.param_groups[0]
        pending = self._toward_owner(self.units[0], group) if self.units else None
        if overlap_with is not None:
            overlap_with()
        back: collections.deque = collections.deque()
        for i, mu in enumerate(self.units):
            held = pending()
            pending = self._toward_owner(self.units[i + 1], group) if i + 1 < len(self.units) else None
            self._orthogonalise(mu, held, group)
            back.append((mu, held, self._from_owner(mu, held)))
            while len(back) > 2:
                self._apply(*back.popleft(), group)
        while back:
            self._apply(*back.popleft(), group)

    def _toward_owner(self, mu: _MatrixUnit, group) -> Callable[[], Dict[int, torch.Tensor]]:
        """Momentum update on this rank's pieces; start moving ``bf16(U)`` toward the owners.

        Returns a function that completes the exchange and gives the held pieces
        (the whole matrix for the ones this rank owns).
        """
        momentum, nesterov = group["momentum"], group["nesterov"]
        held: Dict[int, torch.Tensor] = {}
        for j, (g, buf) in enumerate(zip(mu.grads, mu.bufs)):
            buf.lerp_(g, 1 - momentum)
            update = g.lerp(buf, momentum) if nesterov else buf
            held[j] = update.bfloat16()
        return self._exchange_toward(mu, held)

    def _exchange_toward(self, mu: _MatrixUnit, held: Dict[int, torch.Tensor], width: int = 1,
                         dtype: torch.dtype = torch.bfloat16) -> Callable[[], Dict[int, torch.Tensor]]:
        """Start moving ``held`` (this rank's pieces) toward the owners; the function completes it."""
        stages = list(mu.stages)
        first = self._stage_toward(mu, stages[0], held, width, dtype) if stages else Handle()

        def finish() -> Dict[int, torch.Tensor]:
            first.wait()
            for stage in stages[1:]:
                self._stage_toward(mu, stage, held, width, dtype).wait()
            return held
        return finish

    def _stage_toward(self, mu: _MatrixUnit, stage: Stage, held: Dict[int, torch.Tensor], width: int = 1,
                      dtype: torch.dtype = torch.bfloat16) -> Handle:
        """One stage toward the owners; ``held[j]``: ``width`` values per element of matrix ``j``'s piece."""
        axis = mu.axes[stage.axis]
        me = axis.rank
        active = mu.active(stage)
        dest = {j: mu.coordinate(mu.matrices[j], stage.axis) for j in active}
        send_parts, in_splits = [], []
        for k in range(axis.size):
            parts = [held[j] for j in active if dest[j] == k]
            send_parts += parts
            in_splits.append(sum(p.numel() for p in parts))
        mine = [j for j in active if dest[j] == me]
        lengths = [[width * _length(overlap(stage.ranges[k], mu.matrices[j].start, mu.matrices[j].end)) for j in mine]
                   for k in range(axis.size)]
        out_splits = [sum(row) for row in lengths]
        send = _cat(send_parts, held, dtype)
        out = torch.empty(sum(out_splits), dtype=dtype, device=send.device)

        def unpack():
            chunks = {j: [] for j in mine}
            offset = 0
            for k in range(axis.size):
                for j, n in zip(mine, lengths[k]):
                    chunks[j].append(out[offset:offset + n])
                    offset += n
            for j in active:
                held.pop(j, None)
            for j in mine:
                held[j] = torch.cat(chunks[j])
        return Handle(axis.all_to_all(out, send, out_splits, in_splits, mu.tag), then=unpack)

    def _stage_back(self, mu: _MatrixUnit, stage: Stage, held: Dict[int, torch.Tensor], width: int = 1,
                    dtype: torch.dtype = torch.bfloat16) -> Handle:
        axis = mu.axes[stage.axis]
        me = axis.rank
        active = mu.active(stage)
        dest = {j: mu.coordinate(mu.matrices[j], stage.axis) for j in active}
        mine = [j for j in active if dest[j] == me]
        union = (stage.ranges[0][0], stage.ranges[-1][1])
        send_parts, in_splits = [], []
        for k in range(axis.size):
            n = 0
            for j in mine:
                m = mu.matrices[j]
                base = overlap(union, m.start, m.end)[0]
                a, b = overlap(stage.ranges[k], m.start, m.end)
                send_parts.append(held[j][width * (a - base):width * (b - base)])
                n += width * (b - a)
            in_splits.append(n)
        recv = [(j, width * _length(overlap(stage.ranges[me], mu.matrices[j].start, mu.matrices[j].end)))
                for j in active]
        out_splits = [sum(n for j, n in recv if dest[j] == k) for k in range(axis.size)]
        send = _cat(send_parts, held, dtype)
        out = torch.empty(sum(out_splits), dtype=dtype, device=send.device)

        def unpack():
            offset = 0
            for k in range(axis.size):
                for j, n in recv:
                    if dest[j] == k:
                        held[j] = out[offset:offset + n]
                        offset += n
        return Handle(axis.all_to_all(out, send, out_splits, in_splits, mu.tag), then=unpack)

    def _orthogonalise(self, mu: _MatrixUnit, held: Dict[int, torch.Tensor], group) -> None:
        """Newton-Schulz on every matrix this rank owns (whole: duplicated TP shards gathered first)."""
        owned = [j for j, m in enumerate(mu.matrices) if m.owner == mu.me]
        gathered = self._gather_shards(mu, owned, held)
        for j in owned:
            m = mu.matrices[j]
            matrix = gathered.get(j, held[j].view(m.shape))
            result = newton_schulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])
            spec = mu.shards.get(j)
            if spec is not None:
                result = result.chunk(spec.axis.size, dim=spec.dim)[spec.axis.rank]
            held[j] = result.contiguous().view(-1)
            self.steps[m.name] += 1

    def _gather_shards(self, mu: _MatrixUnit, owned: List[int], held) -> Dict[int, torch.Tensor]:
        """Duplicated tensor parallelism: one all-gather per unit and axis of the owned shards."""
        out: Dict[int, torch.Tensor] = {}
        by_axis: Dict[int, List[int]] = collections.OrderedDict()
        for j in owned:
            if j in mu.shards:
                by_axis.setdefault(id(mu.shards[j].axis), []).append(j)
        for js in by_axis.values():
            axis = mu.shards[js[0]].axis
            local = torch.cat([held[j] for j in js])
            full = torch.empty(axis.size * local.numel(), dtype=local.dtype, device=local.device)
            axis.all_gather(full, local, tag=mu.tag).wait()
            rows = full.view(axis.size, local.numel())
            offset = 0
            for j in js:
                m = mu.matrices[j]
                parts = [rows[r, offset:offset + m.numel].view(m.shape) for r in range(axis.size)]
                out[j] = torch.cat(parts, dim=mu.shards[j].dim)
                offset += m.numel
        return out

    def _from_owner(self, mu: _MatrixUnit, held: Dict[int, torch.Tensor], width: int = 1,
                    dtype: torch.dtype = torch.bfloat16) -> Callable[[], None]:
        """Start sending the owned results in ``held`` back; the function completes it (pieces in ``held``)."""
        stages = list(reversed(mu.stages))
        first = self._stage_back(mu, stages[0], held, width, dtype) if stages else Handle()

        def finish():
            first.wait()
            for stage in stages[1:]:
                self._stage_back(mu, stage, held, width, dtype).wait()
        return finish

    def _apply(self, mu: _MatrixUnit, held: Dict[int, torch.Tensor], finish: Callable[[], None], group) -> None:
        """Decoupled weight decay and the orthogonalised update, on this rank's pieces."""
        finish()
        lr, wd = group["lr"], group["weight_decay"]
        lr = lr.item() if isinstance(lr, torch.Tensor) else lr
        adjust = getattr(self.cls, "adjusted_lr", None)
        for j, param in enumerate(mu.params):
            shape = mu.full_shape(j)
            adjusted = adjust(group, shape) if adjust is not None else _adjust_lr(lr, group["adjust_lr_fn"], shape)
            param.mul_(1 - lr * wd)
            param.add_(held[j], alpha=-adjusted)


def _length(r) -> int:
    return r[1] - r[0]


def _cat(parts: List[torch.Tensor], held: Dict[int, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if parts:
        return torch.cat(parts)
    some = next(iter(held.values()), None)
    return torch.empty(0, dtype=dtype, device=some.device if some is not None else "cpu")

"""Checkpoint state dicts in logical per-parameter coordinates, for ``torch.distributed.checkpoint``.

Why per parameter: a flat buffer's layout (parameter order, alignment gaps,
padding, shard boundaries) depends on the level, the mesh and the number of
ranks. A checkpoint keyed by parameter name, with each value a tensor of the
parameter's true global shape, depends on none of them, so DCP's resharding
loads it at any other world size, level or mesh: every rank asks for the
elements it owns now and DCP reads them from whichever files hold them.

How a rank's piece is described: ``checkpoint/pieces.py`` turns the contiguous
range of a flattened parameter a rank owns into DCP chunks of the parameter's
global shape. Every rank lists every key (an empty piece writes and reads
nothing), and replicas (ranks of an axis whose level does not shard optimizer
state) describe identical chunks, which DCP's planner writes once.

The state dicts hold copies, never views of live storage: ``dcp.load`` into
them cannot leave main weights and compute weights disagreeing (a resumed
model that trains on stale compute weights). ``load_model_state_dict`` and
``load_optimizer_state_dict`` validate everything first, then write the
pieces and rebuild the compute weights with the storages' own install path.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from ..sharding.buffers import UnitStorage
# Metadata validation lives in checkpoint/metadata.py; these names stay importable from here.
from .metadata import _shape_of, check_against, check_checkpoint_keys, mismatch_error  # noqa: F401
from .pieces import GlobalPlacement, local_piece, sharded_piece
from .staging import staged_copy, staged_piece, staged_zeros_piece
from ..schedule.unit import UnitState


# --------------------------------------------------------------------- ownership
@dataclasses.dataclass(frozen=True)
class OwnedPiece:
    """The part of one parameter a rank owns: buffer range ``[a, b)``, flat offset ``a - slot.start``."""

    name: str
    shape: Tuple[int, ...]
    trainable: bool
    a: int
    b: int
    slot_start: int

    @property
    def param_lo(self) -> int:
        return self.a - self.slot_start


def owned_range(s: UnitStorage) -> Tuple[int, int]:
    """The buffer range whose main weights (trainable) and checkpoint values (all) this rank owns.

    It is the finest range the levels shard optimizer state over; replicas
    along the other axes own the same range, and compute storage covers it.
    """
    return s.regions.owned


def owned_pieces(unit) -> Iterator[OwnedPiece]:
    """Every parameter of ``unit`` with this rank's piece of it (an empty one where it owns none).

    Every rank lists every key, so state dicts have the same keys on all ranks
    and an empty piece simply writes and reads nothing.
    """
    s = unit.storage
    lo, hi = owned_range(s)
    for name, slot in zip(unit.param_names, s.layout.slots):
        a, b = max(lo, slot.start), min(hi, slot.end)
        if a >= b:
            a = b = slot.start
        yield OwnedPiece(name, slot.spec.shape, slot.spec.trainable, a, b, slot.start)


def placement_of(model, name: str) -> Optional[GlobalPlacement]:
    """Where parameter ``name`` sits in a larger global tensor, if the wrapper said so.

    ``model.checkpoint_placements`` (``{name: GlobalPlacement}``) is set by a wrapper
    that knows more than the engine: the Megatron-Core adapter stores each
    tensor-parallel shard at its place in the TP-global weight. Without it every
    parameter is its own global tensor.
    """
    return (getattr(model, "checkpoint_placements", None) or {}).get(name)


def checkpoint_shape(model, name: str, shape: Tuple[int, ...]) -> Tuple[int, ...]:
    placement = placement_of(model, name)
    return placement.shape if placement is not None else tuple(shape)


def piece_values(s: UnitStorage, p: OwnedPiece) -> torch.Tensor:
    """The live tensor holding a piece: main weights when trainable, compute weights when frozen."""
    if p.trainable:
        m0 = s.regions.main[0]
        return s.main[p.a - m0:p.b - m0]
    return s.compute_slice(p.a, p.b)


def persistent_buffers(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Buffers ``nn.Module.state_dict`` would save (non-persistent ones are rebuilt by the model)."""
    out = {}
    for mname, m in module.named_modules():
        for bname, buf in m.named_buffers(recurse=False):
            if buf is not None and bname not in m._non_persistent_buffers_set:
                out[f"{mname}.{bname}" if mname else bname] = buf
    return out


# ------------------------------------------------------------------------ model
def model_state_dict(model) -> Dict[str, Any]:
    """``{parameter name: DTensor of its global shape in main dtype}`` plus persistent buffers (plain tensors).

    Trainable values come from the fp32 main weights, frozen ones from the
    compute weights. Collective-free; the values are copies.
    """
    model.wait_weights()
    out: Dict[str, Any] = {}
    with torch.no_grad():
        for unit in model.units:
            s = unit.storage
            for p in owned_pieces(unit):
                out[p.name] = staged_piece(piece_values(s, p), p.shape, p.param_lo, placement_of(model, p.name),
                                           s.main_dtype, stable=p.trainable)  # main weights: the step changes them
        for name, buf in persistent_buffers(model.module).items():
            out[name] = staged_copy(buf)
        for name, value in fp8_state(model).items():  # delayed scaling's amax histories: the same on every rank
            out[name] = staged_copy(value)
    return out


def fp8_state(model) -> Dict[str, torch.Tensor]:
    """The FP8 gathers' per-parameter state (delayed scaling: ``<name>._fp8_amax_history``, ``<name>._fp8_scale``)."""
    out: Dict[str, torch.Tensor] = {}
    for unit in model.units:
        if unit.storage.fp8 is not None:
            out.update(unit.storage.fp8.state())
    return out


def expected_model_keys(model) -> Dict[str, Optional[Tuple[int, ...]]]:
    keys = {name: checkpoint_shape(model, name, slot.spec.shape) for unit in model.units
            for name, slot in zip(unit.param_names, unit.storage.layout.slots)}
    keys.update({name: tuple(buf.shape) for name, buf in persistent_buffers(model.module).items()})
    keys.update({name: tuple(value.shape) for name, value in fp8_state(model).items()})
    return keys


def gather_pieces(model, state_dict: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """This rank's flat piece of every parameter present in ``state_dict``."""
    pieces = {}
    for unit in model.units:
        for p in owned_pieces(unit):
            if p.name in state_dict:
                pieces[p.name] = local_piece(state_dict[p.name], p.param_lo, p.param_lo + p.b - p.a, p.name,
                                             placement_of(model, p.name))
    return pieces


def agreed(models: Sequence[Any], check: Callable[[], Any]) -> Any:
    """Run ``check`` here, then make every rank raise if any rank's check failed.

    Loading ends in collectives (the install gathers); a rank that raised alone
    would leave its peers waiting in them forever. One tiny all-reduce per axis
    the install path uses (inner, then outer, of every section, in unit order)
    spreads a failure to the whole mesh before anything is modified.
    """
    error, result = None, None
    try:
        result = check()
    except (ValueError, RuntimeError) as exc:
        error = exc
    axes = {}
    for model in models:
        for unit in model.units:
            for axis in (unit.storage.inner, unit.storage.outer):
                axes.setdefault(id(axis), (axis, unit.storage.full.device))
    failed = torch.zeros(1)
    for axis, device in axes.values():
        if axis.size > 1:
            flag = failed.to(device) + float(error is not None)
            axis.all_reduce(flag, tag="load_check").wait()
            failed = flag.cpu()
    if error is not None:
        raise error
    if failed.item():
        raise ValueError("the state dict does not match the model on another rank (see the error raised there)")
    return result


@torch.no_grad()
def install_pieces(model, pieces: Mapping[str, torch.Tensor]) -> None:
    """Write owned pieces into main (trainable) or compute (frozen) storage, then rebuild compute weights.

    A collective over every storage's own axes (all ranks run the same units in
    the same order): ``install_main_weights`` casts main weights into compute
    storage and all-gathers what the level keeps beyond this rank's range.
    """
    model.wait_weights()
    for unit in model.units:
        s = unit.storage
        if s.releases and s.resident:
            if unit.state is not UnitState.IDLE:
                raise RuntimeError(f"FSDP unit {unit.name} is in use ({unit.state.value}); load between steps")
            s.reshard()  # the next use gathers the loaded shard
        for p in owned_pieces(unit):
            if p.name in pieces and p.b > p.a:
                piece_values(s, p).copy_(pieces[p.name])
        s.install_main_weights(tag="load").wait()


def load_model_state_dict(model, state_dict: Mapping[str, Any], strict: bool = True):
    """Load a state dict shaped like ``model_state_dict(model)`` (after ``dcp.load`` filled it).

    Plain full tensors are accepted too (each rank takes its piece). Every
    check runs before anything is written. ``strict=False`` keeps parameters
    and buffers missing from ``state_dict`` and ignores unexpected keys.
    """
    expected = expected_model_keys(model)

    def check():
        check_against("load_state_dict", state_dict, expected, strict)
        return gather_pieces(model, state_dict)
    pieces = agreed([model], check)
    buffers = persistent_buffers(model.module)
    for unit in model.units:  # before the install re-quantizes the loaded weights with it
        if unit.storage.fp8 is not None:
            unit.storage.fp8.load_state(state_dict)
    install_pieces(model, pieces)
    with torch.no_grad():
        for name, buf in buffers.items():
            if name in state_dict:
                buf.copy_(state_dict[name])
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


# -------------------------------------------------------------------- optimizer
@dataclasses.dataclass(frozen=True)
class Run:
    """One tensor of the inner torch optimizer: a view of buffer range ``[a, b)`` of ``unit``'s main weights.

    ``unit`` is None for the empty placeholder a rank that owns nothing of a
    group still steps (every rank keeps the same param groups).
    """

    group: int
    tensor: torch.Tensor
    model: int
    unit: Any
    a: int
    b: int


def optimizer_runs(optimizer) -> List[Run]:
    """Locate every tensor of the inner optimizer in the main weights it is a view of.

    Found by storage and offset rather than rebuilt from the decay rule, so whatever rule
    made the runs, the mapping from run elements to parameters is exact. (Not by address: a
    fake tensor, in a simulation, has none.)
    """
    homes = [(k, unit) for k, model in enumerate(optimizer.models) for unit in model.units
             if unit.storage.main.numel()]
    runs = []
    for g, group in enumerate(optimizer.optimizer.param_groups):
        for t in group["params"]:
            run = Run(g, t, -1, None, 0, 0)
            for k, unit in homes:
                m = unit.storage.main
                off = t.storage_offset() - m.storage_offset()
                if t.numel() and t.untyped_storage()._cdata == m.untyped_storage()._cdata \
                        and 0 <= off and off + t.numel() <= m.numel():
                    a = unit.storage.regions.main[0] + off
                    run = Run(g, t, k, unit, a, a + t.numel())
                    break
            if run.unit is None and t.numel():
                raise RuntimeError("an optimizer tensor is not a view of any unit's main weights")
            runs.append(run)
    return runs


def _probe_state(inner: torch.optim.Optimizer, g: int, like: torch.Tensor) -> Dict[str, Any]:
    """The state ``inner`` creates for a tensor, from one step of a copy of it on a scratch tensor.

    It describes (for ``dcp.load``) the state of an optimizer that has not
    stepped yet without stepping it: a warm-up step would advance its step counter.
    """
    accepted = inspect.signature(type(inner)).parameters
    hyper = {k: v for k, v in inner.param_groups[g].items() if k != "params"}
    scratch_param = torch.zeros(2, dtype=like.dtype, device=like.device, requires_grad=True)
    scratch_param.grad = torch.zeros_like(scratch_param)
    scratch = type(inner)([dict(params=[scratch_param], **hyper)],
                          **{k: v for k, v in inner.defaults.items() if k in accepted})
    scratch.step()
    return scratch.state[scratch_param]


def _is_shaped(value: Any, like: torch.Tensor) -> bool:
    """Elementwise state (exp_avg, momentum_buffer): a tensor shaped like the tensor it belongs to."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == like.shape


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    return x == y


@dataclasses.dataclass(frozen=True)
class OptimizerLayout:
    """What an optimizer state dict holds: elementwise keys (common to all tensors) and per-group scalars."""

    runs: Tuple[Run, ...]
    shaped: Tuple[Tuple[str, torch.dtype], ...]
    scalars: Tuple[Dict[str, Any], ...]
    initialized: bool


def optimizer_layout(optimizer) -> OptimizerLayout:
    inner = optimizer.optimizer
    runs = optimizer_runs(optimizer)
    stepped = [bool(inner.state.get(r.tensor)) for r in runs]
    if any(stepped) and not all(stepped):
        raise RuntimeError("some optimizer tensors have state and others none; step every tensor before saving")
    initialized = all(stepped)
    shaped: Optional[Dict[str, torch.dtype]] = None
    scalars: List[Dict[str, Any]] = [{} for _ in inner.param_groups]
    probes: Dict[int, Dict[str, Any]] = {}
    for r in runs:
        if initialized:
            state, like = inner.state[r.tensor], r.tensor
        else:
            if r.group not in probes:
                probes[r.group] = _probe_state(inner, r.group, r.tensor)
            state, like = probes[r.group], torch.zeros(2)
        keys = {k: v.dtype for k, v in state.items() if _is_shaped(v, like)}
        if shaped is not None and keys != shaped:
            raise RuntimeError(f"optimizer tensors keep different elementwise state: {sorted(keys)} vs {sorted(shaped)}")
        shaped = keys
        for key, value in state.items():
            if key in keys:
                continue
            known = scalars[r.group].setdefault(key, value)
            if initialized and not _same(known, value):
                raise RuntimeError(f"optimizer state {key!r} differs between tensors of param group {r.group}; "
                                   "it cannot be stored once per group")
    return OptimizerLayout(tuple(runs), tuple((shaped or {}).items()), tuple(scalars), initialized)


def _qualified(optimizer, k: int, name: str) -> str:
    """Parameter names of several model chunks (virtual pipeline) are told apart by chunk index."""
    return name if len(optimizer.models) == 1 else f"chunk{k}.{name}"


def _is_matrix(optimizer, k: int, name: str) -> bool:
    """Matrix parameters (Muon) keep their state in matrix_checkpoint.py, not in the elementwise optimizer."""
    matrix = getattr(optimizer, "matrix", None)
    return matrix is not None and matrix.is_matrix(k, name)


def _trainable_pieces(optimizer, layout: OptimizerLayout):
    """``(key name, piece, run, storage, placement)`` for every trainable parameter of every chunk;
    run None for an empty piece."""
    by_unit: Dict[int, List[Run]] = {}
    for r in layout.runs:
        if r.unit is not None:
            by_unit.setdefault(id(r.unit), []).append(r)
    for k, model in enumerate(optimizer.models):
        for unit in model.units:
            for p in owned_pieces(unit):
                if not p.trainable or _is_matrix(optimizer, k, p.name):
                    continue
                run = next((r for r in by_unit.get(id(unit), ()) if r.a <= p.a and p.b <= r.b), None)
                if run is None and p.b > p.a:
                    raise RuntimeError(f"{p.name}: owned elements outside every optimizer tensor")
                yield _qualified(optimizer, k, p.name), p, run, unit.storage, placement_of(model, p.name)


def optimizer_state_dict(optimizer, main_weights: bool = True) -> Dict[str, Any]:
    """Main weights and optimizer state per parameter, plus per-group hyperparameters and scalar state.

    Keys: ``main.<param>`` and ``state.<param>.<key>`` (DTensors of the
    parameter's shape), ``param_groups.<g>.<hyperparameter>``,
    ``param_groups.<g>.state.<key>`` (e.g. ``step``, one value per group: every
    tensor of a group steps together) and ``state_initialized`` (False before
    the first step: loading it leaves the optimizer to create its state lazily,
    exactly as a fresh one would). Collective-free; the values are copies, and every
    value a load reads back is a tensor (filled in place by ``dcp.load``), so a caller
    that restores its own pre-load copy of the dict, as Megatron-LM's and Bridge's
    ``fsdp_dtensor`` loads do, still holds what was loaded (the hyperparameters, not
    tensors, then come back as that copy has them: the loading run's own).
    ``main_weights=False`` leaves the ``main.<param>`` copies out (a save whose
    model state dict holds the same values).
    """
    for model in optimizer.models:
        model.wait_weights()
    layout = optimizer_layout(optimizer)
    inner = optimizer.optimizer
    out: Dict[str, Any] = {}
    with torch.no_grad():
        for key, p, run, s, placement in _trainable_pieces(optimizer, layout):
            if main_weights:
                out[f"main.{key}"] = sharded_piece(staged_copy(piece_values(s, p)), p.shape, p.param_lo, placement)
            for name, dtype in layout.shaped:
                if run is not None and layout.initialized:
                    value = staged_piece(inner.state[run.tensor][name][p.a - run.a:p.b - run.a], p.shape,
                                         p.param_lo, placement, stable=True)
                else:
                    value = staged_zeros_piece(p.b - p.a, dtype, s.main.device, p.shape, p.param_lo, placement)
                out[f"state.{key}.{name}"] = value
    for g, group in enumerate(inner.param_groups):
        for hp, value in group.items():
            if hp != "params":
                out[f"param_groups.{g}.{hp}"] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
        for name, value in layout.scalars[g].items():
            out[f"param_groups.{g}.state.{name}"] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
    out["state_initialized"] = torch.tensor(layout.initialized)
    return out


def _expected_optimizer_keys(optimizer, layout: OptimizerLayout) -> Dict[str, Optional[Tuple[int, ...]]]:
    keys: Dict[str, Optional[Tuple[int, ...]]] = {}
    for key, p, _, _, placement in _trainable_pieces(optimizer, layout):
        shape = placement.shape if placement is not None else p.shape
        keys[f"main.{key}"] = shape
        keys.update({f"state.{key}.{name}": shape for name, _ in layout.shaped})
    for g, group in enumerate(optimizer.optimizer.param_groups):
        keys.update({f"param_groups.{g}.{hp}": _shape_of(v) for hp, v in group.items() if hp != "params"})
        keys.update({f"param_groups.{g}.state.{n}": _shape_of(v) for n, v in layout.scalars[g].items()})
    keys["state_initialized"] = ()
    return keys


def load_optimizer_state_dict(optimizer, state_dict: Mapping[str, Any]) -> None:
    """Load a state dict shaped like ``optimizer_state_dict(optimizer)`` (after ``dcp.load`` filled it).

    Validates keys, shapes and piece sizes before changing anything; then sets
    hyperparameters, rebuilds each optimizer tensor's state from the pieces
    (alignment padding inside a run is zero, as it always is there) and
    installs the main weights into main and compute storage (a collective).
    """
    layout = optimizer_layout(optimizer)
    if "state_initialized" in state_dict:  # a Python bool in checkpoints written before it was a tensor
        state_dict = {**state_dict, "state_initialized": torch.as_tensor(bool(state_dict["state_initialized"]))}

    def check():
        check_against("optimizer load_state_dict", state_dict, _expected_optimizer_keys(optimizer, layout))
        writes = []  # (run, state key, offset in run, piece)
        mains: List[Dict[str, torch.Tensor]] = [{} for _ in optimizer.models]
        for key, p, run, _, placement in _trainable_pieces(optimizer, layout):
            if run is None:
                continue
            lo, hi = p.param_lo, p.param_lo + p.b - p.a
            mains[run.model][p.name] = local_piece(state_dict[f"main.{key}"], lo, hi, f"main.{key}", placement)
            writes += [(run, name, p.a - run.a,
                        local_piece(state_dict[f"state.{key}.{name}"], lo, hi, key, placement))
                       for name, _ in layout.shaped]
        return writes, mains
    writes, mains = agreed(optimizer.models, check)
    inner = optimizer.optimizer
    with torch.no_grad():
        for g, group in enumerate(inner.param_groups):
            for hp in [hp for hp in group if hp != "params"]:
                value = state_dict[f"param_groups.{g}.{hp}"]
                group[hp] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
        for r in layout.runs:
            inner.state.pop(r.tensor, None)
        if bool(state_dict["state_initialized"]):
            for r in layout.runs:
                state = {}
                for name in layout.scalars[r.group]:
                    value = state_dict[f"param_groups.{r.group}.state.{name}"]
                    state[name] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
                for name, dtype in layout.shaped:
                    state[name] = torch.zeros_like(r.tensor, dtype=dtype)
                inner.state[r.tensor] = state
            for run, name, offset, piece in writes:
                inner.state[run.tensor][name][offset:offset + piece.numel()].copy_(piece)
    for model, pieces in zip(optimizer.models, mains):
        install_pieces(model, pieces)

"""``fully_shard``: find the units, lay out their buffers, install the hooks, return the wrapper.

The builder runs once per model. It decides everything that is fixed for the model's life:
which parameters form which unit (innermost unit module; tied parameters in the lowest
common unit), the flat layout of each unit, the section (dense or expert mesh) of each
parameter, and the forward, backward and gradient hooks the schedule runs through. Every
check that can fail runs before the first collective. What the wrapped model does at run
time is ``module.py`` (the wrapper) and ``runtime.py`` (the schedule).
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Type

import torch
import torch.distributed as dist

from ..sharding import gather_buffers
from ..sharding.buffers import UnitStorage
from ..collectives.comm import CommAxis, Ledger, collective
from ..sharding.experts import DENSE, EXPERT, ExpertSharding, Section
from ..sharding.layout import ParamSpec, build_layout
from ..sharding.mesh import DataParallelMesh
from ..init.meta_init import MetaInit, MetaMaterialiser, check_meta_module, is_on_meta, target_device
from ..precision.mixed_precision import MixedPrecision
from ..precision.param_gather import QuantizedParamGather
from .module import FullyShardedModule
from ..init.replicas import broadcast_from_rank0
from ..schedule.runtime import Overlap, Schedule
from ..sharding.strategy import MeshStrategy, parse_mesh_strategy
from ..collectives.teardown import track
from ..schedule.unit import FSDPUnit
from ..init.validation import check_same_module_on_all_ranks, module_signature

ALIGN_BYTES = 16  # parameter starts and shard sizes in a unit's flat buffer


def megatron_no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron-Core's default rule (``megatron/core/optimizer``): no weight decay on biases and on
    1-D parameters (norms). The one copy of it: the Megatron adapter uses this function too."""
    return name.endswith(".bias") or name == "bias" or param.dim() == 1


def _unit_selectors(unit_modules) -> Tuple[Tuple[Type[torch.nn.Module], ...], Tuple[torch.nn.Module, ...]]:
    """``unit_modules`` holds classes (every instance becomes a unit) and/or module instances."""
    if unit_modules is None:
        return (), ()
    if isinstance(unit_modules, (type, torch.nn.Module)):
        unit_modules = (unit_modules,)
    classes, instances = [], []
    for c in unit_modules:
        if isinstance(c, type) and issubclass(c, torch.nn.Module):
            classes.append(c)
        elif isinstance(c, torch.nn.Module):
            instances.append(c)
        else:
            raise TypeError(f"unit_modules must hold nn.Module classes or instances, got {c!r}")
    return tuple(classes), tuple(instances)


def _assign_params(module: torch.nn.Module, unit_names: List[str]):
    """Map each parameter to the innermost unit containing every module that holds it.

    A tied parameter (e.g. embedding and output head) lands in the lowest common
    unit of its holders, so it is resident whenever any holder runs.
    """
    def enclosing_units(module_name: str) -> List[str]:
        return [u for u in unit_names if u == "" or module_name == u or module_name.startswith(u + ".")]

    canonical: Dict[int, str] = {}
    owner: Dict[int, List[str]] = {}
    params: Dict[int, torch.nn.Parameter] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        c = enclosing_units(name.rpartition(".")[0])
        if id(p) not in canonical:
            canonical[id(p)], owner[id(p)], params[id(p)] = name, c, p
        else:
            prev = owner[id(p)]
            k = 0
            while k < min(len(prev), len(c)) and prev[k] == c[k]:
                k += 1
            owner[id(p)] = prev[:k]
    by_unit: Dict[str, List[Tuple[str, torch.nn.Parameter]]] = {u: [] for u in unit_names}
    for pid, name in canonical.items():
        by_unit[owner[pid][-1]].append((name, params[pid]))
    return by_unit


@collective("fully_shard")
def checked_option(value, kind: type, keyword: str):
    """``value`` of an option that is one value (``overlap=Overlap(...)``), or None; anything else is refused with
    the type it must be (the engine's public calls take their options this way)."""
    if value is not None and not isinstance(value, kind):
        raise TypeError(f"{keyword} must be a megatron.fsdp.{kind.__name__}, got {type(value).__name__}")
    return value


def fully_shard(
    module: torch.nn.Module,
    strategy="optim_grads_params",
    unit_modules: Optional[Iterable[Type[torch.nn.Module]]] = None,
    mesh=None,
    mixed_precision: Optional[MixedPrecision] = None,
    no_weight_decay: Callable[[str, torch.nn.Parameter], bool] = megatron_no_weight_decay,
    outer_strategy=None,
    average_grads: bool = True,
    experts: Optional[ExpertSharding] = None,
    overlap: Optional[Overlap] = None,
    meta_init: Optional[MetaInit] = None,
) -> FullyShardedModule:
    """Shard ``module``'s parameters, gradients and optimizer state over the data-parallel ranks.

    ``mesh``: a process group (a flat mesh; default: the world) or a ``DataParallelMesh`` (two axes,
    ``strategy`` the inner level and ``outer_strategy`` the outer level).
    ``average_grads=False`` sums gradients over ranks instead of averaging
    (for per-token loss normalisation, scaled later by ``scale_gradients``).
    ``experts`` puts expert parameters in their own section: own mesh, own
    levels, own gradient scale (see ``experts.py``).
    ``overlap=Overlap(forward_prefetch, backward_prefetch, reductions_in_flight, double_buffer)``
    (units gathered ahead; gradient reductions issued before the oldest is waited; persistent
    gather buffers) sets how far communication runs ahead of compute (default ``Overlap()``).
    ``mixed_precision=MixedPrecision(..., param_gather=QuantizedParamGather(recipe, ...))`` gathers
    the GEMM weights it selects in FP8 (``megatron.fsdp.quantized_weight(param)`` gives that form).
    A module on the ``meta`` device is materialised as ``meta_init=MetaInit(device, init_weights)``
    says: on ``device`` (default: the current CUDA device, else CPU) one submodule at a time, each
    initialised by ``init_weights(submodule)`` or its own ``reset_parameters()`` in
    ``module.modules()`` order and copied straight into this rank's shards: the
    build peaks at the persistent state plus at most one unit (``meta_init.py``).
    Every check that can fail runs before the first collective; the first
    collective here (a digest of parameter names, shapes and dtypes) makes all
    ranks fail together when the models differ. Then, as DDP does, every
    parameter is overwritten with rank 0's values along each data-parallel axis
    (``replicas.py``), so replicas that were built differently cannot diverge.
    """
    overlap = checked_option(overlap, Overlap, "overlap")
    mp = checked_option(mixed_precision, MixedPrecision, "mixed_precision")
    meta_init = checked_option(meta_init, MetaInit, "meta_init")
    meta_init = meta_init if meta_init is not None else MetaInit()
    device, init_weights = meta_init.device, meta_init.init_weights
    mesh = _mesh_of(mesh)
    levels = parse_mesh_strategy(strategy, outer_strategy, mesh.has_outer)
    overlap = overlap if overlap is not None else Overlap()
    mp = mp if mp is not None else MixedPrecision()
    param_gather = mp.param_gather
    if isinstance(module, FullyShardedModule):
        raise ValueError("module is already wrapped by fully_shard")
    classes, instances = _unit_selectors(unit_modules)
    unit_names = [""] + [n for n, m in module.named_modules()
                         if n and (isinstance(m, classes) or any(m is i for i in instances))]
    if (classes or instances) and len(unit_names) == 1:
        present = sorted({type(m).__name__ for m in module.modules()})
        wanted = [c.__name__ for c in classes] + [type(i).__name__ + " instance" for i in instances]
        raise ValueError(
            f"unit_modules {wanted} matched no submodule of {type(module).__name__}; "
            f"module classes present: {', '.join(present)}")
    named = list(module.named_parameters())
    on_meta = is_on_meta(module)
    if on_meta:
        check_meta_module(module, init_weights)
        device = target_device(device)
    else:
        device = _device_of_eager(named, device, init_weights)
    for name, p in named:
        if not p.is_floating_point():
            raise TypeError(f"parameter {name!r} has non-floating dtype {p.dtype}; only floating parameters can be sharded")
    quantized = _quantized_names(module, named, param_gather)
    ledger = Ledger()
    inner = CommAxis("dp_shard", mesh.inner_group, ledger)
    outer = CommAxis("dp_outer", mesh.outer_group, ledger)
    dense = Section(DENSE, inner, outer, levels, average_grads, 1.0)
    expert = _expert_section(experts, levels, average_grads, ledger)
    by_unit = _assign_params(module, unit_names)
    for uname, plist in by_unit.items():
        dtypes = sorted({str(mp.compute_dtype(p.dtype)) for _, p in plist})
        if len(dtypes) > 1:
            raise TypeError(f"FSDP unit {uname or '<root>'} mixes compute dtypes {dtypes}; "
                            "pass mixed_precision=MixedPrecision(param_dtype=...) or make them uniform")
    split = _split_experts(by_unit, experts)
    signature = module_signature(named)
    groups = [((uname, section.name), plist) for uname in unit_names
              for section, plist in ((dense, split[uname][0]), (expert, split[uname][1])) if plist]
    sections_by_name, params_of = {DENSE: dense, EXPERT: expert}, dict(groups)

    def build(key) -> UnitStorage:
        return _unit_storage(params_of[key], sections_by_name[key[1]], mp, no_weight_decay, device,
                             param_gather, quantized)

    storages = None
    if on_meta:
        # Every unit's storage is laid out from the shapes first; then each submodule is initialised
        # and its parameters copied in at once, before the first collective (meta_init.py).
        storages = {key: build(key) for key, _ in groups}
        adopt = {id(p): functools.partial(s.adopt, i) for s in storages.values() for i, p in enumerate(s.params)}
        MetaMaterialiser(module, device, init_weights).run(lambda p: adopt[id(p)](p.detach()))
    for axis in (inner, outer) + ((expert.inner, expert.outer) if expert is not None else ()):
        check_same_module_on_all_ranks(axis, signature, device)
    if storages is None:
        # Every replica starts equal to rank 0's (DDP's rule; replicas.py). A meta-device
        # model is initialised on every rank from the same seed instead (meta_init.py).
        for uname in unit_names:
            broadcast_from_rank0(split[uname][0], (dense.inner, dense.outer))
            if expert is not None:
                broadcast_from_rank0(split[uname][1], (expert.inner, expert.outer))
        storages = {key: build(key) for key, _ in groups}

    units: List[FSDPUnit] = []
    modules = dict(module.named_modules())
    placed: List[gather_buffers.Candidate] = []
    for uname in unit_names:
        for section in (dense, expert):
            storage = storages.get((uname, section.name)) if section is not None else None
            if storage is None:
                continue
            label = uname if section is dense else f"{uname or '<root>'}[experts]"
            units.append(FSDPUnit(len(units), label, modules[uname], storage,
                                  [s.spec.name for s in storage.layout.slots]))
            placed.append(gather_buffers.Candidate(units[-1].name, section.name, -1 if not uname else
                                                   gather_buffers.nesting_depth(uname, unit_names),
                                                   storage.layout.padded_size, storage.compute_dtype))
    if overlap.double_buffer:
        _use_gather_buffers(units, placed, max(overlap.forward_prefetch, overlap.backward_prefetch), device)
    for unit in units:  # the first FP8 quantization (scales from global amaxes, the gathers ZeRO-1/2 keep)
        if unit.storage.fp8 is not None:
            unit.set_pending(unit.storage.install_main_weights(tag=unit.name))
    root = units[0] if units and units[0].name == "<root>" else None
    runtime = Schedule(units, root, overlap)
    track(runtime)  # shutdown() waits for what it leaves in flight
    for unit in units:
        if unit is not root:
            unit.module.register_forward_pre_hook(lambda _m, args, kwargs, u=unit: runtime.pre_forward(u, args, kwargs),
                                                  with_kwargs=True)
            # always_call: a forward that raises still releases what its pre-hook gathered
            unit.module.register_forward_hook(lambda _m, _a, out, u=unit: runtime.post_forward(u, out),
                                              always_call=True)
        for i, p in unit.storage.trainable_params:
            p.register_post_accumulate_grad_hook(functools.partial(_on_grad, weakref.ref(runtime), unit.index, i))
    _hook_direct_calls(module, units, runtime)
    sections = {DENSE: dense} if expert is None else {DENSE: dense, EXPERT: expert}
    return FullyShardedModule(module, runtime, units, sections, mp)


def _mesh_of(mesh) -> DataParallelMesh:
    """``mesh`` as a ``DataParallelMesh``: a process group is a flat mesh, None the world (or, without
    torch.distributed, a mesh of this process alone)."""
    if isinstance(mesh, DataParallelMesh):
        return mesh
    if mesh is None and dist.is_available() and dist.is_initialized():
        mesh = dist.group.WORLD
    return DataParallelMesh(mesh, None)


def _use_gather_buffers(units: List[FSDPUnit], placed, depth: int, device: torch.device) -> None:
    """The units that release their full weights (and have gradients) gather into persistent buffers."""
    chosen = [(unit, c) for unit, c in zip(units, placed) if unit.storage.releases and unit.num_trainable]
    assignment, shapes = gather_buffers.plan([c for _, c in chosen], depth)
    buffers = gather_buffers.allocate(shapes, device)
    for (unit, _), index in zip(chosen, assignment):
        unit.storage.use_gather_buffer(buffers[index], unit.name)


def _device_of_eager(named, device, init_weights) -> torch.device:
    """The one device an eagerly built module's parameters are on (``device``, if given, must agree)."""
    if init_weights is not None:
        raise ValueError("init_weights initialises a module built on the meta device; this module's parameters "
                         "already have values (build it under `with torch.device('meta'):` to use init_weights)")
    devices = sorted({str(p.device) for _, p in named})
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device before fully_shard, found {devices}")
    found = torch.device(devices[0]) if devices else torch.device("cpu")
    wanted = torch.device(device) if device is not None else found
    if wanted.type != found.type or wanted.index not in (None, found.index):
        raise ValueError(f"device={device} but the parameters are on {found}; move the module first "
                         "(device= chooses where a meta-device module is materialised)")
    return found


def _hook_direct_calls(module: torch.nn.Module, units: List[FSDPUnit], runtime: Schedule) -> None:
    """Every submodule whose forward uses parameters of a unit it is not the unit module of (nor inside
    it) gathers that unit when it is called while the unit is not gathered: the embedding or the head
    of the root unit, a unit's own submodules, called on their own (``runtime.direct_call_begins``).

    Parameters are counted under every name (a tied head holds the embedding's weight). Inside its
    units' forwards a hooked call costs one state check per unit.
    """
    unit_of = {id(p): unit for unit in units for p in unit.storage.params}
    for name, sub in module.named_modules():
        if not name:
            continue  # the root module's own hooks open the pass (module.py)
        inside = {id(m) for m in sub.modules()}
        needed = {unit.index: unit for unit in (unit_of.get(id(p)) for _, p in sub.named_parameters(remove_duplicate=False))
                  if unit is not None and id(unit.module) not in inside}
        if needed:
            ordered = [needed[k] for k in sorted(needed)]
            sub.register_forward_pre_hook(lambda m, _a, u=ordered: runtime.direct_call_begins(m, u), prepend=True)
            sub.register_forward_hook(lambda m, _a, out: runtime.direct_call_ends(m, out), always_call=True)


def _on_grad(runtime_ref, unit_index: int, param_index: int, _param) -> None:
    """A parameter's post-accumulate-grad hook. It reaches the runtime through a weak
    reference: autograd keeps tensor hooks on the C++ side, where the garbage collector
    cannot see a cycle back to the parameter, so a strong one would keep the whole
    model (and the process groups it holds) alive after the user dropped it."""
    runtime = runtime_ref()
    if runtime is not None:
        runtime.on_grad(runtime.units[unit_index], param_index)


def _expert_section(experts: Optional[ExpertSharding], dense_levels: MeshStrategy, average_grads: bool,
                    ledger: Ledger) -> Optional[Section]:
    if experts is None:
        return None
    if not isinstance(experts, ExpertSharding):
        raise TypeError(f"experts must be a megatron.fsdp.ExpertSharding, got {type(experts).__name__}")
    mesh = experts.mesh
    inner_level = experts.strategy if experts.strategy is not None else dense_levels.inner.name
    outer_level = experts.outer_strategy
    if outer_level is None and mesh.has_outer:
        outer_level = dense_levels.outer.name
    levels = parse_mesh_strategy(inner_level, outer_level, mesh.has_outer)
    average = average_grads if experts.average_grads is None else experts.average_grads
    return Section(EXPERT, CommAxis("expert_dp_shard", mesh.inner_group, ledger),
                    CommAxis("expert_dp_outer", mesh.outer_group, ledger), levels, average, experts.grad_scale)


def _split_experts(by_unit, experts: Optional[ExpertSharding]):
    """``{unit: (dense params, expert params)}``; expert parameters must sit inside some unit module."""
    split = {}
    for uname, plist in by_unit.items():
        if experts is None:
            split[uname] = (plist, [])
            continue
        flags = [bool(experts.is_expert(n, p)) for n, p in plist]
        split[uname] = ([x for x, f in zip(plist, flags) if not f], [x for x, f in zip(plist, flags) if f])
    stray = [n for n, _ in split.get("", ((), ()))[1]]
    if stray:
        raise ValueError(
            f"expert parameters {stray[:4]} are not inside any unit module; pass the module class "
            "that holds the experts (e.g. the MoE layer) in unit_modules so they are gathered with it")
    return split


def _quantized_names(module: torch.nn.Module, named, param_gather: Optional[QuantizedParamGather]) -> frozenset:
    """The parameters ``param_gather`` gathers in FP8; every reason one cannot be is one error, before any collective."""
    if param_gather is None:
        return frozenset()
    if not isinstance(param_gather, QuantizedParamGather):
        raise TypeError(f"param_gather must be a megatron.fsdp.QuantizedParamGather, got {type(param_gather).__name__}")
    rule = param_gather.quantize or _linear_weights(module)
    chosen = [(n, p) for n, p in named if rule(n, p)]
    recipe = f"QuantizedParamGather(recipe={param_gather.recipe!r})"
    if not chosen:
        raise ValueError(f"{recipe} selects no parameter of {type(module).__name__} (the default selects the weight "
                         "of every trainable torch.nn.Linear); pass quantize=(name, param) -> bool, or drop "
                         "param_gather")
    problems = [f"{n} is frozen (frozen parameters are gathered in the compute dtype)" for n, p in chosen
                if not p.requires_grad]
    problems += [f"{n} is a scalar" for n, p in chosen if p.dim() == 0]
    if param_gather.block:
        problems += [f"{n} has shape {tuple(p.shape)}: its reduction dimension (the last, {p.shape[-1]}) is not a "
                     f"multiple of {param_gather.block}" for n, p in chosen if p.dim() and p.shape[-1] % param_gather.block]
    if problems:
        raise ValueError(f"{recipe} cannot quantize: " + "; ".join(problems) +
                         "; leave these out with quantize=(name, param) -> bool")
    return frozenset(n for n, _ in chosen)


def _linear_weights(module: torch.nn.Module) -> Callable[[str, torch.nn.Parameter], bool]:
    """The default FP8 selection: the ``weight`` of every trainable ``nn.Linear`` that no other kind of module
    holds (a head tied to an embedding stays in the compute dtype, as Transformer Engine leaves embeddings)."""
    holders: Dict[int, List[bool]] = {}
    for m in module.modules():
        for pname, p in m._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append(isinstance(m, torch.nn.Linear) and pname == "weight")
    return lambda _name, p: p.requires_grad and all(holders.get(id(p), [False]))


def _unit_storage(plist, section: Section, mp: MixedPrecision, no_weight_decay, device,
                  param_gather: Optional[QuantizedParamGather] = None, quantized: frozenset = frozenset()) -> UnitStorage:
    specs = [ParamSpec(n, tuple(p.shape), p.requires_grad, no_weight_decay(n, p)) for n, p in plist]
    dtypes = mp.unit_dtypes(plist[0][1].dtype)
    align = max(1, ALIGN_BYTES // dtypes.compute.itemsize)
    if param_gather is not None and param_gather.block and any(n in quantized for n, _ in plist):
        align = math.lcm(align, param_gather.block)  # MXFP8: no shard boundary splits a 32-block
    layout = build_layout(specs, section.inner.size, align=align, sub_shards=section.outer.size)
    by_name = dict(plist)
    ordered = [by_name[s.spec.name] for s in layout.slots]
    return UnitStorage(layout, ordered, section, dtypes, device, param_gather=param_gather,
                       quantized=[i for i, s in enumerate(layout.slots) if s.spec.name in quantized])

"""Build Megatron-Core models on the meta device and replay their own initialisation, unit by unit.

Megatron-Core's local-spec layers have no ``reset_parameters()``: ``ColumnParallelLinear``
and friends initialise in their constructors, through ``init_method`` and
``_initialize_affine_weight_cpu`` (the full master weight drawn from the CPU generator,
this TP rank's slice kept) or ``_initialize_affine_weight_gpu`` (this rank's slice drawn
under the model-parallel RNG tracker). Re-deriving those rules would drift from the
library; instead :func:`build_on_meta_device` runs the model's constructors under
``torch.device("meta")`` and records, per tensor, what the constructors did to it:

* calls of ``_initialize_affine_weight_cpu`` / ``_gpu`` (replayed with the same
  arguments: the same ``init_method``, stride, TP rank, RNG-tracker fork; where the CPU one's
  master weight is the parameter, drawn into the parameter directly: ``_affine_replay``);
* in-place ops on a parameter or buffer (``normal_``, ``fill_``, ``zero_``,
  ``uniform_``... from ``init_method(param)``, bias zeroing, torch modules'
  ``reset_parameters``), with the view they hit;
* factories whose result becomes a parameter or buffer (``torch.ones``...);
* the construction-time all-reduce of a pipeline-split tied embedding
  (``LanguageModule.setup_embeddings_and_output_layer``): replayed as the same
  all-reduce over the embedding group, on the materialised weight (Megatron-Core 0.17+ skips it on
  meta: it is recorded after the build, ``_record_tied_embedding_sync``).

``megatron.fsdp.fully_shard`` then materialises each submodule in
``module.modules()`` order and calls :meth:`MetaInitRecipe.init_weights` on it, which
replays that submodule's records in recorded order. The replay draws the same random
numbers as the eager constructors whenever the constructors drew them in
``modules()`` order; :meth:`MetaInitRecipe.out_of_order` names any module for which
they did not (none in Megatron-Core 0.16.1's GPT: DP, TP, PP, MoE; see docs/adapter.md). A weight a
constructor draws and then drops (multi-latent attention's first ``linear_proj``) is drawn again,
into scratch, before the next kept one (``_attach_discarded_draws``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron.fsdp import mcore_releases as compat
from megatron.fsdp.collectives.simulation import outside_simulation

_AFFINE_INITS = ("_initialize_affine_weight_cpu", "_initialize_affine_weight_gpu")
_RANDOM = {"normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_", "cauchy_",
           "log_normal_", "randn", "rand", "randint", "randperm", "normal", "rand_like", "randn_like",
           "randint_like"} | set(_AFFINE_INITS)
_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.randn, torch.rand, torch.randint,
              torch.arange, torch.tensor, torch.normal, torch.eye, torch.linspace}
_LIKE = {torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like}
_UNINITIALISED = {torch.empty, torch.empty_like}

_RECIPES: "weakref.WeakKeyDictionary[torch.nn.Module, MetaInitRecipe]" = weakref.WeakKeyDictionary()


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclasses.dataclass
class _Record:
    """One thing a constructor did to (a view of) a tensor's storage."""

    name: str                      # the op, for messages and the RNG-order check
    replay: Optional[Callable[[torch.Tensor], None]]  # given the materialised tensor; None: not replayable
    offset: int = 0
    size: Tuple[int, ...] = ()
    stride: Tuple[int, ...] = ()
    whole: bool = True             # applies to the whole tensor (a factory or a call), not a view
    # Draws of tensors the constructors made and then dropped, due just before this record:
    # (meta tensor, its records, its eager device). Replayed into scratch so the generators advance as eagerly.
    discarded: List[Tuple[torch.Tensor, List["_Record"], torch.device]] = dataclasses.field(default_factory=list)


class _Tape:
    def __init__(self):
        self.records: Dict[int, List[_Record]] = {}
        self.order: List[Tuple[int, _Record]] = []
        self.devices: Dict[int, torch.device] = {}  # where the eager constructor would have put each tensor
        self.keep: List[torch.Tensor] = []  # recorded storages stay alive, so their keys stay unique
        self.tensors: Dict[int, torch.Tensor] = {}  # the first recorded tensor of each storage
        self.suppressed = 0

    def add(self, target: torch.Tensor, record: _Record) -> None:
        self.keep.append(target)
        self.tensors.setdefault(_key(target), target)
        self.records.setdefault(_key(target), []).append(record)
        self.order.append((_key(target), record))

    @contextlib.contextmanager
    def suppress(self):
        self.suppressed += 1
        try:
            yield
        finally:
            self.suppressed -= 1


def _has_meta_tensor(values) -> bool:
    return any(isinstance(v, torch.Tensor) and v.is_meta for v in values)


class _Recorder(TorchFunctionMode):
    """Keeps every tensor on meta (even ``device=`` ones) and records what touches it."""

    def __init__(self, tape: _Tape):
        super().__init__()
        self.tape = tape

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES or func in _LIKE:
            device = kwargs.get("device")
            if isinstance(device, int) and not isinstance(device, bool):
                device = torch.device("cuda", device)  # torch.cuda.current_device()'s index (the router's buffers)
            if device is not None and torch.device(device).type == "cpu":
                return func(*args, **kwargs)  # an explicit CPU tensor (index tables...): built for real
            real_kwargs = {k: v for k, v in kwargs.items() if k != "device"}
            out = func(*args, **dict(kwargs, device="meta"))
            if device is not None and str(device) != "meta":  # the GPU path's weights: drawn there eagerly
                self.tape.keep.append(out)
                self.tape.devices[_key(out)] = torch.device(device)
            if not self.tape.suppressed and func not in _UNINITIALISED:
                self.tape.add(out, _Record(func.__name__, self._factory_replay(func, args, real_kwargs)))
            return out
        if func is torch.Tensor.cuda and args and args[0].is_meta:
            return args[0]
        if func is torch.Tensor.to and args and args[0].is_meta:  # a device move of a meta tensor stays on meta
            rest = [a for a in args[1:] if not isinstance(a, (torch.device, str, int))]
            kwargs.pop("device", None)
            return func(args[0], *rest, **kwargs) if rest or kwargs else args[0]
        name = getattr(func, "__name__", "")
        if not self.tape.suppressed and name.endswith("_") and not name.endswith("__"):
            self._record_in_place(func, name, args, kwargs)
        return func(*args, **kwargs)

    def _record_in_place(self, func, name: str, args, kwargs) -> None:
        """An in-place op (``Tensor.normal_``, ``torch.nn.init.normal_(tensor=...)``) on a meta tensor."""
        if args and isinstance(args[0], torch.Tensor):
            target, rest, keyword = args[0], args[1:], None
        elif isinstance(kwargs.get("tensor"), torch.Tensor):  # torch.nn.init passes its tensor by keyword
            target, rest, keyword = kwargs["tensor"], args, "tensor"
        else:
            return
        if not target.is_meta:
            return
        others = {k: v for k, v in kwargs.items() if k != keyword}
        if _has_meta_tensor(rest) or _has_meta_tensor(others.values()):
            replay = None
        elif keyword is None:
            replay = lambda t: func(t, *rest, **others)  # noqa: E731
        else:
            replay = lambda t: func(*rest, **{keyword: t}, **others)  # noqa: E731
        self.tape.add(target, _Record(name, replay, target.storage_offset(), tuple(target.shape),
                                      tuple(target.stride()), whole=False))

    @staticmethod
    def _factory_replay(func, args, kwargs):
        if func in _LIKE:
            if _has_meta_tensor(args[1:]) or _has_meta_tensor(kwargs.values()):
                return None

            def like(t):
                t.copy_(func(torch.empty_like(t), *args[1:], **kwargs))
            return like
        if _has_meta_tensor(args) or _has_meta_tensor(kwargs.values()):
            return None

        def make(t):
            t.copy_(func(*args, **dict(kwargs, device=t.device)).reshape(t.shape))
        return make


@contextlib.contextmanager
def _patched_affine_inits(tape: _Tape):
    """Wrap Megatron-Core's affine initialisers wherever a module holds them (layers, experts)."""
    originals = {name: getattr(sys.modules["megatron.core.tensor_parallel.layers"], name) for name in _AFFINE_INITS}
    patched = []
    for name, original in originals.items():
        def wrapper(weight, *args, _original=original, _name=name, **kwargs):
            with tape.suppress():
                result = _original(weight, *args, **kwargs)  # on meta: sets TP attributes, draws nothing
            if not tape.suppressed:
                tape.add(weight, _Record(_name, _affine_replay(_name, _original, args, kwargs)))
            return result
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("megatron.core") and getattr(module, name, None) is original:
                setattr(module, name, wrapper)
                patched.append((module, name, original))
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


def _affine_replay(name: str, original: Callable, args, kwargs) -> Callable[[torch.Tensor], None]:
    """The replay of one affine-initialiser call: the call itself, except where the CPU initialiser's
    master weight is the parameter (one TP partition, stride 1, fp32): then ``init_method`` draws into
    the parameter directly, the same draws in the same order, without the master weight and its
    ``torch.cat`` (two more copies of the weight, the largest transient of the build)."""
    as_called = lambda t: original(t, *args, **kwargs)  # noqa: E731
    if name != "_initialize_affine_weight_cpu":
        return as_called
    call = inspect.signature(original).bind(None, *args, **kwargs)
    call.apply_defaults()
    a = call.arguments
    if not {"output_size", "input_size", "init_method", "stride", "params_dtype", "rank", "world_size"} <= set(a):
        return as_called  # a release whose initialiser takes other arguments: replayed as it is

    def replay(t: torch.Tensor) -> None:
        world_size = a["world_size"]
        if a["rank"] is None:
            world_size = sys.modules["megatron.core.tensor_parallel.layers"].get_tensor_model_parallel_world_size()
        if (world_size == 1 and a["stride"] == 1 and t.dtype == a["params_dtype"] == torch.float32
                and tuple(t.shape) == (a["output_size"], a["input_size"]) and t.is_contiguous()):
            a["init_method"](t)
        else:
            as_called(t)
    return replay


@contextlib.contextmanager
def _deferred_all_reduce(tape: _Tape):
    """The tied-embedding sync of a pipeline split runs at construction; on meta it is recorded."""
    original = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not tensor.is_meta:
            return original(tensor, op=op, group=group, async_op=async_op)
        tape.add(tensor, _Record("all_reduce", lambda t: original(t, op=op, group=group)))
        return None
    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = original


@dataclasses.dataclass
class _Holder:
    records: List[_Record]
    base_offset: int
    eager_device: torch.device  # the eager build drew there (a CPU tensor moved later, or on the GPU)


class MetaInitRecipe:
    """What the constructors of one model chunk did to each of its parameters and buffers."""

    def __init__(self, chunk: torch.nn.Module, tape: _Tape):
        self._tape = tape
        self._params: Dict[int, _Holder] = {}
        self._buffers: Dict[Tuple[int, str], _Holder] = {}
        position: Dict[int, int] = {}
        names: List[str] = []
        for i, (mname, m) in enumerate(chunk.named_modules()):
            names.append(mname or "<root>")
            for p in m._parameters.values():
                if p is not None and id(p) not in self._params:
                    self._params[id(p)] = self._holder(tape, p)
                    position.setdefault(_key(p), i)
            for bname, b in m._buffers.items():
                if b is not None:
                    self._buffers[(id(m), bname)] = self._holder(tape, b)
                    position.setdefault(_key(b), i)
        random = [(position[k], r.name) for k, r in tape.order if k in position and r.name in _RANDOM]
        self._out_of_order = sorted({names[a] for (a, _), (b, _) in zip(random, random[1:]) if b < a})

    @staticmethod
    def _holder(tape: _Tape, t: torch.Tensor) -> _Holder:
        return _Holder(tape.records.get(_key(t), []), t.storage_offset(), tape.devices.get(_key(t), torch.device("cpu")))

    def out_of_order(self) -> List[str]:
        """Modules whose constructor-time draws come after a later module's: their weights cannot equal
        the eager build's (the replay follows ``modules()`` order). Empty for Megatron-Core's GPT."""
        return list(self._out_of_order)

    @torch.no_grad()
    def init_weights(self, module: torch.nn.Module) -> None:
        """Replay, on ``module``'s own materialised parameters and buffers, what its constructors did."""
        for pname, p in module._parameters.items():
            if p is not None and id(p) in self._params:
                self._replay(self._params[id(p)], p.data, module, pname)
        for bname, b in module._buffers.items():
            holder = self._buffers.get((id(module), bname))
            if b is not None and holder is not None:
                self._replay(holder, b, module, bname)
        self._materialise_attributes(module.__dict__, type(module).__name__, depth=1)

    def _materialise_attributes(self, attributes: dict, owner: str, depth: int) -> None:
        """Plain tensor attributes made in a constructor (not parameters or buffers), also one level
        into helper objects (a token dispatcher's tables): rebuilt from their records where the eager
        build made them (a plain attribute is not moved by ``.cuda()``: CPU unless recorded)."""
        for name, value in list(attributes.items()):
            if isinstance(value, torch.Tensor) and value.is_meta:
                attributes[name] = self._rebuilt(value, f"{owner}.{name}")
            elif (depth > 0 and not isinstance(value, (torch.nn.Module, torch.Tensor, type))
                  and hasattr(value, "__dict__")):
                self._materialise_attributes(vars(value), f"{owner}.{name}", depth - 1)

    def _rebuilt(self, value: torch.Tensor, what: str) -> torch.Tensor:
        records = self._tape.records.get(_key(value), [])
        if not records:
            raise RuntimeError(f"{what} is a tensor its constructor left on the meta device with no recorded "
                               "initialisation; build this module without --init-model-with-meta-device")
        storage = value.untyped_storage().nbytes() // value.element_size()
        base = torch.empty(storage, dtype=value.dtype, device=self._tape.devices.get(_key(value), "cpu"))
        self._replay(_Holder(records, 0, self._tape.devices.get(_key(value), torch.device("cpu"))), base, None, what)
        return base.as_strided(value.shape, value.stride(), value.storage_offset())

    @staticmethod
    def _replay(holder: _Holder, tensor: torch.Tensor, module: torch.nn.Module, name: str) -> None:
        if not holder.records:
            return
        if tensor.device.type != holder.eager_device.type:
            # Eagerly this tensor was made on another device (a CPU tensor the job moves with
            # .cuda(), say): draw there, from that device's generator, then copy.
            staged = torch.empty_like(tensor, device=holder.eager_device)
            MetaInitRecipe._replay(dataclasses.replace(holder, eager_device=staged.device), staged, module, name)
            tensor.copy_(staged)
            return
        for record in holder.records:
            for dropped, records, device in record.discarded:
                scratch = torch.empty(dropped.untyped_storage().nbytes() // dropped.element_size(), dtype=dropped.dtype,
                                      device=device).as_strided(dropped.shape, dropped.stride(), dropped.storage_offset())
                MetaInitRecipe._replay(_Holder(records, dropped.storage_offset(), device), scratch, None,
                                       "a dropped tensor")
            if record.replay is None:
                raise RuntimeError(
                    f"{type(module).__name__ if module is not None else ''}.{name}: its constructor ran {record.name} with another meta tensor "
                    "as input, which cannot be replayed; build this module without --init-model-with-meta-device")
            if record.whole:
                record.replay(tensor)
            else:
                record.replay(tensor.as_strided(record.size, record.stride, record.offset - holder.base_offset))


def build_on_meta_device(build: Callable[[], Any]) -> Any:
    """``build()`` (returning a module or a list of modules) with every tensor on meta and its
    initialisation recorded; :func:`recipe_of` gives each module's recipe."""
    tape = _Tape()
    with outside_simulation(), _patched_affine_inits(tape), _deferred_all_reduce(tape), torch.device("meta"), \
            _Recorder(tape):
        built = build()
    chunks = built if isinstance(built, (list, tuple)) else [built]
    if not compat.TIED_EMBEDDING_SYNC_RUNS_ON_META:
        _record_tied_embedding_sync(tape, chunks)
    _attach_discarded_draws(tape, chunks)
    for chunk in chunks:
        _RECIPES[chunk] = MetaInitRecipe(chunk, tape)
    return built


def _record_tied_embedding_sync(tape: _Tape, chunks) -> None:
    """Megatron-Core 0.17+ skips the tied-embedding all-reduce at construction under
    ``init_model_with_meta_device`` (0.16.1 ran it, and ``_deferred_all_reduce`` recorded it): recorded
    here with the condition of ``LanguageModule.setup_embeddings_and_output_layer``, so the last stage's
    copy (zero-filled at construction) becomes the first stage's embedding on every release."""
    for chunk in chunks:
        config = getattr(chunk, "config", None)
        in_group = getattr(chunk, "_is_in_embd_group", None)
        if config is None or in_group is None or not dist.is_initialized():
            continue
        tied = getattr(chunk, "share_embeddings_and_output_weights", False) or getattr(config, "mtp_num_layers", 0)
        if not tied or config.pipeline_model_parallel_size == 1 or not in_group():
            continue
        group, all_reduce = chunk.embd_group, dist.all_reduce
        tape.add(chunk.shared_embedding_or_output_weight(),
                 _Record("all_reduce", lambda t, group=group: all_reduce(t, group=group)))


def _attach_discarded_draws(tape: _Tape, chunks) -> None:
    """A constructor may draw a weight and then replace its module (Megatron-Core 0.16.1's
    multi-latent attention builds ``linear_proj`` in ``Attention.__init__`` and again in its own):
    the eager build's generators advanced for the dropped weight. Its draws are replayed, into
    scratch, just before the next draw of a tensor the model kept, so every later weight matches."""
    kept = {_key(t) for chunk in chunks for t in list(chunk.parameters()) + list(chunk.buffers())}
    pending: List[int] = []
    for key, record in tape.order:
        if record.name not in _RANDOM:
            continue
        if key not in kept:
            if key not in pending:
                pending.append(key)
        elif pending:
            record.discarded.extend((tape.tensors[k], tape.records[k], tape.devices.get(k, torch.device("cpu")))
                                    for k in pending)
            pending = []


def recipe_of(module: torch.nn.Module) -> Optional[MetaInitRecipe]:
    return _RECIPES.get(module)

"""Build a sharded model from one on the ``meta`` device: parameter by parameter, so no rank holds it whole.

Why: a model bigger than one rank's memory must never exist whole on a rank. ``fully_shard`` lays out
every unit's flat storage from the shapes, then walks ``module.modules()`` in order, giving each
submodule's parameters storage in one reused scratch buffer (an anonymous ``mmap`` on CPU), running
``init_weights(submodule)`` or its ``reset_parameters()``, and copying them into this rank's shards:
a build peaks at the persistent state plus one submodule's parameters. Every check and every
initialisation runs before the first collective of ``fully_shard``. The walk, the equality rule with an
eager build and the measured memory: docs/meta_init.md.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import mmap
from typing import Callable, Optional, Sequence, Tuple

import torch

from ..collectives.simulation import is_fake, outside_simulation, simulating

InitFn = Callable[[torch.nn.Module], None]


@dataclasses.dataclass(frozen=True)
class MetaInit:
    """How ``fully_shard`` materialises a module built on the meta device: on ``device`` (default: the
    current CUDA device, else CPU), each submodule initialised by ``init_weights(submodule)`` (default:
    its own ``reset_parameters()``). For a module that is not on meta, ``device`` (if given) must be
    where its parameters are, and ``init_weights`` must be None."""

    device: Optional[torch.device] = None
    init_weights: Optional[InitFn] = None


def is_on_meta(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def target_device(device: Optional[torch.device]) -> torch.device:
    """Where a meta module is materialised: ``device``, else the current CUDA device, else CPU."""
    if device is not None:
        device = torch.device(device)
        if device.type == "meta":
            raise ValueError("device='meta' cannot hold the sharded model; pass a real device (cpu, cuda:N)")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _has_reset(module: torch.nn.Module) -> bool:
    return callable(getattr(module, "reset_parameters", None))


def check_meta_module(module: torch.nn.Module, init_weights: Optional[InitFn]) -> None:
    """Everything on meta must have an initialiser; raise naming the tensor and the fix otherwise."""
    if init_weights is not None and not callable(init_weights):
        raise TypeError(f"init_weights must be a callable taking a submodule, got {type(init_weights).__name__}")
    real = [n for n, p in module.named_parameters() if not p.is_meta]
    if real:
        raise ValueError(f"the module is partly on the meta device: parameters {real[:4]} are not; build the "
                         "whole model under `with torch.device('meta'):` (or none of it)")
    if init_weights is not None:
        return
    for mname, m in module.named_modules():
        if _has_reset(m):
            continue
        owner = type(m).__name__
        for kind, tensors in (("parameter", m._parameters), ("buffer", m._buffers)):
            for name, t in tensors.items():
                if t is not None and t.is_meta:
                    full = f"{mname}.{name}" if mname else name
                    raise ValueError(
                        f"{kind} {full!r} is on the meta device and {owner} has no reset_parameters() to "
                        f"initialise it; give {owner} a reset_parameters() that sets it, or pass "
                        "fully_shard(..., meta_init=MetaInit(init_weights=fn)) where fn(submodule) initialises each "
                        "submodule's "
                        "own parameters and buffers")


def _materialise_param(p: torch.nn.Parameter, storage: torch.Tensor) -> None:
    """Give a meta parameter ``storage`` in place: same Python object (identity, attributes, hooks kept).

    A fake ``storage`` (a simulation, ``FakeTensorMode``) is swapped in as it is, marked a parameter: fake mode
    keeps a weak reference to every tensor it derives (a ``Parameter`` made of it too), and ``swap_tensors``
    refuses any tensor that has one."""
    if is_fake(p):
        raise ValueError("the module was built on the meta device inside FakeTensorMode: its parameters are fake "
                         "tensors that cannot be materialised in place; build it under `with torch.device('meta'):` "
                         "outside FakeTensorMode (a meta build allocates nothing) and call fully_shard inside it")
    attributes, requires_grad = dict(p.__dict__), p.requires_grad
    if is_fake(storage):
        torch.utils.swap_tensors(p, storage)
        p.__dict__.update(attributes)
        p._is_param = True  # what isinstance(p, Parameter) reads for a tensor subclass
        p.requires_grad_(requires_grad)
        return  # no data to mark unset
    real = torch.nn.Parameter(storage, requires_grad=requires_grad)
    real.__dict__.update(attributes)
    torch.utils.swap_tensors(p, real)
    if p.is_floating_point():
        p.data.fill_(float("nan"))  # anything left unset is caught below


def _unset(t: torch.Tensor) -> bool:
    """Any NaN left in ``t``. A max propagates NaN: it allocates no mask of ``t``'s size (``isnan``'s
    transient masks, freed into glibc's heap, fragmented it and grew a build's resident set)."""
    if not t.is_floating_point() or t.numel() == 0 or is_fake(t):
        return False  # a fake tensor (a simulation) has no values to check
    with outside_simulation():  # a real tensor (a buffer a constructor made on the device) is read as it is
        try:
            return bool(torch.isnan(t.detach().amax()))
        except RuntimeError:  # a dtype without a max kernel here (float8)
            return bool(torch.isnan(t.detach().float()).any())


_ALIGN = 64  # bytes: where each parameter starts in the scratch (torch's CPU allocator aligns as much)


class _Scratch:
    """Memory, reused by every submodule, for the parameters of the submodule being initialised.

    On CPU: one anonymous ``mmap`` sized for the submodule with the most parameter bytes of its own;
    each parameter gets a storage of its own at a fixed offset in it (storage offset 0, as a fresh
    tensor), from materialisation until ``place`` has copied it into its unit's storage. Freed, the
    mapping leaves the process whatever glibc's mmap threshold has become (a heap block of that size
    would stay resident). ``torch.frombuffer`` holds the mapping, so it is unmapped only when the last
    tensor on it is gone. Elsewhere (CUDA) each parameter is allocated, and the caching allocator
    reuses the blocks.
    """

    def __init__(self, nbytes: int, device: torch.device):
        self.device, self.used = device, 0
        real = device.type == "cpu" and nbytes > 0 and not simulating()  # simulated, torch.empty allocates nothing
        self.mapping = mmap.mmap(-1, nbytes) if real else None

    @staticmethod
    def size_of(shapes: Sequence[Tuple[torch.Size, torch.dtype]]) -> int:
        return sum(-(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN for shape, dtype in shapes)

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        count = math.prod(shape)
        if self.mapping is None or count == 0:
            return torch.empty(shape, dtype=dtype, device=self.device)
        start, self.used = self.used, self.used + self.size_of([(shape, dtype)])
        return torch.frombuffer(self.mapping, dtype=dtype, count=count, offset=start).view(shape)


def _return_freed_memory() -> None:
    """glibc's ``malloc_trim(0)``: hand the free pages of every malloc arena back to the OS.

    The initialisers' temporaries (a master weight drawn whole, then sliced) are freed into glibc's heap,
    where they would stay resident after the build; the build trims once, where glibc is the C library.
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc
        pass


class MetaMaterialiser:
    """Walk ``module.modules()`` once: materialise, initialise, and hand each parameter to ``place``.

    ``place(param)`` copies an initialised parameter (its value a view of the scratch) into its unit's
    storage and makes it what the level keeps; it runs before the next submodule is initialised, so at
    any moment a rank holds its storages plus one submodule's own parameters (and whatever its
    initialiser allocates).
    """

    def __init__(self, module: torch.nn.Module, device: torch.device, init_weights: Optional[InitFn]):
        self.module, self.device, self.init_weights = module, device, init_weights

    def run(self, place: Callable[[torch.nn.Parameter], None]) -> None:
        modules = list(self.module.named_modules())
        self._shapes = {id(p): (p.shape, p.dtype) for _, m in modules for p in m._parameters.values()
                        if p is not None}
        largest = max((_Scratch.size_of([self._shapes[id(p)] for p in m._parameters.values() if p is not None])
                       for _, m in modules), default=0)
        scratch = _Scratch(largest, self.device)
        done: set = set()
        for name, m in modules:
            scratch.used = 0
            self._initialise(name, m, done, scratch, place)
        del scratch
        if self.device.type == "cpu":
            _return_freed_memory()

    def _initialise(self, name: str, m: torch.nn.Module, done: set, scratch: _Scratch,
                    place: Callable[[torch.nn.Parameter], None]) -> None:
        fresh, seen = [], []
        for pname, p in m._parameters.items():
            if p is None:
                continue
            if id(p) in done:
                seen.append(pname)
            elif p.is_meta:
                _materialise_param(p, scratch.take(p.shape, p.dtype))
                fresh.append((pname, p))
        for bname, b in list(m._buffers.items()):
            if b is None:
                continue
            if b.is_meta:
                real = torch.empty(b.shape, dtype=b.dtype, device=self.device)
                m._buffers[bname] = real.fill_(float("nan")) if real.is_floating_point() else real.zero_()
            elif b.device != self.device:
                m._buffers[bname] = b.to(self.device)
        if not fresh and not seen and not m._buffers and self.init_weights is None:
            return
        # Tied parameters initialised by an earlier holder: this module's initialiser
        # runs on a scratch copy (it draws what it drew eagerly), the first value stays.
        originals = {pname: m._parameters[pname] for pname in seen}
        for pname, p in originals.items():
            m._parameters[pname] = torch.nn.Parameter(scratch.take(*self._shapes[id(p)]), requires_grad=p.requires_grad)
        owner = name or "<root>"
        try:
            with torch.no_grad():
                if self.init_weights is not None:
                    self.init_weights(m)
                elif _has_reset(m):
                    m.reset_parameters()
        except Exception as exc:
            how = "init_weights" if self.init_weights is not None else f"{type(m).__name__}.reset_parameters()"
            raise RuntimeError(f"meta-device initialisation of {owner} ({type(m).__name__}) failed in {how}: "
                               f"{type(exc).__name__}: {exc}; fix the initialiser (fully_shard runs it on each "
                               "submodule in module.modules() order, on its own parameters and buffers)") from exc
        finally:
            for pname, p in originals.items():
                m._parameters[pname] = p
        self._adopt_reassigned(m, fresh)
        for pname, p in fresh:
            if _unset(p):
                raise ValueError(self._unset_message("parameter", owner, pname, m))
        for bname, b in m._buffers.items():
            if b is not None and _unset(b):
                raise ValueError(self._unset_message("buffer", owner, bname, m))
        for _, p in fresh:
            with torch.no_grad():
                place(p)
            done.add(id(p))

    @staticmethod
    def _adopt_reassigned(m: torch.nn.Module, fresh) -> None:
        """An initialiser that assigned a new Parameter: copy its value into the original object."""
        for pname, p in fresh:
            now = m._parameters.get(pname)
            if now is not p and now is not None:
                with torch.no_grad():
                    p.data.copy_(now.detach().to(device=p.device, dtype=p.dtype))
                m._parameters[pname] = p

    def _unset_message(self, kind: str, owner: str, name: str, m: torch.nn.Module) -> str:
        how = "init_weights" if self.init_weights is not None else f"{type(m).__name__}.reset_parameters()"
        return (f"{kind} {name!r} of {owner} ({type(m).__name__}) was on the meta device and {how} did not set "
                f"it; make {how} initialise every parameter and buffer the module holds directly, or pass "
                "fully_shard(..., meta_init=MetaInit(init_weights=fn)) that does")

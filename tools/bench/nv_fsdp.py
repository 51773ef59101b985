"""NVIDIA's standalone ``megatron-fsdp`` package as a benchmark peer on CPU processes with gloo.

The package (0.6.1; ``pip install -e .[bench]``, docs/performance.md) is written for CUDA:
it asks ``torch.cuda`` for the current device and creates CUDA streams and events
unconditionally, validates its uneven DTensors through ``Tensor.cuda()``, and fuses the
gradient averaging into an NCCL-only ``ReduceOp.PREMUL_SUM``. It also prefers
megatron-core's classes when megatron-core is importable, and megatron-core 0.16.1's
``DistributedDataParallelConfig`` lacks fields the package passes. This benchmark shim,
not product code, makes it run without touching the package:

- ``cpu_peer()``: for the length of one run, megatron-core is hidden from imports (the
  package falls back to its own copies), ``torch.cuda.current_device`` answers 0, CUDA
  streams and events are no-ops (CPU kernels are synchronous and gloo work is waited on
  through its ``Work`` handles), and ``Tensor.cuda()`` returns the tensor; everything is
  restored on exit, so the other systems of the same worker process see plain torch.
- ``wrap()``: ``fully_shard`` on the benchmark model with ``device=cpu``, a CPU device
  mesh, its blocks as units, and ``gradient_reduce_div_fusion`` off (scale, then sum).

The package's optimizer wrapper runs one optimizer step with zero gradients at wrap time
(before the measured warm-up): it moves the Adam step count and applies one weight decay,
neither of which changes a step's time or memory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from typing import Iterator

import torch
import torch.distributed as dist

PACKAGE = "megatron_fsdp"
NOT_INSTALLED = "megatron-fsdp not installed (pip install -e .[bench])"


def available() -> bool:
    """Whether the package can be imported here (it is an optional benchmark extra)."""
    return importlib.util.find_spec(PACKAGE) is not None


class _Event:
    """A CUDA event that is always complete (a class: the package uses it in annotations)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _Stream:
    """A CUDA stream whose work is the host's: every wait and synchronisation is a no-op."""

    device = torch.device("cpu")

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_CURRENT = _Stream()
_CUDA_STUBS = {
    "current_device": lambda: 0,
    "Stream": _Stream,
    "Event": _Event,
    "current_stream": lambda device=None: _CURRENT,
    "default_stream": lambda device=None: _CURRENT,
    "stream": lambda stream=None: contextlib.nullcontext(),
    "synchronize": lambda device=None: None,
    "empty_cache": lambda: None,
}


@contextlib.contextmanager
def cpu_peer() -> Iterator[None]:
    """Megatron-core hidden and CUDA stubbed for the duration of one run; all restored after."""
    hidden = {name: module for name, module in sys.modules.items()
              if name == "megatron.core" or name.startswith("megatron.core.")}
    saved_cuda = {name: getattr(torch.cuda, name) for name in _CUDA_STUBS}
    saved_tensor_cuda = torch.Tensor.cuda
    for name in hidden:
        sys.modules[name] = None  # ``import megatron.core...`` raises ImportError: the package's own fallbacks
    sys.modules.setdefault("megatron.core", None)
    for name, stub in _CUDA_STUBS.items():
        setattr(torch.cuda, name, stub)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = saved_tensor_cuda
        for name, value in saved_cuda.items():
            setattr(torch.cuda, name, value)
        if sys.modules.get("megatron.core", 0) is None:
            del sys.modules["megatron.core"]
        sys.modules.update(hidden)


_MESHES = {}


def _mesh():
    """A (world, 1) CPU mesh named ("fsdp", "tp"), built once per process (no new groups per run)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world not in _MESHES:
        _MESHES[world] = init_device_mesh("cpu", (world, 1), mesh_dim_names=("fsdp", "tp"))
    return _MESHES[world]


def wrap(model: torch.nn.Module, level: str, bf16: bool, unit_class, optimizer: torch.optim.Optimizer):
    """(wrapped model, optimizer) of ``megatron_fsdp.fully_shard`` at ``level``; call inside ``cpu_peer()``.

    bf16: the model's weights in bf16 (its compute dtype), fp32 main weights, gradients
    and their reduction, the policy every other system of the benchmark gets.
    """
    import megatron_fsdp

    from tools.bench import measure as M

    M.COUNTER.install()  # the package may bind collectives at import
    policy = megatron_fsdp.MixedPrecisionPolicy(
        main_params_dtype=torch.float32, main_grads_dtype=torch.float32 if bf16 else None,
        grad_comm_dtype=torch.float32 if bf16 else None)
    if bf16:
        model = model.to(torch.bfloat16)
    wrapped, optimizer = megatron_fsdp.fully_shard(
        module=model, optimizer=optimizer, device_mesh=_mesh(), dp_shard_dim="fsdp", tp_dim="tp",
        fsdp_unit_modules=[unit_class], zero_dp_strategy=level, device=torch.device("cpu"),
        mixed_precision_policy=policy)
    wrapped.ddp_config.gradient_reduce_div_fusion = False  # gloo has no ReduceOp.PREMUL_SUM
    return wrapped, optimizer


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Global-norm clipping over sharded gradients: each rank's shard squared, summed over ranks.

    ``torch.nn.utils.clip_grad_norm_`` on the package's uneven DTensors is not relied on;
    the shards partition every gradient, so one all-reduce of the local sums is the norm.
    """
    grads = [getattr(p.grad, "_local_tensor", p.grad) for p in parameters if p.grad is not None]
    total = torch.zeros((), dtype=torch.float32)
    for g in grads:
        total += g.detach().float().pow(2).sum()
    dist.all_reduce(total)
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.detach().mul_(scale.to(g.dtype))
    return norm

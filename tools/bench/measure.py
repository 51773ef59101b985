"""Worker-side instruments shared by every system: step time, memory, collective bytes.

Every system in the benchmark (this project at each level, PyTorch FSDP2, Megatron-Core's
DDP, DistributedOptimizer and Megatron-FSDP v1) is measured by the code in this file, so
a difference in the table comes from the systems, not from the instruments:

- **Step time**: wall clock of one whole training step (forward, backward, optimizer step,
  zero grad) after a barrier, taken on every rank; the step's time is the slowest rank's.
- **Persistent memory**: bytes of the distinct tensor storages alive between two steps
  (after ``zero_grad``), found by walking the garbage collector's tensors (and their
  ``.grad``), minus those alive before the model was built. It does not depend on the
  allocator or on what a system says about itself.
- **CPU time**: user and system seconds of the whole process (every thread: compute,
  the engine's ring workers, gloo's I/O threads) during each step, from ``getrusage``. With
  more ranks than cores, or a core per rank, a step cannot take less wall time than the
  CPU it needs, so this says where a system's distance from the floor goes: kernel time
  (``sys``) is mostly the loopback sockets gloo moves every byte through.
- **Peak memory**: the process's resident-set high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs`` after warm-up) during the measured steps, minus the resident
  set before the model was built. It includes everything a step touches: activations,
  gathered weights, communication buffers, allocator slack. ``malloc_trim`` runs before
  both readings so memory freed by earlier runs in the same process is not counted.
- **Collective bytes**: a counter wrapped around the ``torch.distributed`` collective
  functions (rebound wherever a module holds a reference to one), with the engine
  ledger's convention: bytes of the full buffer a collective works on (all-gather
  output, reduce-scatter input, all-reduce tensor). Collectives on one-rank groups send
  nothing and are not counted. Point-to-point sends count as kind ``send`` (bytes sent).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import logging
import os
import resource
import sys
import threading
import time
import warnings
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

# torch.distributed function -> (kind, the argument whose bytes count)
_COLLECTIVES = {
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "_all_gather_base": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "all_gather_coalesced": ("all_gather", "output_tensor_lists"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "all_reduce": ("all_reduce", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors"),
    "broadcast": ("broadcast", "tensor"),
    "all_to_all_single": ("all_to_all", "input"),
    "all_to_all": ("all_to_all", "input_tensor_list"),
    "isend": ("send", "tensor"),  # point-to-point rings (this engine's gloo reduce-scatter)
    "send": ("send", "tensor"),
}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class CollectiveCounter:
    """Counts calls and bytes of every ``torch.distributed`` collective, by kind and group.

    Installed once per process (``install``); counts only while ``active``. A collective
    implemented by calling another (the deprecated names call the new ones) is counted
    once, at the outermost call. The axis of a collective is ``"world"`` when its group
    spans every rank, else ``"group<size>"``.
    """

    def __init__(self):
        self.active = False
        self._depth = threading.local()
        self.calls: Dict[str, Dict[str, int]] = {}
        self.bytes: Dict[str, Dict[str, int]] = {}
        self._originals: Dict[str, Callable] = {}

    def reset(self) -> None:
        self.calls, self.bytes = {}, {}

    def _record(self, kind: str, group, nbytes: int) -> None:
        size = dist.get_world_size(group)
        if size <= 1:
            return
        axis = "world" if size == dist.get_world_size() else f"group{size}"
        self.calls.setdefault(kind, {}).setdefault(axis, 0)
        self.calls[kind][axis] += 1
        self.bytes.setdefault(kind, {}).setdefault(axis, 0)
        self.bytes[kind][axis] += nbytes

    def _wrap(self, name: str, fn: Callable) -> Callable:
        kind, argument = _COLLECTIVES[name]
        signature = inspect.signature(inspect.unwrap(fn))
        counter = self

        def counted(*args, **kwargs):
            depth = getattr(counter._depth, "value", 0)
            if counter.active and depth == 0:
                try:
                    bound = signature.bind(*args, **kwargs).arguments
                except TypeError:  # a malformed call: let the collective itself raise
                    bound = None
                if bound is not None:
                    counter._record(kind, bound.get("group"), _nbytes(bound.get(argument)))
            counter._depth.value = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter._depth.value = depth

        return counted

    def install(self) -> None:
        """Replace the collectives in ``torch.distributed`` and every loaded module that bound one.

        Call it again after importing a library that binds collectives at import time
        (Megatron-Core keeps ``dist_all_gather_func``/``dist_reduce_scatter_func``).
        """
        from torch.distributed import distributed_c10d as c10d

        if not self._originals:
            for name in _COLLECTIVES:
                fn = getattr(c10d, name, None)
                if fn is not None:
                    self._originals[name] = fn
        wrapped = {id(fn): self._wrap(name, fn) for name, fn in self._originals.items()}
        by_id = {id(fn): fn for fn in self._originals.values()}
        for name, fn in self._originals.items():
            for owner in (c10d, dist):
                if getattr(owner, name, None) is fn:
                    setattr(owner, name, wrapped[id(fn)])
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not namespace or module in (c10d, dist):
                continue
            for attr, value in list(namespace.items()):
                if callable(value) and id(value) in by_id and value is by_id[id(value)]:
                    setattr(module, attr, wrapped[id(value)])

    @contextlib.contextmanager
    def counting(self):
        self.reset()
        self.active = True
        try:
            yield self
        finally:
            self.active = False


COUNTER = CollectiveCounter()


def prepare_worker(threads: int) -> None:
    """Threads per rank, and quiet libraries: the orchestrator's table is the output."""
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    for name in ("megatron", "megatron_fsdp", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)


@dataclasses.dataclass(frozen=True)
class WorkerSetting:
    """How a worker process is set up before it builds a system; what it sets stays for the process.

    ``threads`` per rank; ``upcast_bf16``: bf16 linears and attention through fp32 kernels
    (``bf16_support``), for CPUs that emulate bf16 matrix products; ``job_allocator``: the training
    job's allocator setting (``megatron.fsdp_training.allocator``): glibc's mmap threshold fixed and,
    unless ``trim`` is False, the heap trimmed after each unit's backward (``trim`` None: as
    ``job_allocator``).
    """

    threads: int
    upcast_bf16: bool = False
    job_allocator: bool = False
    trim: Optional[bool] = None

    @property
    def trims(self) -> bool:
        return self.job_allocator if self.trim is None else self.trim

    def apply(self) -> None:
        prepare_worker(self.threads)
        if self.job_allocator:  # the job's whole setting with the trim; its threshold alone without
            from megatron.fsdp_training.allocator import apply_job_setting, fix_mmap_threshold
            (apply_job_setting if self.trims else fix_mmap_threshold)()
        if self.upcast_bf16:
            from tools.bench.bf16_support import upcast_bf16_kernels
            upcast_bf16_kernels()


# ---------------------------------------------------------------- memory

def _proc_status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


@contextlib.contextmanager
def spawn_env(name: str, value: str):
    """``name=value`` in the environment while processes are spawned (a pool's ranks)."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def trim_heap() -> None:
    """Collect garbage and hand freed heap pages back to the OS (the job's ``allocator.trim_heap``)."""
    from megatron.fsdp_training.allocator import trim_heap as hand_back

    gc.collect()
    hand_back()


def rss_bytes() -> Optional[int]:
    kib = _proc_status_kib("VmRSS")
    return None if kib is None else kib * 1024


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> Optional[int]:
    kib = _proc_status_kib("VmHWM")
    return None if kib is None else kib * 1024


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the garbage collector can see (and their grads)."""
    gc.collect()
    seen: Dict[int, int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        try:
            tensors = (obj, obj.grad) if obj.is_leaf else (obj,)
        except RuntimeError:
            tensors = (obj,)
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            try:
                storage = t.untyped_storage()
                ptr, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, TypeError):
                continue  # wrapper subclasses (DTensor) own no storage; their local tensors are counted
            if ptr:
                seen[ptr] = max(seen.get(ptr, 0), size)
    return sum(seen.values())


def _local_storage(t: Optional[torch.Tensor]):
    """(data pointer, bytes) of a tensor's storage (a DTensor's local shard); None if it has none."""
    if t is None:
        return None
    local = getattr(t, "_local_tensor", t)  # DTensor: the shard this rank holds
    try:
        storage = local.untyped_storage()
    except (RuntimeError, TypeError):
        return None
    return (storage.data_ptr(), storage.nbytes()) if storage.data_ptr() else None


def persistent_breakdown(optimizer: "torch.optim.Optimizer", persistent: int) -> Dict[str, int]:
    """Split the persistent bytes into what the optimizer updates (weights), their gradients,
    the optimizer's state, and the rest (buffers, staging, caches), the same way for every system.

    Distinct storages only: a view into a flat buffer counts its whole storage once.
    """
    seen: Dict[int, str] = {}
    sizes: Dict[int, int] = {}
    tensors = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            tensors.append(("weights", p))
            tensors.append(("grads", p.grad))
            tensors.append(("grads", getattr(p, "decoupled_grad", None)))
            for value in optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    tensors.append(("state", value))
    for kind, t in tensors:
        found = _local_storage(t)
        if found is not None and found[0] not in seen:
            seen[found[0]], sizes[found[0]] = kind, found[1]
    out = {kind: sum(sizes[ptr] for ptr, k in seen.items() if k == kind) for kind in ("weights", "grads", "state")}
    out["other"] = persistent - sum(out.values())
    return out


# ---------------------------------------------------------------- one measured run

@dataclasses.dataclass
class Built:
    """A system ready to train: ``step()`` runs one whole training step.

    ``ledgers``: the engine's ledgers (this project only), reset after warm-up and read
    after the measured steps. ``own_report()``: the system's own account of its
    persistent bytes (``model.memory_report(optimizer).total``), compared with the
    independent measurement.
    """

    step: Callable[[], None]
    ledgers: Sequence = ()
    own_report: Optional[Callable[[], int]] = None
    optimizer: Optional[object] = None  # the torch optimizer, for ``persistent_breakdown``


def _ledger_figures(ledgers: Sequence, steps: int) -> dict:
    """Bytes (and wire bytes, where the ledger has them) per kind and axis per step."""
    out: Dict[str, Dict[str, Dict[str, float]]] = {"ledger_bytes": {}, "ledger_calls": {}}
    wire = all(hasattr(ledger, "wire_bytes") for ledger in ledgers)
    if wire:
        out["wire_bytes"] = {}
    for ledger in ledgers:
        for (kind, axis), (calls, nbytes) in ledger.summary().items():
            values = {"ledger_bytes": nbytes, "ledger_calls": calls}
            if wire:
                values["wire_bytes"] = ledger.wire_bytes(kind, axis)
            for key, value in values.items():
                table = out[key].setdefault(kind, {})
                table[axis] = table.get(axis, 0) + value / steps
    return out


def measure(built: Built, warmup: int, steps: int, baseline_tensors: int, baseline_rss: Optional[int]) -> dict:
    """Run ``warmup`` then ``steps`` training steps of ``built``; return this rank's measurements.

    ``baseline_*`` were read (``baselines()``) before the model was built.
    """
    for _ in range(warmup):
        built.step()
    persistent = live_tensor_bytes() - baseline_tensors
    own = built.own_report() if built.own_report is not None else None
    breakdown = persistent_breakdown(built.optimizer, persistent) if built.optimizer is not None else None
    for ledger in built.ledgers:
        ledger.reset()
    trim_heap()
    peak_ok = reset_peak_rss()
    times: List[float] = []
    cpu_user: List[float] = []
    cpu_sys: List[float] = []
    with COUNTER.counting():
        for _ in range(steps):
            dist.barrier()
            before = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            built.step()
            times.append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_SELF)
            cpu_user.append(after.ru_utime - before.ru_utime)
            cpu_sys.append(after.ru_stime - before.ru_stime)
        calls = {k: dict(v) for k, v in COUNTER.calls.items()}
        counted = {k: dict(v) for k, v in COUNTER.bytes.items()}
    peak = peak_rss_bytes() if peak_ok else None
    out = {
        "times": times,
        "cpu_user": cpu_user,
        "cpu_sys": cpu_sys,
        "persistent_bytes": persistent,
        "own_persistent_bytes": own,
        "persistent_breakdown": breakdown,
        "peak_bytes": None if peak is None or baseline_rss is None else peak - baseline_rss,
        "counted_calls": {k: {a: n / steps for a, n in v.items()} for k, v in calls.items()},
        "counted_bytes": {k: {a: n / steps for a, n in v.items()} for k, v in counted.items()},
    }
    if built.ledgers:
        out.update(_ledger_figures(built.ledgers, steps))
    return out


def baselines() -> tuple:
    """(live tensor bytes, resident bytes) before a model is built, after trimming the heap."""
    trim_heap()
    return live_tensor_bytes(), rss_bytes()

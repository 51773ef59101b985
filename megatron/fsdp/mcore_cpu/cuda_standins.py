"""CPU mode: run Megatron-Core (0.16.1 to 0.19) on CPU processes with gloo, without editing its files.

Megatron-Core assumes CUDA in many small places; this module is the one place that
bridges them, so the engine (``megatron/fsdp``) never needs any of it. Every entry
point is a no-op when ``torch.cuda.is_available()``. ``enable_cpu_mode(seed)``, called
after ``parallel_state.initialize_model_parallel``, warns once per process and installs:

1. ``parallel_state._GLOBAL_MEMORY_BUFFER`` on the CPU: the stock one allocates on
   ``torch.cuda.current_device()`` (attention scratch, sequence-parallel gathers).
   It belongs to the parallel state (``destroy_model_parallel`` drops it), so it is
   replaced on every call and never restored.
2. ``tensor_parallel.random``: a tracker of CPU generator states and CPU
   ``_get/_set_cuda_rng_state``. Megatron forks the CUDA generator for dropout in
   TP regions and for activation recompute; seeds follow
   ``model_parallel_cuda_manual_seed`` (``seed``, ``seed + 2718 + tp_rank``,
   ``seed + 1024 + 100 * ep_rank + etp_rank``), so TP ranks get distinct streams.
3. MoE: ``moe_utils.te_general_gemm`` is only bound when Transformer Engine imports
   (NameError in the router); the all-to-all dispatcher creates a CUDA stream and
   turns split sizes into host lists only for CUDA tensors.
   Multi-latent attention's YaRN RoPE builds its tables on ``torch.cuda.current_device()``:
   it is built with ``use_cpu_initialization``; its ``isinstance(..., TELinear)`` checks run
   when the Transformer Engine extension imports without Transformer Engine (``TELinear`` is None).
4. ``grouped_gemm_util`` (Megatron-Core 0.16.1's legacy ``GroupedMLP``): a per-expert matmul loop for the
   CUDA-only ``grouped_gemm``. Selective recompute without Transformer Engine: no FP8 path, and (0.17+) the
   discarded outputs refilled by a copy instead of a kernel compiled at run time.
5. ``schedules.deallocate_output_tensor`` keeps the old storage referenced from the
   output tensor. With ``overlap_p2p_comm`` (Megatron-LM's default under
   interleaving) the send is still in flight when the schedule swaps the storage
   out, and gloo reads it when it really sends: the next stage got freed memory (NaN
   gradients). The tensor is held until its backward, which needs the peer's
   gradient for it, so the send is done by then. (NCCL is safe by stream order.)
6. ``torch.cuda.{current_device, current_stream, default_stream, stream,
   synchronize, Stream, Event}`` -> device 0 and inert stand-ins (a CPU build raises
   on all of them); ``torch.cuda.is_available`` is left alone.
7. ``_CudaToCpu``, a ``TorchFunctionMode`` on the calling thread: ``cuda``/``cuda:N``/
   integer devices become ``cpu``, ``Tensor.cuda()`` and ``Tensor.pin_memory()`` are the identity,
   ``pin_memory=True`` is dropped (RoPE's context-parallel slicing asks for it) and
   ``Tensor.type()`` says ``torch.cuda.*Tensor`` for CPU tensors (``clip_grads`` and
   ``DistributedOptimizer`` assert on it). Sequence parallel, the MoE router,
   schedules, p2p, DDP buffers and the optimizers allocate with ``device="cuda"``.

6 and 7 are process-global. ``disable_cpu_mode()`` undoes 2-7: a long-lived process
with other work after a Megatron case should call it, since the mode intercepts every
torch call on its thread and rewrites ``Tensor.type()``. Enabling again is fine.

The CPU model parts (``cpu_layer_spec``, ``SDPACoreAttention``, ``CpuNorm``) live in
``layer_spec.py`` and are re-exported here.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import types
import warnings
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.utils import GlobalMemoryBuffer

from megatron.fsdp import mcore_releases as compat
from .patch_record import Patches

__all__ = [
    "CpuModeWarning", "CpuNorm", "SDPACoreAttention", "cpu_layer_spec", "cpu_mode_enabled", "cpu_mtp_block_spec",
    "disable_cpu_mode", "enable_cpu_mode", "model_parallel_manual_seed",
]

logger = logging.getLogger(__name__)


class CpuModeWarning(UserWarning):
    """Emitted once per process when CPU mode is first enabled (filterable by category)."""


_PATCHES = Patches()
_MODE: Optional["_CudaToCpu"] = None
_ANNOUNCED = False


def _announce() -> None:
    global _ANNOUNCED
    if not _ANNOUNCED:
        _ANNOUNCED = True
        message = ("Megatron-Core CPU mode is on: CUDA calls are redirected to CPU "
                   "(see megatron.fsdp.mcore_cpu.cuda_standins for the list of patches)")
        warnings.warn(message, CpuModeWarning, stacklevel=3)
        logger.info(message)


class _CpuMemoryBuffer(GlobalMemoryBuffer):
    """GlobalMemoryBuffer whose scratch tensors live on the CPU."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        numel = math.prod(tensor_shape)
        key = (name, dtype)
        buffer = self.buffer.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self.buffer[key] = torch.empty(numel, dtype=dtype)
        return buffer[:numel].view(*tensor_shape)


class _CpuRngTracker(tp_random.CudaRNGStatesTracker):
    """Megatron's named RNG streams as states of the CPU default generator, which on CPU is
    also the "CUDA" one: ``fork`` swaps its state in and out (the stock tracker warns on that)."""

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)

    @contextlib.contextmanager
    def fork(self, name=tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer_state, outer_name = torch.get_rng_state(), self._current_state_name
        if outer_name != "default-rng":
            self.states_[outer_name] = outer_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if outer_name != "default-rng":
                outer_state = self.states_[outer_name]
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name


def model_parallel_manual_seed(seed: int) -> None:
    """CPU ``tensor_parallel.model_parallel_cuda_manual_seed`` (same offsets): seeds the default
    generator with ``seed`` and installs a fresh tracker. No-op with CUDA (use Megatron's)."""
    if torch.cuda.is_available():
        return
    _PATCHES.set(tp_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state())
    _PATCHES.set(tp_random, "_set_cuda_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state))
    tracker = _CpuRngTracker()
    _PATCHES.set(tp_random, "_CUDA_RNG_STATE_TRACKER", tracker)
    _PATCHES.set(tp_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    torch.manual_seed(seed)
    tracker.add(tp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME,
                seed + 2718 + parallel_state.get_tensor_model_parallel_rank())
    tracker.add(tp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME,
                seed + 1024 + 100 * parallel_state.get_expert_model_parallel_rank()
                + parallel_state.get_expert_tensor_parallel_rank())


class _Inert:
    """torch.cuda.Stream and torch.cuda.Event on CPU, where work is synchronous: nothing to wait for."""

    def __init__(self, *args, **kwargs): ...
    def wait_stream(self, other): ...
    def wait_event(self, event): ...
    def wait(self, stream=None): ...
    def record(self, stream=None): ...
    def synchronize(self): ...
    def query(self): return True
    def elapsed_time(self, other): return 0.0
    def record_event(self, event=None): return event if event is not None else _Inert()


_NULL_STREAM = _Inert()


def _host_split_sizes(tensor, as_numpy=False, record_stream=False):
    """maybe_move_tensor_to_cpu that also converts CPU tensors (the dispatcher needs host lists)."""
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        if as_numpy:
            tensor = tensor.numpy()
    return tensor


def _loop_gmm(a, b, batch_sizes, trans_b=False):
    """grouped_gemm.ops.gmm: rows of ``a`` in consecutive per-expert groups times each expert's weight."""
    pieces = torch.split(a, batch_sizes.tolist())
    return torch.cat([x @ (w.t() if trans_b else w) for x, w in zip(pieces, b)])


def _patch_moe() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        _PATCHES.set(moe_utils, "te_general_gemm", None)
    _PATCHES.set(token_dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", _NULL_STREAM)
    _PATCHES.set(token_dispatcher, "maybe_move_tensor_to_cpu", _host_split_sizes)
    grouped_gemm_util = compat.grouped_gemm_util()  # None from 0.17.0 (no legacy GroupedMLP)
    if grouped_gemm_util is not None and grouped_gemm_util.grouped_gemm is None:
        stand_in = types.SimpleNamespace(ops=types.SimpleNamespace(gmm=_loop_gmm))
        _PATCHES.set(grouped_gemm_util, "grouped_gemm", stand_in)
        _PATCHES.set(grouped_gemm_util, "ops", stand_in.ops)


def _patch_mla() -> None:
    """Multi-latent attention builds its YaRN RoPE without ``use_cpu_initialization``, so the rotary
    tables go to ``torch.device(torch.cuda.current_device())``, which a CPU build refuses to enter."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):  # no Transformer Engine: its classes are None
        _PATCHES.set(multi_latent_attention, "HAVE_TE", False)
    init = YarnRotaryEmbedding.__init__
    if getattr(init, "_cpu_mode", False):
        return

    def init_on_cpu(self, *args, **kwargs):
        kwargs["use_cpu_initialization"] = True
        init(self, *args, **kwargs)

    init_on_cpu._cpu_mode = True
    _PATCHES.set(YarnRotaryEmbedding, "__init__", init_on_cpu)


def _patch_recompute_without_te() -> None:
    """Selective recompute (``--recompute-modules layernorm mla_up_proj ...``) without Transformer Engine.

    ``CheckpointWithoutOutput(fp8=...)`` stores ``fp8 is not None``, and multi-latent attention passes
    ``config.fp8 or config.fp4`` (``False`` when neither is set), so its up-projection recompute takes the
    FP8 path and calls Transformer Engine's ``FP8GlobalStateManager``, undefined without it. Without
    Transformer Engine there is no FP8: the flag is cleared.
    """
    from megatron.core.tensor_parallel import random as mcore_random

    if mcore_random.HAVE_TE or getattr(mcore_random.CheckpointWithoutOutput.__init__, "_cpu_mode", False):
        return
    init = mcore_random.CheckpointWithoutOutput.__init__

    def init_without_fp8(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.fp8 = False

    init_without_fp8._cpu_mode = True
    _PATCHES.set(mcore_random.CheckpointWithoutOutput, "__init__", init_without_fp8)


def _share_storage_by_copy(output: torch.Tensor, recomputed: torch.Tensor) -> None:
    """The recomputed values into the storage a discarded output kept (resized to nothing), for every view of it."""
    storage = output.untyped_storage()
    storage.resize_(recomputed.untyped_storage().nbytes())
    storage.copy_(recomputed.untyped_storage())


def _patch_recompute_storage_share() -> None:
    """Selective recompute's discarded outputs (``CheckpointWithoutOutput``) refilled by a copy, not a compiled kernel.

    From 0.17 Megatron-Core points the discarded output's storage at the recomputed one with a C++ extension it
    compiles at run time (``load_inline``): it needs a compiler, and takes ~20 s of one core the first time a
    process uses it and again whenever the build's paths change (another checkout, another environment). On CPU
    the copy into the same storage, 0.16.1's own way, gives every view of it the same values.
    """
    from megatron.core.tensor_parallel import random as mcore_random

    if hasattr(mcore_random, "_get_share_storage"):
        _PATCHES.set(mcore_random, "_get_share_storage", lambda: _share_storage_by_copy)


def _patch_schedules() -> None:
    from megatron.core.pipeline_parallel import schedules

    if getattr(schedules.deallocate_output_tensor, "_cpu_mode", False):
        return
    deallocate = schedules.deallocate_output_tensor

    def deallocate_after_send(out, deallocate_pipeline_outputs=False):
        """Megatron's pseudo-deallocation (custom_backward asserts on it), but the old storage
        stays referenced from ``out`` so an asynchronous gloo send can still read it."""
        sent = out.data if torch.is_tensor(out) and deallocate_pipeline_outputs else None
        deallocate(out, deallocate_pipeline_outputs)
        if sent is not None:
            out._cpu_mode_sent_storage = sent

    deallocate_after_send._cpu_mode = True
    _PATCHES.set(schedules, "deallocate_output_tensor", deallocate_after_send)


def _names_cuda(device) -> bool:
    # An int is an index from torch.cuda.current_device().
    return ((isinstance(device, int) and not isinstance(device, bool))
            or (isinstance(device, str) and device.startswith("cuda"))
            or (isinstance(device, torch.device) and device.type == "cuda"))


_BACKWARDS = {torch.Tensor.backward: inspect.signature(torch.Tensor.backward),
              torch.autograd.backward: inspect.signature(torch.autograd.backward)}


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device requests to CPU for every torch call on this thread."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BACKWARDS:
            return self._backward(func, args, kwargs)
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if "device" in kwargs and _names_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):  # no pinned allocator without an accelerator (RoPE under CP asks for one)
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1 and _names_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        elif func is torch.Tensor.type:
            if len(args) == 1 and not kwargs:
                name = func(*args)
                return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
            if len(args) > 1 and isinstance(args[1], str):
                args = (args[0], args[1].replace("torch.cuda.", "torch."), *args[2:])
        return func(*args, **kwargs)

    def _backward(self, func, args, kwargs):
        """Run the autograd engine as torch.autograd.backward does, with this mode pushed: torch
        pops a mode while its handler runs, so ``func`` would run the backward pass (DDP hooks,
        custom Functions allocating on "cuda") without it, and re-pushed it would recurse."""
        from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
        from torch.autograd.graph import _engine_run_backward

        bound = _BACKWARDS[func].bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if func is torch.Tensor.backward:
            tensors, grads = (a["self"],), a["gradient"]
        else:
            tensors = a["tensors"]
            tensors = (tensors,) if torch.is_tensor(tensors) else tuple(tensors)
            grads = a["grad_tensors"] if a["grad_tensors"] is not None else a["grad_variables"]
        inputs = a["inputs"]
        inputs = () if inputs is None else (inputs,) if torch.is_tensor(inputs) else tuple(inputs)
        create_graph = bool(a["create_graph"])
        retain_graph = create_graph if a["retain_graph"] is None else a["retain_graph"]
        with self:
            grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grads, len(tensors)),
                                is_grads_batched=False)
            _engine_run_backward(tensors, grads, retain_graph, create_graph, inputs,
                                 allow_unreachable=True, accumulate_grad=True)


def _mode_pushed() -> bool:
    return _MODE is not None and any(m is _MODE for m in _get_current_function_mode_stack())


def _redirect_cuda_to_cpu() -> None:
    global _MODE
    cuda = torch.cuda
    _PATCHES.set(cuda, "current_device", lambda: 0)
    _PATCHES.set(cuda, "current_stream", lambda device=None: _NULL_STREAM)
    _PATCHES.set(cuda, "default_stream", lambda device=None: _NULL_STREAM)
    _PATCHES.set(cuda, "stream", lambda stream=None: contextlib.nullcontext())
    _PATCHES.set(cuda, "synchronize", lambda device=None: None)
    _PATCHES.set(cuda, "Stream", _Inert)
    _PATCHES.set(cuda, "Event", _Inert)
    if not _mode_pushed():
        _MODE = _CudaToCpu()
        _MODE.__enter__()


# ---------------------------------------------------------------- public switches

def enable_cpu_mode(seed: int) -> None:
    """Install CPU mode (patches 1-7 of the module docstring) and seed the RNG streams.

    Call after ``parallel_state.initialize_model_parallel``: the memory buffer is that
    parallel state's and the tracker seeds depend on the TP/EP ranks. Idempotent: a
    second call re-creates the buffer and re-seeds, nothing is patched twice. The
    redirection applies to the calling thread. No-op when CUDA is available.
    """
    if torch.cuda.is_available():
        return
    _announce()
    parallel_state._GLOBAL_MEMORY_BUFFER = _CpuMemoryBuffer()
    model_parallel_manual_seed(seed)
    _patch_moe()
    _patch_mla()
    _patch_recompute_without_te()
    _patch_recompute_storage_share()
    _patch_schedules()
    _redirect_cuda_to_cpu()


def disable_cpu_mode() -> None:
    """Undo ``enable_cpu_mode`` (the memory buffer stays with the parallel state).

    Raises if another TorchFunctionMode was pushed after CPU mode and is still active,
    since popping out of order would remove the wrong mode. No-op when not enabled.
    """
    global _MODE
    if _mode_pushed():
        stack = _get_current_function_mode_stack()
        if stack[-1] is not _MODE:
            raise RuntimeError("disable_cpu_mode: a TorchFunctionMode pushed after CPU mode is "
                               f"still active ({type(stack[-1]).__name__}); exit it first")
        _MODE.__exit__(None, None, None)
    _MODE = None
    _PATCHES.restore()


def cpu_mode_enabled() -> bool:
    """True while the cuda->cpu redirection is active on this thread."""
    return _mode_pushed()


# The CPU model parts, kept importable from here.
from .layer_spec import (  # noqa: E402,F401
    CpuNorm, SDPACoreAttention, _AllGatherSequence, _load_balanced_positions, cpu_layer_spec, cpu_mtp_block_spec,
)

"""CPU mode for Megatron-LM's trainer (``megatron.training``, shipped in the megatron-core wheel from 0.17).

``cuda_standins.py`` makes Megatron-Core's model code run on CPU processes; the trainer around it assumes
CUDA in a few more places, each bridged here (no-op when ``torch.cuda.is_available()``):

- ``initialize_megatron`` asserts CUDA unless ``allow_no_cuda``, which ``pretrain()`` cannot pass;
- ``_initialize_distributed`` builds the model-parallel groups only when ``torch.cuda.device_count() > 0``
  and initialises ``--distributed-backend`` (NCCL by default): here torch.distributed starts on gloo and
  the groups are built as on a GPU;
- ``_set_random_seed`` seeds the model-parallel CUDA RNG tracker only with a GPU: here CPU mode starts
  right after it (``enable_cpu_mode``, the same seed as Megatron's ``model_parallel_cuda_manual_seed``);
- argument validation asks ``get_device_arch_version()`` (TP or CP > 1, Megatron-FSDP): 0, no GPU; and with
  TP or CP > 1 it asserts ``CUDA_DEVICE_MAX_CONNECTIONS=1`` without FSDP (CUDA stream order), set then when unset;
- the rerun state machine and checkpoints save ``torch.cuda.get_rng_state()``: a CPU generator
  stands for the device's, so its state is saved and restored like the device's would be.

Megatron-Bridge's trainer (``megatron.bridge.training``) initialises through its own module with the same
assumptions (``install_bridge``): ``initialize_megatron`` asserts CUDA, ``_set_random_seed`` seeds no RNG tracker
without a GPU, and its default ``distributed_backend="nccl"`` refuses to build groups without one (gloo instead,
said once). ``compile_helpers`` is not CPU-specific: see ``patch_record.py``.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import warnings

import torch
import torch.distributed as dist

from .patch_record import PATCHES, once

# Stands for the device generator on a machine without one: saved and restored with checkpoints.
_DEVICE_GENERATOR = torch.Generator()


def print_once(message: str) -> None:
    """One line from rank 0 (or the only process), once per process."""
    _print_once(message)


@functools.lru_cache(maxsize=None)
def _print_once(message: str) -> None:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(message, flush=True)


def _device_rng_state(device="cuda") -> torch.Tensor:
    return _DEVICE_GENERATOR.get_state()


def _set_device_rng_state(state, device="cuda") -> None:
    _DEVICE_GENERATOR.set_state(state.to("cpu", torch.uint8) if isinstance(state, torch.Tensor) else state)


def start_gloo(rank: int, world_size: int, timeout_minutes: float) -> None:
    """torch.distributed on gloo (the trainers' own init would ask for NCCL)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(minutes=timeout_minutes))


def enable_after_seeding(seed: int) -> None:
    """CPU mode once the model-parallel groups exist (their ranks seed the RNG streams); said once, by rank 0."""
    from .cuda_standins import CpuModeWarning, enable_cpu_mode

    cpu_mode_log = logging.getLogger("megatron.fsdp.mcore_cpu.cuda_standins")
    level = cpu_mode_log.level
    with warnings.catch_warnings():  # said once below, by rank 0, instead of once per process
        warnings.simplefilter("ignore", CpuModeWarning)
        cpu_mode_log.setLevel(logging.WARNING)
        try:
            enable_cpu_mode(seed)
        finally:
            cpu_mode_log.setLevel(level)
    print_once("> no CUDA device: running the trainer on CPU with gloo (Megatron-Core CPU mode on)")


def megatron_seed(seed: int, data_parallel_random_init: bool, pp_rank: int, dp_rank: int) -> int:
    """The seed both trainers' ``_set_random_seed`` give this rank's generators."""
    return seed + 100 * pp_rank + (10 * dp_rank if data_parallel_random_init else 0)


def _allow_no_cuda(original):
    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)
    return initialize_megatron


def patch_device_queries() -> None:
    """What any trainer on CPU needs: a device RNG state, an architecture number, no device count."""
    PATCHES.set(torch.cuda, "get_rng_state", _device_rng_state)
    PATCHES.set(torch.cuda, "set_rng_state", _set_device_rng_state)
    import megatron.core.utils as core_utils

    if hasattr(core_utils, "get_device_arch_version"):
        PATCHES.set(core_utils, "get_device_arch_version", lambda: 0)


def install_megatron_training() -> None:
    """Bridge ``megatron.training`` to CPU (see the module docstring). Idempotent; no-op with CUDA."""
    if torch.cuda.is_available() or not once("trainer_bridges.megatron_training"):
        return
    from megatron.training import arguments, initialize, training
    from megatron.training import utils as training_utils

    patch_device_queries()
    original_validate = arguments.validate_args

    @functools.wraps(original_validate)
    def validate_args(args, *rest, **kwargs):
        # Asked for with TP or CP > 1 before Blackwell (kernel order on CUDA streams; FSDP asks for the opposite).
        if (args.tensor_model_parallel_size > 1 or args.context_parallel_size > 1) and not (
                args.use_megatron_fsdp or args.use_torch_fsdp2):
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        return original_validate(args, *rest, **kwargs)

    PATCHES.set(arguments, "validate_args", validate_args)
    for module in (arguments, training_utils):
        if hasattr(module, "get_device_arch_version"):
            PATCHES.set(module, "get_device_arch_version", lambda: 0)

    initialize_megatron = _allow_no_cuda(initialize.initialize_megatron)
    for module in (initialize, training):
        if hasattr(module, "initialize_megatron"):
            PATCHES.set(module, "initialize_megatron", initialize_megatron)

    original_distributed = initialize._initialize_distributed

    @functools.wraps(original_distributed)
    def initialize_distributed(*args, **kwargs):
        from megatron.training import get_args

        margs = get_args()
        start_gloo(margs.rank, margs.world_size, margs.distributed_timeout_minutes)
        with PATCHES.temporarily(torch.cuda, "device_count", lambda: 1):
            return original_distributed(*args, **kwargs)

    PATCHES.set(initialize, "_initialize_distributed", initialize_distributed)

    original_seed = initialize._set_random_seed

    @functools.wraps(original_seed)
    def set_random_seed(seed_, data_parallel_random_init=False, *args, **kwargs):
        from megatron.core import parallel_state as ps

        original_seed(seed_, data_parallel_random_init, *args, **kwargs)
        enable_after_seeding(megatron_seed(seed_, data_parallel_random_init, ps.get_pipeline_model_parallel_rank(),
                                           ps.get_data_parallel_rank()))

    PATCHES.set(initialize, "_set_random_seed", set_random_seed)


def install_bridge() -> None:
    """Bridge Megatron-Bridge's trainer to CPU (see the module docstring). Idempotent; no-op with CUDA."""
    if torch.cuda.is_available() or not once("trainer_bridges.bridge"):
        return
    from megatron.bridge.training import initialize, setup

    patch_device_queries()
    initialize_megatron = _allow_no_cuda(initialize.initialize_megatron)
    for module in (initialize, setup):
        PATCHES.set(module, "initialize_megatron", initialize_megatron)

    original_distributed = initialize._initialize_distributed

    @functools.wraps(original_distributed)
    def initialize_distributed(model_config, dist_config, *args, **kwargs):
        if dist_config.distributed_backend == "nccl":
            print_once("> no CUDA device: DistributedInitConfig.distributed_backend 'nccl' -> 'gloo'")
            dist_config.distributed_backend = "gloo"
        return original_distributed(model_config, dist_config, *args, **kwargs)

    PATCHES.set(initialize, "_initialize_distributed", initialize_distributed)

    original_seed = initialize._set_random_seed

    @functools.wraps(original_seed)
    def set_random_seed(seed_, data_parallel_random_init=False, *args, pg_collection, **kwargs):
        original_seed(seed_, data_parallel_random_init, *args, pg_collection=pg_collection, **kwargs)
        rank = dist.get_rank()
        enable_after_seeding(megatron_seed(seed_, data_parallel_random_init,
                                           dist.get_group_rank(pg_collection.pp, rank),
                                           dist.get_group_rank(pg_collection.dp, rank)))

    PATCHES.set(initialize, "_set_random_seed", set_random_seed)

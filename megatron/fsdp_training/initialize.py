"""Process groups, device, Megatron-Core parallel state, CPU mode and seeds."""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from .allocator import apply_job_setting
from .parallel_config import ParallelConfig

logger = logging.getLogger("megatron.fsdp_training")


def launch_world_size() -> int:
    """The world size the arguments are validated against: the process group's, else the launcher's."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def gloo_twin_groups(disabled: bool = False) -> bool:
    """Whether Megatron-Core creates (and its optimizer uses) a gloo twin of every process group.

    On a GPU the twins are the CPU-side copies of the NCCL groups that Megatron-Core's
    optimizer and checkpointing may use. On CPU every group is gloo already: a twin
    would double the ~50 groups ``initialize_model_parallel`` creates (and their
    threads) for nothing. ``disabled``: ``--disable-gloo-process-groups``. One rule for the job
    and the tests' Megatron-Core set-ups.
    """
    return torch.cuda.is_available() and not disabled


def initialize(parallel: ParallelConfig, seed: int) -> torch.device:
    """Start everything for arguments already validated (against ``launch_world_size()``); returns the device.

    Validation runs before the process group exists, so a bad argument set stops
    every rank with the same message and nothing waits on a collective.
    """
    apply_job_setting()  # before anything large is allocated (allocator.py says why)
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        import datetime

        dist.init_process_group("nccl" if cuda else "gloo",
                                timeout=datetime.timedelta(minutes=parallel.distributed_timeout_minutes))
    from megatron.core import parallel_state as ps, tensor_parallel

    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        num_distributed_optimizer_instances=parallel.num_distributed_optimizer_instances,
        distributed_timeout_minutes=parallel.distributed_timeout_minutes,
        create_gloo_process_groups=gloo_twin_groups(parallel.disable_gloo_process_groups),
    )
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return torch.device("cuda", torch.cuda.current_device())
    import warnings

    from megatron.fsdp.mcore_cpu.cuda_standins import CpuModeWarning, enable_cpu_mode

    with warnings.catch_warnings():  # said once below, by rank 0, instead of once per process
        warnings.simplefilter("ignore", CpuModeWarning)
        enable_cpu_mode(seed)
    if dist.get_rank() == 0:
        print("> no CUDA device: running on CPU with gloo (Megatron-Core CPU mode on)", flush=True)
    return torch.device("cpu")


def shutdown() -> None:
    """Wait for the engine's in-flight collectives and ring workers, then destroy the groups."""
    from megatron.core import parallel_state as ps

    import megatron.fsdp

    megatron.fsdp.shutdown()
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

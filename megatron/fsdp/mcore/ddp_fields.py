"""Megatron-Core's ``DistributedDataParallelConfig`` fields under this backend: each honoured, substituted with
one line, or refused with one line.

Every trainer reaches Megatron-FSDP through this config (Megatron-LM's ``get_megatron_ddp_config`` fills it from
``--megatron-fsdp-*`` / ``--fsdp-*`` / ``--use-nccl-ub``; Bridge's ``cfg.ddp`` is one), so this is where a flag
the engine does not implement as asked is said. Honoured elsewhere in the adapter: the levels and instances
(``data_parallel.py``), ``fsdp_double_buffer`` and ``megatron_fsdp_max_pool_double_buffer`` (persistent gather
buffers), ``megatron_fsdp_main_params_dtype`` / ``megatron_fsdp_grad_comm_dtype`` (``mixed_precision``),
``suggested_communication_unit_size`` (``overlap.py``), ``fp8_param_gather`` (``fp8_gather.py``),
``overlap_grad_reduce`` / ``overlap_param_gather`` (the engine always overlaps per unit), ``check_for_nan_in_grad``.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch

# (field, what the engine does instead): asked for, the run goes on and one line says so.
SUBSTITUTED: Tuple[Tuple[str, str], ...] = (
    ("nccl_ub", "no NCCL user-buffer registration (megatron.fsdp registers none; gloo has none)"),
    ("fsdp_manual_registration", "no NCCL user-buffer registration (megatron.fsdp registers none)"),
    ("disable_symmetric_registration", "nothing to disable (megatron.fsdp registers no symmetric memory)"),
    ("fsdp_db_use_persist_buf_on_alloc_fail", "the double buffer is sized to each group's largest unit up front"),
    ("megatron_fsdp_enable_fine_grained_param_gather", "one gather per unit, the next unit prefetched"),
    ("bucket_size", "per-unit collectives (Megatron's buckets tune its own flat buffers)"),
    ("pad_buckets_for_high_nccl_busbw", "per-unit collectives (Megatron's buckets tune its own flat buffers)"),
    ("align_param_gather", "per-unit gathers in each unit's pre-forward hook"),
    ("check_for_large_grads", "no large-gradient check (check_for_nan_in_grad is honoured)"),
)
# (field, why it cannot run here, the fix): refused before any collective.
REFUSED: Tuple[Tuple[str, str], ...] = (
    ("megatron_fsdp_cuda_graph_mode", "CUDA graphs are not supported by megatron.fsdp: --cuda-graph-impl none"),
    ("delay_wgrad_compute", "delayed weight-gradient compute is not supported by megatron.fsdp: leave it off"),
)
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _default(ddp_config, field: str):
    spec = type(ddp_config).__dataclass_fields__[field]
    return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default


def _asked(ddp_config, field: str) -> bool:
    if field not in getattr(type(ddp_config), "__dataclass_fields__", {}):
        return False  # a release without it
    return getattr(ddp_config, field) != _default(ddp_config, field)


def trainer_bucket_size(dp_size: int) -> int:
    """The ``bucket_size`` Megatron-LM's and Bridge's ``_ddp_wrap`` set themselves when none was given."""
    return max(40000000, 1000000 * dp_size)


def substitutions(ddp_config, dp_size: int = 1) -> List[str]:
    """One line per field asked for that this backend does differently (the trainers' own bucket size is not
    the user's ask, and says nothing)."""
    return [f"megatron.fsdp: DistributedDataParallelConfig.{field}={getattr(ddp_config, field)!r}: {instead}"
            for field, instead in SUBSTITUTED if _asked(ddp_config, field)
            and not (field == "bucket_size" and ddp_config.bucket_size == trainer_bucket_size(dp_size))]


def refusal(ddp_config) -> Optional[str]:
    for field, why in REFUSED:
        if _asked(ddp_config, field):
            return f"DistributedDataParallelConfig.{field}={getattr(ddp_config, field)!r}: {why}"
    grads = getattr(ddp_config, "megatron_fsdp_main_grads_dtype", None)
    if grads not in (None, torch.float32):
        return (f"DistributedDataParallelConfig.megatron_fsdp_main_grads_dtype={_DTYPES.get(grads, grads)}: "
                "megatron.fsdp keeps main gradients in another dtype through the precision-aware optimizer: "
                "--use-precision-aware-optimizer --main-grads-dtype bf16 (OptimizerConfig) instead")
    comm = getattr(ddp_config, "megatron_fsdp_grad_comm_dtype", None)
    if comm == torch.float16:
        return ("DistributedDataParallelConfig.megatron_fsdp_grad_comm_dtype=fp16: megatron.fsdp trains in bf16 or "
                "fp32 (no fp16 loss scaling); use bf16")
    return None


def grad_comm_dtype(ddp_config, compute: torch.dtype) -> torch.dtype:
    """The dtype gradients are reduced in: ``megatron_fsdp_grad_comm_dtype`` when set, else fp32 under
    ``grad_reduce_in_fp32`` and the compute dtype otherwise (Megatron-Core's rule)."""
    comm = getattr(ddp_config, "megatron_fsdp_grad_comm_dtype", None)
    if comm is not None:
        return comm
    return torch.float32 if ddp_config.grad_reduce_in_fp32 else compute

"""Megatron-shaped log lines, memory per rank, the start-up summary (scalar writers: writers.py)."""

from __future__ import annotations

import os
import resource
import sys
from typing import Dict, Optional

import torch
import torch.distributed as dist


def print_rank_0(message: str) -> None:
    """Print on global rank 0; before the process group exists (start-up errors) torchrun's RANK says which."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(message, flush=True)


def memory_mib() -> Dict[str, float]:
    """Allocated and peak memory of this rank (CUDA memory on a GPU, resident set size on CPU)."""
    if torch.cuda.is_available():
        return {"allocated": torch.cuda.memory_allocated() / 2**20, "peak": torch.cuda.max_memory_allocated() / 2**20}
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"allocated": float("nan"), "peak": peak_kib / 1024 if sys.platform != "darwin" else peak_kib / 2**20}


def memory_line() -> str:
    """Peak memory of every rank, gathered to rank 0 as one line."""
    peak = torch.tensor([memory_mib()["peak"]], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, peak)
        peak = torch.cat(everyone)
    return "peak memory (MiB) per rank: " + " ".join(f"{v:.0f}" for v in peak.tolist())


def iteration_line(iteration: int, total: int, consumed: int, elapsed_ms: float, lr: float, batch: int,
                   loss: float, grad_norm: Optional[float], skipped: int, extra: str = "") -> str:
    """``extra``: fields after the elapsed time, as Megatron-LM places its throughput (throughput.py)."""
    norm = "nan" if grad_norm is None else f"{grad_norm:.6f}"
    return (f" iteration {iteration:8d}/{total:8d} | consumed samples: {consumed:12d} | "
            f"elapsed time per iteration (ms): {elapsed_ms:.1f} | {extra + ' ' if extra else ''}learning rate: {lr:.6E} | "
            f"global batch size: {batch:5d} | lm loss: {loss:.6E} | grad norm: {norm} | "
            f"number of skipped iterations: {skipped:3d} |")


def summary(args, model, optimizer) -> None:
    """One-time layout report: parallel sizes, levels per axis, parameters and persistent bytes per rank."""
    if args.use_megatron_fsdp:  # ZeRO-3 parameters are empty placeholders between uses: count the layouts
        params = sum(slot.spec.numel for chunk in model for unit in chunk.fsdp.units for slot in unit.storage.layout.slots)
    else:
        params = sum(p.numel() for chunk in model for p in chunk.module.parameters())
    if args.use_megatron_fsdp:
        report = [chunk.fsdp.memory_report() for chunk in model]
        persistent = sum(r.total for r in report) + optimizer.engine.state_bytes()
        levels = model[0].fsdp.levels
        backend = f"megatron.fsdp, levels {levels.inner.name} (dp_shard) x {levels.outer.name} (dp_outer)"
    else:
        persistent = None
        backend = "Megatron-Core DistributedDataParallel" + (
            " + DistributedOptimizer" if args.use_distributed_optimizer else "")
    counts = torch.tensor([params, -1 if persistent is None else persistent], dtype=torch.float64)
    everyone = [torch.zeros_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, counts)
    print_rank_0(
        f"> parallel layout: world {dist.get_world_size()} = TP {args.tensor_model_parallel_size} x "
        f"PP {args.pipeline_model_parallel_size} x CP {args.context_parallel_size} x DP {args.data_parallel_size}"
        f"{'' if args.virtual_pipeline_model_parallel_size is None else f' (VPP {args.virtual_pipeline_model_parallel_size})'}; "
        f"micro-batches per step {args.num_micro_batches}")
    print_rank_0(f"> data parallel: {backend}")
    print_rank_0("> parameters per rank (model-parallel shard, before data-parallel sharding): "
                 + " ".join(str(int(c[0])) for c in everyone))
    if persistent is not None:
        print_rank_0("> persistent bytes per rank (weights, main weights, grads; optimizer state after step 1): "
                     + " ".join(str(int(c[1])) for c in everyone))

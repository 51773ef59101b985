"""Megatron-shaped log lines, memory per rank, the start-up summary (scalar writers: writers.py)."""

from __future__ import annotations

import os
import resource
import sys
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist


def is_rank_0() -> bool:
    """Rank 0 of the job, also before the process group exists (torchrun's RANK then)."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def print_rank_0(message: str) -> None:
    """Print once per job, not once per rank (start-up errors included)."""
    if is_rank_0():
        print(message, flush=True)


def memory_mib() -> Dict[str, float]:
    """Allocated and peak memory of this rank (CUDA memory on a GPU, resident set size on CPU).

    On CUDA the peak is that since the last ``reset_peak_memory()`` (one log interval);
    on CPU the resident-set peak can only be the process's so far.
    """
    if torch.cuda.is_available():
        return {"allocated": torch.cuda.memory_allocated() / 2**20, "peak": torch.cuda.max_memory_allocated() / 2**20}
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"allocated": float("nan"), "peak": peak_kib / 1024 if sys.platform != "darwin" else peak_kib / 2**20}


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def gather_per_rank(values: List[float]) -> List[List[float]]:
    """``values`` of every rank, on every rank (one all-gather; a collective: call on all ranks)."""
    mine = torch.tensor(values, dtype=torch.float64)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine.tolist()]
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [t.tolist() for t in everyone]


def memory_line(peaks: Optional[List[float]] = None) -> str:
    """Peak memory of every rank as one line (``peaks``: gathered already, else gathered here)."""
    peaks = peaks if peaks is not None else [row[0] for row in gather_per_rank([memory_mib()["peak"]])]
    return "peak memory (MiB) per rank: " + " ".join(f"{v:.0f}" for v in peaks)


# --------------------------------------------------------------------------- the iteration line
# Megatron-LM's ``training_log``: one line per --log-interval iterations, with the
# elapsed time and every loss averaged over the iterations of the interval, the
# learning rate and grad norm of the last one, and the skipped iterations counted
# over the interval. The line is an ordered list of (name, value) fields, so a
# module that measures something else (throughput, say) adds its fields with
# ``insert_field`` without touching this assembly.

LogFields = List[Tuple[str, str]]


def insert_field(fields: LogFields, name: str, value: str, after: Optional[str] = None) -> LogFields:
    """Insert ``name: value`` after the field ``after`` (at the end when absent or None); returns ``fields``."""
    names = [n for n, _ in fields]
    fields.insert(names.index(after) + 1 if after in names else len(fields), (name, value))
    return fields


_SPACE_ONLY = {"iteration"}  # Megatron-LM writes "iteration   3/  20", the others "name: value"


def format_fields(fields: LogFields) -> str:
    return " " + " | ".join(f"{name}{' ' if name in _SPACE_ONLY else ': '}{value}" for name, value in fields) + " |"


class IntervalLog:
    """What happens between two log lines: iterations, time, losses (in order of first sight), skips."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.iterations, self.seconds, self.skipped = 0, 0.0, 0
        self.losses: Dict[str, float] = {}

    def add(self, seconds: float, losses: Dict[str, float], skipped: bool) -> None:
        self.iterations += 1
        self.seconds += seconds
        self.skipped += int(skipped)
        for name, value in losses.items():
            self.losses[name] = self.losses.get(name, 0.0) + value

    def fields(self, iteration: int, total: int, consumed: int, lr: float, batch: int,
               grad_norm: Optional[float]) -> LogFields:
        n = max(1, self.iterations)
        norm = "nan" if grad_norm is None else f"{grad_norm:.6f}"
        return ([("iteration", f"{iteration:8d}/{total:8d}"), ("consumed samples", f"{consumed:12d}"),
                 ("elapsed time per iteration (ms)", f"{self.seconds * 1000 / n:.1f}"),
                 ("learning rate", f"{lr:.6E}"), ("global batch size", f"{batch:5d}")]
                + [(name, f"{value / n:.6E}") for name, value in self.losses.items()]
                + [("grad norm", norm), ("number of skipped iterations", f"{self.skipped:3d}")])


def _section_text(section) -> str:
    """``levels X (dp_shard) x Y (dp_outer), mesh dp_shard A x dp_outer B`` for one engine section."""
    inner, outer = section.inner, section.outer
    return (f"levels {section.levels.inner.name} ({inner.name}) x {section.levels.outer.name} ({outer.name}), "
            f"mesh {inner.name} {inner.size} x {outer.name} {outer.size}")


def summary(args, model, optimizer) -> None:
    """One-time layout report: parallel sizes, levels and mesh per axis, parameters per rank, Muon's settings.

    Takes the whole namespace: a start-up report of flags from every concern (parallel layout, data-parallel
    backend, experts, optimizer), read once."""
    if args.use_megatron_fsdp:  # ZeRO-3 parameters are empty placeholders between uses: count the layouts
        params = sum(slot.spec.numel for chunk in model for unit in chunk.fsdp.units for slot in unit.storage.layout.slots)
    else:
        params = sum(p.numel() for chunk in model for p in chunk.module.parameters())
    everyone = gather_per_rank([params])
    print_rank_0(
        f"> parallel layout: world {dist.get_world_size()} = TP {args.tensor_model_parallel_size} x "
        f"PP {args.pipeline_model_parallel_size} x CP {args.context_parallel_size} x DP {args.data_parallel_size}"
        f"{'' if args.virtual_pipeline_model_parallel_size is None else f' (VPP {args.virtual_pipeline_model_parallel_size})'}; "
        f"micro-batches per step {args.num_micro_batches}")
    # the data-parallel backend with its levels and mesh sizes (dense, and the experts with their EP size)
    if not args.use_megatron_fsdp:
        backend = "Megatron-Core DistributedDataParallel" + (
            " + DistributedOptimizer" if args.use_distributed_optimizer else "") + (
            f" ({args.num_distributed_optimizer_instances} optimizer instances)"
            if args.num_distributed_optimizer_instances > 1 else "")
    else:
        sections = model[0].fsdp.sections
        backend = f"megatron.fsdp, {_section_text(sections['dense'])}"
        if "expert" in sections:
            backend += (f"; experts (EP {args.expert_model_parallel_size}, "
                        f"expert DP {args.expert_data_parallel_size}): {_section_text(sections['expert'])}")
        elif args.num_experts is not None:
            backend += f"; experts (EP {args.expert_model_parallel_size}): none on this rank"
    print_rank_0(f"> data parallel: {backend}")
    print_rank_0("> parameters per rank (model-parallel shard, before data-parallel sharding): "
                 + " ".join(str(int(c[0])) for c in everyone))
    if args.optimizer == "muon":  # said once: nothing else in the log would show Muon is on
        print_rank_0(f"> optimizer: Muon on the 2-D weight matrices (momentum {args.muon_momentum}, Nesterov "
                     f"{'on' if args.muon_use_nesterov else 'off'}, {args.muon_num_ns_steps} Newton-Schulz steps "
                     f"({args.muon_coefficient_type} coefficients), scale "
                     f"{args.muon_scale_mode} x {args.muon_extra_scale_factor}, TP mode {args.muon_tp_mode}); Adam on "
                     f"the embedding, output layer, norms and biases (lr {args.lr}, weight decay {args.weight_decay})")


def persistent_line(model, optimizer) -> Optional[str]:
    """Persistent bytes per rank once the optimizer state exists (after the first step); a collective.

    None for the Megatron-Core baseline (its optimizer has no ``engine``), whose buffers this job does not itemise.
    """
    engine = getattr(optimizer, "engine", None)
    if engine is None:
        return None
    persistent = sum(chunk.fsdp.memory_report().total for chunk in model) + engine.state_bytes()
    everyone = gather_per_rank([persistent])
    return ("persistent bytes per rank (weights, main weights, grads, optimizer state): "
            + " ".join(str(int(c[0])) for c in everyone))


def end_of_run_line(iterations: int, wall_seconds: float, train_seconds: float, tokens: int,
                    peak_mib: float) -> str:
    """The end-of-run summary: iterations, time (wall, and in training steps), tokens/s, highest peak memory.

    Tokens per second count the training steps only (as the per-iteration time does),
    not evaluation or checkpoint saves, which the wall time includes.
    """
    rate = tokens / train_seconds if train_seconds > 0 else 0.0  # no iteration ran: no tokens, not nan
    return (f" training done | iterations: {iterations} | total time (s): {wall_seconds:.1f} | "
            f"time in training steps (s): {train_seconds:.1f} | tokens per second: {rate:.1f} | "
            f"peak memory (MiB), max over ranks and iterations: {peak_mib:.0f} |")

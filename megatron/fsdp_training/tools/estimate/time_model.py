"""A time model, and only that: one step's seconds from its FLOPs, the engine's collectives and the order it overlaps
them in, on named hardware constants.

The model (docs/estimate.md, "The time model"):

* compute: the GEMMs, Megatron-LM's model FLOPs of the global batch (``logs/throughput.py``; 4/3 of them with full
  activation recompute, which runs every forward twice) divided by the world, at ``peak x achievable`` FLOP/s (the
  FP8 peak under ``--fp8-format``); and the rest, memory-bound: every byte the forward's and backward's operators
  create (the simulated step's count, GEMM outputs included) written once and read once at the memory's bandwidth;
* a collective: ``latency`` per call plus the bytes this rank sends (the ledger's wire bytes) at NVLink's bandwidth
  when its axis stays inside a node, at the inter-node bandwidth per GPU when it spans nodes;
* overlap, as the engine orders it: a unit's collectives (its gathers, its reductions) run while the unit before it
  computes (prefetch and reductions in flight), so what is exposed is the first unit's collectives and, for every
  later unit, what its collectives take beyond the compute of the unit before it (a unit's compute taken as its
  share of the gathered bytes: FLOPs follow the parameters of a transformer layer);
* the optimizer step: memory-bound, reading and writing the shard's fp32 main weight, gradient and two moments;
* on ``this-machine`` every rank runs here: more ranks than cores share them (compute and the step take turns).

Not modelled: Megatron-Core's tensor-, context- and expert-parallel collectives and the pipeline's bubble and sends
(not in the engine's ledger), kernel launch overheads, stragglers.
"""

from __future__ import annotations

import dataclasses
from typing import Dict

from ...logs.model_size import ModelSize
from ...logs.throughput import num_floating_point_operations
from .one_step import StepMeasurement


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator and its fabric, as the time model reads them."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s of one device
    peak_fp8_flops: float  # dense FP8 FLOP/s (the GEMMs of an --fp8-format run)
    achievable: float  # the fraction of peak a large GEMM reaches
    intra_node_bandwidth: float  # bytes/s one device sends inside a node (NVLink)
    inter_node_bandwidth: float  # bytes/s one device sends to another node (its NIC)
    latency: float  # seconds per collective call
    memory_bandwidth: float  # bytes/s of device memory (the optimizer step)
    shared_devices: int = 0  # the devices every rank of the world shares (this machine's cores); 0: one per rank


# Vendor figures: dense bf16 (no sparsity), NVLink per direction, one 400 Gb/s (H100, H200) or 800 Gb/s (B200) NIC
# per GPU; the achievable fraction is the ~60% of peak that large bf16 GEMMs reach in Megatron-LM's published runs.
PRESETS: Dict[str, Hardware] = {
    "h100-sxm": Hardware("h100-sxm", 989e12, 1979e12, 0.6, 450e9, 50e9, 20e-6, 3.35e12),
    "h200": Hardware("h200", 989e12, 1979e12, 0.6, 450e9, 50e9, 20e-6, 4.8e12),
    "b200": Hardware("b200", 2250e12, 4500e12, 0.6, 900e9, 100e9, 20e-6, 8.0e12),
}
THIS_MACHINE = "this-machine"  # measured when asked for (``measure_this_machine``)
HARDWARE = tuple(PRESETS) + (THIS_MACHINE,)

_ADAM_BYTES_PER_ELEMENT = 2 * 4 * 4  # read and write: fp32 main weight, gradient, two moments


@dataclasses.dataclass(frozen=True)
class StepWork:
    """What one step computes, as the time model reads it from the flags (built once, after the job's set-up
    completed them: the padded vocabulary)."""

    size: ModelSize
    global_batch_size: int
    seq_length: int
    full_recompute: bool  # --recompute-granularity full: every forward runs twice
    fp8: bool  # --fp8-format: the GEMMs at the FP8 peak

    @classmethod
    def from_args(cls, args) -> "StepWork":
        return cls(ModelSize.from_args(args), args.global_batch_size, args.seq_length,
                   getattr(args, "recompute_granularity", None) == "full", bool(getattr(args, "fp8", None)))


def predict(m: StepMeasurement, work: StepWork, hardware: Hardware, gpus_per_node: int) -> Dict[str, float]:
    """``predicted`` of the JSON: step seconds, tokens/s per GPU, MFU and the exposed communication."""
    from .report import crosses_nodes

    flops = num_floating_point_operations(work.size, work.global_batch_size) / m.world_size
    hardware_flops = flops * (4 / 3 if work.full_recompute else 1.0)
    peak = hardware.peak_fp8_flops if work.fp8 else hardware.peak_flops
    gemms = hardware_flops / (peak * hardware.achievable)
    written = m.created_bytes["forward"] + m.created_bytes["backward"]
    elementwise = 2 * written / hardware.memory_bandwidth  # each byte an operator writes, written and read once
    compute = gemms + elementwise
    crossing = {r.axis: crosses_nodes(r, gpus_per_node) for r in m.collectives}
    per_unit: Dict[str, float] = {}
    gathered: Dict[str, int] = {}
    for event in m.events:
        bandwidth = hardware.inter_node_bandwidth if crossing.get(event.axis) else hardware.intra_node_bandwidth
        unit = event.tag
        per_unit[unit] = per_unit.get(unit, 0.0) + hardware.latency + event.wire / bandwidth
        if event.kind == "all_gather":
            gathered[unit] = gathered.get(unit, 0) + event.nbytes
    total_gathered = sum(gathered.values())
    exposed, previous = 0.0, None
    for unit, seconds in per_unit.items():  # in the order the step first issued each unit's collectives
        if previous is None or not total_gathered:
            exposed += seconds
        else:
            exposed += max(0.0, seconds - compute * gathered.get(previous, 0) / total_gathered)
        previous = unit
    shard_elements = m.persistent_bytes["optimizer_state"] / 8  # two fp32 moments per element of the shard
    optimizer = shard_elements * _ADAM_BYTES_PER_ELEMENT / hardware.memory_bandwidth
    if hardware.shared_devices and m.world_size > hardware.shared_devices:  # ranks take turns on the cores
        share = m.world_size / hardware.shared_devices
        gemms, elementwise, compute, optimizer = gemms * share, elementwise * share, compute * share, optimizer * share
    step = compute + exposed + optimizer
    tokens = work.global_batch_size * work.seq_length
    return {"step_seconds": step, "tokens_per_second_per_gpu": tokens / step / m.world_size,
            "mfu": flops / step / hardware.peak_flops,  # against the bf16 peak, as Megatron-LM and torchtitan report
            "exposed_communication_seconds": exposed,
            "compute_seconds": compute, "gemm_seconds": gemms, "elementwise_seconds": elementwise,
            "optimizer_seconds": optimizer}


_PROBE = r"""
import os, sys, time, torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2)
small, big = torch.zeros(2), torch.zeros(4 << 20)  # 8 bytes; 16 MiB
for t, n in ((small, 5), (big, 1)):
    for _ in range(n):
        dist.all_reduce(t)
start = time.perf_counter()
for _ in range(50):
    dist.all_reduce(small)
latency = (time.perf_counter() - start) / 50
start = time.perf_counter()
for _ in range(5):
    dist.all_reduce(big)
seconds = (time.perf_counter() - start) / 5
if rank == 0:
    print(latency, big.numel() * big.element_size() / max(seconds - latency, 1e-9))
dist.destroy_process_group()
"""


def measure_this_machine() -> Hardware:
    """This machine's constants, measured now: one thread's fp32 GEMM FLOP/s (achievable 1: the measured rate is
    what a GEMM reaches), a big copy's bytes/s, and two gloo processes' all-reduce latency and bandwidth on
    localhost (a 2-rank ring all-reduce sends each rank's whole buffer once), for inside and across "nodes" alike;
    the world's ranks share this machine's cores (more ranks than cores take turns)."""
    import os
    import socket
    import subprocess
    import sys
    import time

    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < 0.5:
        a @ b
        count += 1
    flops = 2 * 1024 ** 3 * count / (time.perf_counter() - start)
    big = torch.empty(64 << 20, dtype=torch.uint8)
    start = time.perf_counter()
    for _ in range(5):
        big.clone()
    memory = 2 * big.numel() * 5 / (time.perf_counter() - start)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ranks = [subprocess.Popen([sys.executable, "-c", _PROBE, str(r), port], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outputs = [r.communicate(timeout=120)[0] for r in ranks]
    latency, bandwidth = (float(x) for x in outputs[0].split())
    return Hardware(THIS_MACHINE, flops, flops, 1.0, bandwidth, bandwidth, latency, memory,
                    shared_devices=os.cpu_count() or 1)


def hardware_named(name: str) -> Hardware:
    return measure_this_machine() if name == THIS_MACHINE else PRESETS[name]

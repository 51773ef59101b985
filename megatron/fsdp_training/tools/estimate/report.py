"""An estimate as lines a user reads and as the JSON the docs define (docs/estimate.md, "The JSON").

Everything here is arithmetic on ``one_step.StepMeasurement``: which axes cross nodes when ``--gpus-per-node``
maps rank r to node r // G, the checkpoint metadata's size, and the time model's prediction beside it.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from ...checkpointing.save_load import FIXED_OVERHEAD, METADATA_PER_ITEM
from .one_step import CollectiveRow, StepMeasurement

SCHEMA = 1  # bumped when a key changes meaning


def crosses_nodes(row: CollectiveRow, gpus_per_node: int) -> bool:
    """The axis's ranks lie on more than one node (rank r on node r // gpus_per_node)."""
    return len({r // gpus_per_node for r in row.group_ranks}) > 1


def metadata_bytes(measurement: StepMeasurement) -> int:
    """DCP's ``.metadata`` and the job's ``common.json`` and manifest at this world size, at most: every rank's items
    counted as this rank's (a replica's piece is written once, so fewer) at the job's per-item size
    (``checkpointing/save_load.py``'s free-space estimate uses the same two constants)."""
    return FIXED_OVERHEAD + METADATA_PER_ITEM * measurement.checkpoint.rank_items * measurement.world_size


def rank_json(m: StepMeasurement, gpus_per_node: int, host_peak_bytes: int,
              predicted: Optional[Dict[str, float]]) -> Dict[str, object]:
    return {
        "rank": m.rank,
        "persistent_bytes": dict(m.persistent_bytes),
        "peak_bytes": dict(m.peak_bytes),
        "created_bytes": dict(m.created_bytes),
        "collectives": [{"axis": r.axis, "kind": r.kind, "calls": r.calls, "bytes": r.bytes,
                         "wire_bytes": r.wire_bytes, "largest_bytes": r.largest_bytes,
                         "crosses_nodes": crosses_nodes(r, gpus_per_node)} for r in m.collectives],
        "checkpoint": {"rank_bytes": m.checkpoint.rank_bytes, "tensor_bytes": m.checkpoint.tensor_bytes,
                       "object_bytes": m.checkpoint.object_bytes, "rank_items": m.checkpoint.rank_items,
                       "total_bytes": m.checkpoint.total_bytes, "metadata_bytes": metadata_bytes(m)},
        "build_seconds": m.build_seconds,
        "step_seconds": m.step_seconds,
        "host_peak_bytes": host_peak_bytes,
        "predicted": predicted,
    }


def document(world_size: int, gpus_per_node: int, hardware: str, ranks: List[Dict[str, object]],
             command_line: List[str]) -> Dict[str, object]:
    return {"schema": SCHEMA, "simulation": True, "world_size": world_size, "gpus_per_node": gpus_per_node,
            "hardware": hardware, "command_line": list(command_line), "ranks": ranks}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}" if n >= 2**30 / 100 or n == 0 else f"{n / 2**30:.2g}"


def lines(m: StepMeasurement, gpus_per_node: int, host_peak_bytes: int,
          predicted: Optional[Dict[str, float]], hardware: str) -> List[str]:
    """Megatron-LM-style lines for one rank: memory, the step's collectives, the checkpoint, the estimate's cost."""
    p = m.persistent_bytes
    out = [f" estimate of rank {m.rank} of {m.world_size} (a simulation: fake tensors on torch's fake process group)",
           f"  persistent (GiB): compute weights {_gib(p['compute_weights'])} | main weights {_gib(p['main_weights'])}"
           f" | main grads {_gib(p['main_grads'])} | optimizer state {_gib(p['optimizer_state'])}"
           f" | total {_gib(p['total'])}",
           "  peak allocated (GiB): " + " | ".join(f"{name} {_gib(v)}" for name, v in m.peak_bytes.items()),
           f"  collectives of one step ({gpus_per_node} ranks per node):",
           f"    {'axis':<20}{'kind':<16}{'calls':>7}{'GiB':>10}{'largest MiB':>13}  crosses nodes"]
    wire = crossing = 0
    for r in m.collectives:
        crosses = crosses_nodes(r, gpus_per_node)
        wire += r.wire_bytes
        crossing += r.wire_bytes if crosses else 0
        out.append(f"    {r.axis:<20}{r.kind:<16}{r.calls:>7}{_gib(r.bytes):>10}{r.largest_bytes / 2**20:>13.1f}"
                   f"  {'yes' if crosses else 'no'}")
    if wire:
        out.append(f"    bytes sent on axes that cross nodes: {100.0 * crossing / wire:.0f}% of {_gib(wire)} GiB sent")
    c = m.checkpoint
    out.append(f"  checkpoint: this rank writes {_gib(c.rank_bytes)} GiB in {c.rank_items} pieces; the save holds "
               f"{_gib(c.total_bytes)} GiB of tensors; metadata at most {metadata_bytes(m) / 2**20:.1f} MiB")
    if predicted:
        out.append(f"  predicted on {hardware} (a time model, docs/estimate.md): step {predicted['step_seconds']:.3f} s"
                   f" | tokens/s/GPU {predicted['tokens_per_second_per_gpu']:.0f} | MFU {100 * predicted['mfu']:.1f}%"
                   f" | exposed communication {predicted['exposed_communication_seconds']:.3f} s")
    out.append(f"  cost of this estimate: build {m.build_seconds:.1f} s | step {m.step_seconds:.1f} s | host peak "
               f"{host_peak_bytes / 2**20:.0f} MiB")
    return out

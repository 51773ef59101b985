"""The job's own build and one training step, measured: what a rank keeps, allocates and sends.

Why the job itself: an estimate from closed forms drifts from the code that will run (``tools/fsdp_planner.py``
is one; ``tests/tools/test_fsdp_planner.py`` holds the two together). Here ``Trainer.setup()`` builds exactly
what ``pretrain_gpt.py`` builds from the same flags, and ``Trainer.train_step`` runs one iteration (every
micro-batch's forward and backward through Megatron-Core's schedule, the reductions, the optimizer step); the
same function measures a real run (the tests compare the two) and a simulated one (``world.py``: fake tensors on
torch's fake process group), which differ only in what the tensors hold.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from megatron.fsdp.collectives.comm import LedgerEvent

from ...trainer import Trainer
from .allocations import AllocationCounter

# The phases of a step whose peaks are reported, in the order they run
PHASES = ("build", "forward", "backward", "optimizer step")


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
    """One kind of collective on one axis over a training step (the engine's ledger)."""

    axis: str
    kind: str
    calls: int
    bytes: int  # the full buffer of each call, summed (what the ledger records)
    wire_bytes: int  # what this rank sends (a ring's (N-1)/N of each pass)
    largest_bytes: int  # the largest single call
    group_ranks: Tuple[int, ...]  # the axis's ranks, global


@dataclasses.dataclass(frozen=True)
class CheckpointPlan:
    """One save of this rank: the pieces it writes and the save's size."""

    tensor_bytes: int  # this rank's tensor pieces at their dtype
    object_bytes: int  # this rank's pickled objects (the RNG states: their length varies with their values)
    rank_items: int
    total_bytes: int  # every tensor of the save at its global shape, once

    @property
    def rank_bytes(self) -> int:
        return self.tensor_bytes + self.object_bytes


@dataclasses.dataclass(frozen=True)
class StepMeasurement:
    """What one rank keeps, allocates and sends in the build and one step."""

    rank: int
    world_size: int
    persistent_bytes: Dict[str, int]  # kind -> bytes, and "total"
    peak_bytes: Dict[str, int]  # phase -> highest bytes allocated while it ran
    created_bytes: Dict[str, int]  # phase -> bytes of the tensors its operators created (what they wrote)
    collectives: Tuple[CollectiveRow, ...]
    events: Tuple[LedgerEvent, ...]  # the step's collectives one by one, in the order issued
    checkpoint: CheckpointPlan
    build_seconds: float
    step_seconds: float
    loss: float  # NaN when simulated: fake tensors hold no values


def _persistent(model, optimizer) -> Dict[str, int]:
    kinds = {"compute_weights": 0, "main_weights": 0, "main_grads": 0, "optimizer_state": 0}
    for chunk in model:
        report = chunk.fsdp.memory_report()
        for kind in ("compute_weights", "main_weights", "main_grads"):
            kinds[kind] += getattr(report, kind)
    kinds["optimizer_state"] = optimizer.engine.state_bytes()
    kinds["total"] = sum(kinds.values())
    return kinds


def _axes(model) -> Dict[str, Tuple[int, ...]]:
    """Each engine axis's global ranks, by the ledger's axis name."""
    axes: Dict[str, Tuple[int, ...]] = {}
    for chunk in model:
        for section in chunk.fsdp.sections.values():
            for axis in (section.inner, section.outer):
                if axis.group is not None and axis.name not in axes:
                    axes[axis.name] = tuple(dist.get_process_group_ranks(axis.group))
    return axes


def _ledgers(model) -> List:
    """The distinct ledgers of the chunks (a virtual-pipeline model has one per chunk)."""
    seen: Dict[int, object] = {}
    for chunk in model:
        ledger = chunk.fsdp.ledger
        seen.setdefault(id(ledger), ledger)
    return list(seen.values())


def _collectives(model) -> Tuple[CollectiveRow, ...]:
    """The step's collectives per (axis, kind), in the order first issued, from the ledgers' events."""
    axes, rows = _axes(model), {}
    for ledger in _ledgers(model):
        for event in ledger.events:
            calls, nbytes, wire, largest = rows.get((event.axis, event.kind), (0, 0, 0, 0))
            rows[(event.axis, event.kind)] = (calls + 1, nbytes + event.nbytes, wire + event.wire,
                                              max(largest, event.nbytes))
    return tuple(CollectiveRow(axis, kind, *counts, axes.get(axis, ())) for (axis, kind), counts in rows.items())


def _checkpoint(model, optimizer) -> CheckpointPlan:
    """The pieces DCP would write for this rank in a save of the job's state (``save_load.save_state_dict``)."""
    from ...checkpointing.save_load import save_state_dict, tensor_item_bytes, write_items

    tensors = objects = items = total = 0
    counted = set()
    for key, value, item in write_items(save_state_dict(model, optimizer)):
        items += 1
        if item.tensor_data is None:
            objects += len(value) if isinstance(value, (bytes, bytearray)) else len(pickle.dumps(value))
        else:
            tensors += tensor_item_bytes(item)
        if isinstance(value, torch.Tensor) and key not in counted:  # a DTensor's numel is its global one
            counted.add(key)
            total += value.numel() * value.element_size()
    return CheckpointPlan(tensors, objects, items, total)


def _instrument(trainer: Trainer, counter: AllocationCounter) -> None:
    """Phases of the step: a chunk's forward is "forward"; the rest of forward-backward (the backward passes, the
    loss, the pipeline's sends) "backward"; the optimizer's step "optimizer step"."""
    for chunk in trainer.model:
        chunk.register_forward_pre_hook(lambda *_: counter.begin("forward"))
        chunk.register_forward_hook(lambda *_: counter.end("forward"), always_call=True)
    forward_backward, step = trainer.forward_backward, trainer.optimizer.step

    def timed_forward_backward(*args, **kwargs):
        with counter.phase("backward"):
            return forward_backward(*args, **kwargs)

    def timed_step(*args, **kwargs):
        with counter.phase("optimizer step"):
            return step(*args, **kwargs)

    trainer.forward_backward, trainer.optimizer.step = timed_forward_backward, timed_step


def measure_one_step(args, counter: AllocationCounter) -> StepMeasurement:
    """Build the job from ``args`` (parsed ``pretrain_gpt.py`` flags), run iteration 1, and measure it.

    Needs ``--use-megatron-fsdp`` (the engine's ledger and memory report are what is read). The process group must
    exist (a real one, or ``world.simulated_rank``'s fake one); ``counter`` is already counting (entered).
    """
    from ...errors import ArgumentError
    from ...profiler import Profiler

    if not args.use_megatron_fsdp:
        raise ArgumentError("the estimate measures megatron.fsdp's build and step: pass --use-megatron-fsdp (and "
                            "--data-parallel-sharding-strategy) with the job's other flags")
    trainer = Trainer(args)
    start = time.perf_counter()
    try:
        with counter.phase("build"):
            trainer.setup(hold_save=False)
        built = time.perf_counter()
        for ledger in _ledgers(trainer.model):
            ledger.reset()  # the step's collectives only (the build's digests and broadcasts are not a step's)
            ledger.trace = True
        trainer.profiler = Profiler(trainer.logging, dist.get_rank(), 0)  # off unless --profile asks
        _instrument(trainer, counter)
        for chunk in trainer.model:
            chunk.train()
        step, _, _ = trainer.train_step(1, 0)
        stepped = time.perf_counter()
        return StepMeasurement(
            rank=dist.get_rank(), world_size=dist.get_world_size(),
            persistent_bytes=_persistent(trainer.model, trainer.optimizer),
            peak_bytes={name: counter.peaks.get(name, 0) for name in PHASES},
            created_bytes={name: counter.created.get(name, 0) for name in PHASES},
            collectives=_collectives(trainer.model),
            events=tuple(e for ledger in _ledgers(trainer.model) for e in ledger.events),
            checkpoint=_checkpoint(trainer.model, trainer.optimizer),
            build_seconds=built - start, step_seconds=stepped - built, loss=step.losses["lm loss"])
    finally:
        trainer.close()

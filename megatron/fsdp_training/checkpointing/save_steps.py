"""A checkpoint save in three steps, so that all but a host copy can run in the background.

``torch.distributed.checkpoint.save`` plans, writes and finishes in one call,
with collectives before and after the write. Split apart:

0. ``host_copies`` (this rank, the training thread, no collective): the state
   dict is already a copy of this rank's pieces (the engine's state dicts never
   hold views of live storage); on a GPU it is copied once more into pinned host
   memory, so nothing after it needs the device or the training thread.
1. ``stage`` (all ranks, a collective on ``group``): DCP's plan agreed (local
   plans gathered, deduplicated and scattered back; cached, so a save described
   like the previous one sends empty plans): every rank knows what it writes and
   rank 0 holds the checkpoint's metadata.
2. ``write_pieces`` (one rank, no collective, no device): this rank's files in
   the temporary directory, fsynced. Wrappers that add checks to the write
   (manifests, free space) wrap it.
3. ``finish`` (all ranks, a collective on ``group``): every rank's write
   results gathered to rank 0 (so every rank has written), which writes
   ``.metadata`` and ``common.json`` and publishes (rename, tracker;
   ``checkpoint_files.publish``). Until then the previous checkpoint is in charge.

A synchronous save runs them back to back on the training thread
(``checkpointing.save_checkpoint``); ``async_save.CheckpointSaver`` runs step 0
on the training thread and steps 1-3 on its writer thread, on a process group of
the writer's own (two threads never issue collectives on one group).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import _DistWrapper

from megatron.fsdp.checkpoint.pieces import on_host

from . import files
from . import manifest
from . import ownership


class CheckpointSavePlanner(DefaultSavePlanner):
    """DCP's planner with its plan cache (keyed by this class's name): a save whose pieces are
    described as in the previous one sends empty plans, not every write item, to rank 0."""

    def __init__(self):
        super().__init__(enable_plan_caching=True)


@dataclasses.dataclass
class StagedSave:
    """Everything the write and finish steps need; the state dict holds host copies only."""

    iteration: int
    root: Path
    tmp: Path
    state: Dict[str, Any]
    writer: manifest.ChecksummingWriter  # each file's size and CRC-32, taken while written
    planner: CheckpointSavePlanner
    plan: SavePlan
    metadata: Optional[Metadata]  # rank 0 only
    common: Optional[Dict[str, Any]]  # rank 0 only
    copy_seconds: float = 0.0  # this rank's pieces into host memory (the state dict's copies, then pinned)
    plan_seconds: float = 0.0  # DCP's plan agreed across ranks
    arrival_seconds: float = 0.0  # waiting for the slowest rank to reach the save (not the save's cost)


def _host_copy(value: Any, pin: bool) -> Any:
    """A host copy of one state-dict value (DTensor pieces keep their description)."""
    if isinstance(value, dict):
        return {k: _host_copy(v, pin) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return on_host(value, pin)
    return value


def host_copies(state: Dict[str, Any]) -> Dict[str, Any]:
    """Step 0 (this rank, the training thread): ``state`` (already a copy) with every device tensor copied to
    host memory (pinned on a GPU), complete when this returns: the other steps may run on any thread."""
    pin = torch.cuda.is_available()
    state = _host_copy(state, pin)
    if pin:
        torch.cuda.synchronize()  # the pinned copies are complete before a writer reads them
    return state


def stage(state: Dict[str, Any], tmp: Path, root: Path, iteration: int,
          common: Optional[Dict[str, Any]], copy_seconds: float = 0.0, group=None) -> StagedSave:
    """Step 1 (all ranks of ``group``): DCP's agreed plan for ``state`` (host copies: ``host_copies``,
    made in ``copy_seconds``)."""
    start = time.perf_counter()
    # host tensors: no device streams in the writer
    writer = manifest.ChecksummingWriter(str(tmp), per_thread_copy_ahead=0)
    planner = CheckpointSavePlanner()
    dist_wrapper = _DistWrapper(group, True, 0)
    metadata_box: List[Optional[Metadata]] = [None]

    def local_step() -> SavePlan:
        planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(),
                               is_coordinator=dist_wrapper.is_coordinator)
        writer.set_up_storage_writer(dist_wrapper.is_coordinator, rank=dist_wrapper.rank, use_collectives=True)
        return writer.prepare_local_plan(planner.create_local_plan())

    def global_step(plans: List[SavePlan]) -> List[SavePlan]:
        plans, metadata_box[0] = planner.create_global_plan(plans)
        return writer.prepare_global_plan(plans)

    central = dist_wrapper.reduce_scatter("plan", local_step, global_step)
    plan = planner.finish_plan(central)
    return StagedSave(iteration, root, tmp, state, writer, planner, plan, metadata_box[0], common,
                      copy_seconds, time.perf_counter() - start)


def write_pieces(staged: StagedSave) -> List[WriteResult]:
    """Step 2 (this rank alone, any thread): write and fsync this rank's files; no collective."""
    future = staged.writer.write_data(staged.plan, staged.planner)
    future.wait()
    return future.value()


def finish(staged: StagedSave, results: Any, barrier: bool = True, group=None) -> Path:
    """Step 3 (all ranks): agree that every rank wrote; rank 0 writes the metadata and publishes.

    ``results`` is this rank's write results, or the exception its write raised:
    then nobody publishes and every rank raises the same error naming the ranks
    (the all-reduce is the agreement). ``barrier`` makes every rank return only
    once the checkpoint is visible, or raise the error rank 0's publish raised (a
    broadcast of its outcome: no rank is left waiting for a rank 0 that failed);
    without it only rank 0 knows.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = torch.tensor([0.0 if isinstance(results, list) else 1.0])
    dist.all_reduce(failed, group=group)
    if failed.item():
        if rank == 0:  # a partial save leaves nothing behind (the tracker never named it)
            shutil.rmtree(staged.tmp, ignore_errors=True)
        errors: List[Any] = [None] * world
        dist.all_gather_object(errors, None if isinstance(results, list) else f"{type(results).__name__}: {results}",
                               group=group)
        named = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None)
        raise files.CheckpointError(
            f"the write of checkpoint iteration {staged.iteration} failed ({named}); nothing was published: "
            f"{staged.root}'s tracker still names iteration {files.read_tracker(staged.root)}")
    files.fault_point("after_write", staged.iteration, rank)
    gathered: Optional[List[Any]] = [None] * world if rank == 0 else None
    dist.gather_object((results, staged.writer.files), gathered, dst=0, group=group)
    final = staged.root / files.iteration_dir_name(staged.iteration)
    outcome: List[Optional[str]] = [None]
    if rank == 0:
        try:
            staged.writer.finish(metadata=staged.metadata, results=[r for r, _ in gathered])
            files.write_common(staged.tmp, staged.common)
            written = {k: v for _, per_rank in gathered for k, v in per_rank.items()}
            written.update(staged.writer.files)  # rank 0's, now with the .metadata it just wrote
            manifest.write_manifest(staged.tmp, written, extra=[files.COMMON])
            files.fsync_dir(staged.tmp)
            (staged.tmp / ownership.OWNER).unlink(missing_ok=True)
            final = files.publish(staged.tmp, staged.root, staged.iteration, rank)
        except Exception as exc:  # noqa: BLE001 - told to every rank below, then raised everywhere
            outcome[0] = f"{type(exc).__name__}: {exc}"
            if not barrier:
                raise
    if barrier:  # every rank returns once the checkpoint is visible, or raises rank 0's error with it
        dist.broadcast_object_list(outcome, src=0, group=group)
        if outcome[0] is not None:
            raise files.CheckpointError(
                f"publishing checkpoint iteration {staged.iteration} failed on rank 0 ({outcome[0]}); "
                f"{staged.root}'s tracker names iteration {files.read_tracker(staged.root)}")
    return final

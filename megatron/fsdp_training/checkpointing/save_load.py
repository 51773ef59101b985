"""Save and load training checkpoints (``--save`` / ``--load``, ``--ckpt-format fsdp_dtensor``).

What a checkpoint holds, and why there:

- the DCP state dict (``torch.distributed.checkpoint``), every tensor keyed by a
  global name and stored in logical per-parameter coordinates, so any DP size,
  level or mesh (and PP or EP size) can load it:
  ``model.<key>`` (fp32 main weights and buffers), ``optimizer.state.<key>.<name>``
  (e.g. ``exp_avg``), ``optimizer.param_groups.<g>.*`` (hyperparameters and the
  ``step`` count) and ``rng.rank<r>`` (each rank's RNG states, pickled). The
  optimizer's own copy of the main weights (``optimizer.main.<key>``) is not
  written: it is the same data as ``model.<key>``, which fills it at load time;
- ``common.json``: iteration, consumed samples, the LR scheduler's state, the
  world size and the arguments (those that fix the model's shape are compared
  at load time). Nothing layout-dependent is kept outside the DCP state dict.

Loading validates everything first (arguments, then every key, shape and dtype
of the union of all ranks' state dicts against the checkpoint's metadata, the
same decision on every rank), and only then lets DCP fill copies and installs
them; the engine's load rebuilds the compute weights from the loaded main
weights before the next forward. The on-disk protocol (temporary directory,
atomic rename, tracker) is in ``checkpointing/files.py``.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import random
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megatron.fsdp.checkpoint.metadata import describe_checkpoint, describe_state_dict, key_mismatches, mismatch_error, show
from megatron.fsdp.commands import CONVERT

from . import files
from . import manifest
from . import ownership, paths
from . import compatibility
from . import fp8_state
from .checkpoint_config import CheckpointConfig
from .compatibility import KEY_LAYOUT_ARGS, MODEL_SHAPE_ARGS
from .paths import find_checkpoint
from .files import CheckpointError
from megatron.fsdp.mcore_releases import expert_layout_hint
from .portable_state import as_tensor, portable
from ..logs.lines import print_rank_0

FORMAT = "fsdp_dtensor"
# 2: TP-global keys and shapes; 1: keys per TP rank, read in TP-global terms (checkpointing/layout_v1.py). Both load at any TP, EP.
VERSION = 2
# The parallel layout a checkpoint was written with (common.json; megatron-fsdp-inspect shows it).
PARALLEL_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "virtual_pipeline_model_parallel_size", "sequence_parallel", "expert_model_parallel_size",
                 "expert_tensor_parallel_size", "data_parallel_sharding_strategy",
                 "num_distributed_optimizer_instances", "outer_dp_sharding_strategy",
                 "expert_data_parallel_sharding_strategy")


_held_save: List[Path] = []  # the --save directory whose lock this process took (hold_save_directory)

def _json_value(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str, type(None))) else (
        [_json_value(v) for v in value] if isinstance(value, (list, tuple)) else str(value))


def parallel_layout(record: Mapping[str, Any]) -> Dict[str, Any]:
    """The parallel layout of a run (``record``: its arguments) on this world, as ``common.json`` holds it."""
    layout = {name: _json_value(record.get(name)) for name in PARALLEL_ARGS}
    world = dist.get_world_size()
    model_parallel = (record["tensor_model_parallel_size"] * record["pipeline_model_parallel_size"]
                      * record["context_parallel_size"])
    return {"world_size": world, "data_parallel_size": world // model_parallel, **layout}


def model_args(record: Mapping[str, Any]) -> Dict[str, Any]:
    """The arguments of a run (``record``) that fix the model's shape and keys, as ``common.json`` holds them."""
    names = MODEL_SHAPE_ARGS + KEY_LAYOUT_ARGS + (("expert_model_parallel_size",) if record["moe_grouped_gemm"] else ())
    return {name: _json_value(record.get(name)) for name in names}


# ------------------------------------------------------------------------- RNG
def rng_state() -> bytes:
    """This rank's RNG states: Python, NumPy, torch CPU, CUDA (if any) and Megatron's tracker streams.

    The generators are real in a simulation too (fake tensors draw nothing): their states are read as they are."""
    from megatron.core import tensor_parallel

    from megatron.fsdp.collectives.simulation import outside_simulation

    tracker = tensor_parallel.get_cuda_rng_tracker()
    with outside_simulation():
        return _pickled_rng_states(tracker)


def _pickled_rng_states(tracker) -> bytes:
    return pickle.dumps(portable({  # no pickled tensor: they would name a module of this Megatron-Core release
        "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tracker.get_states() if getattr(tracker, "states_", None) else None,
    }))


def set_rng_state(blob: bytes) -> None:
    from megatron.core import tensor_parallel

    state = pickle.loads(blob)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(as_tensor(state["torch"]))
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(as_tensor(state["cuda"]))
    if state["tracker"] is not None:
        tensor_parallel.get_cuda_rng_tracker().set_states({k: as_tensor(v) for k, v in state["tracker"].items()})


# ------------------------------------------------------------------ state dicts
def model_state_dict(model: List[torch.nn.Module]) -> Dict[str, Any]:
    """Every chunk's pieces under global keys (each key in one chunk only: global layer numbers)."""
    out: Dict[str, Any] = {}
    for chunk in model:
        sd = chunk.state_dict()
        clash = sorted(set(sd) & set(out))
        if clash:
            raise RuntimeError(f"model chunks share checkpoint keys {clash[:5]}")
        out.update(sd)
    return out


def _state_dict(model, optimizer, with_optimizer: bool, with_rng: bool,
                for_load: bool = True) -> Tuple[Dict[str, Any], List[str]]:
    """The DCP state dict, and the optimizer's main-weight keys left out of it (``model.<key>`` holds them;
    a save does not even copy them)."""
    state: Dict[str, Any] = {"model": model_state_dict(model)}
    mains: List[str] = []
    if with_optimizer:
        opt = optimizer.state_dict(main_weights=for_load)
        mains = [k for k in opt if k.startswith("main.")]
        state["optimizer"] = {k: v for k, v in opt.items() if not k.startswith("main.")}
    if with_rng:
        state["rng"] = {f"rank{dist.get_rank()}": rng_state()}
    return state, mains


# ------------------------------------------------------------------------ save
# DCP writes each tensor item with torch.save: ~1.6 KB of zip framing around its bytes (measured, torch 2.x).
ITEM_OVERHEAD = 1600
# common.json (every argument), manifest.json and DCP's .metadata: a base and a part per written item.
FIXED_OVERHEAD, METADATA_PER_ITEM = 64 << 10, 400


def write_items(state: Mapping[str, Any]) -> Iterator[Tuple[str, Any, Any]]:
    """``(key, value, item)`` for each piece DCP writes for this rank in a save of ``state`` (``_create_write_items``:
    this rank's shard of each DTensor, its plain tensors and pickled objects; no collective)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.planner_helpers import _create_write_items

    flat, _ = flatten_state_dict(dict(state))
    for key, value in flat.items():
        for item in _create_write_items(key, value):
            yield key, value, item


def tensor_item_bytes(item) -> int:
    """The bytes of a tensor piece (``item.tensor_data`` set): its chunk's elements at its dtype."""
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def _item_bytes(item, value) -> int:
    if item.tensor_data is None:  # a pickled object
        return (len(value) if isinstance(value, (bytes, bytearray)) else 256) + ITEM_OVERHEAD
    return tensor_item_bytes(item) + ITEM_OVERHEAD


def estimate_bytes(state: Mapping[str, Any], group=None) -> int:
    """Bytes a save of ``state`` writes, over all ranks of ``group`` (a collective; the same number on every rank).

    Each rank lists the pieces DCP will write for it (``_create_write_items``: this rank's shard of each
    DTensor, its plain tensors and pickled objects) by their index (key and offset); a piece several ranks
    hold (a replica: no_shard, the outer axis of HSDP, a tensor every rank has) is written once, so the union
    of the ranks' indexes is counted, each once. (Counting every DTensor's global size on every rank made the
    estimate grow with the rank count and refuse saves that fit.) Every rank writes into the one ``--save``
    directory: the pieces add up on its file system.
    """
    mine: Dict[Tuple[str, Tuple[int, ...]], int] = {}
    for _key, value, item in write_items(state):
        mine[(item.index.fqn, tuple(item.index.offset or ()))] = _item_bytes(item, value)
    gathered: List[Optional[Dict]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    union: Dict = {}
    for per_rank in gathered:
        union.update(per_rank)
    return sum(union.values()) + FIXED_OVERHEAD + METADATA_PER_ITEM * len(union)


def _prepare_directory(config: CheckpointConfig, iteration: int, state: Mapping[str, Any], group=None) -> Path:
    """All ranks: the temporary directory of this save, after checking the free space (a collective on ``group``).

    Rank 0 creates ``--save``, checks the checkpoint's size (``estimate_bytes``) against
    the free space and marks the temporary directory as this job's (``checkpoint_paths``);
    a problem is raised on every rank as one line, before anything is written.
    """
    rank, root = dist.get_rank(), Path(config.save)
    needed_bytes = estimate_bytes(state, group)
    plan: List[Any] = [None, None]
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            plan = [files.new_nonce(), paths.space_problem(root, iteration, needed_bytes, paths.free_bytes(root))]
            if plan[1] is None:
                ownership.write_owner(files.temporary_dir(root, iteration, plan[0]))
        except OSError as exc:
            plan = [None, f"cannot save to --save {root}: {exc.strerror or exc}"]
    dist.broadcast_object_list(plan, src=0, group=group)
    if plan[1]:
        raise CheckpointError(plan[1])
    return files.temporary_dir(root, iteration, plan[0])


def save_state_dict(model, optimizer, arena=None, defer: bool = False) -> Dict[str, Any]:
    """What a save writes: copies of this rank's pieces (into ``arena``'s host buffers when given:
    ``megatron/fsdp/checkpoint/staging.py``; ``defer``: the main weights' and optimizer state's copies only once
    ``arena.copy_deferred()`` runs)."""
    from megatron.fsdp.checkpoint.staging import staging_into

    if arena is None:
        return _state_dict(model, optimizer, with_optimizer=True, with_rng=True, for_load=False)[0]
    with staging_into(arena, defer):
        return _state_dict(model, optimizer, with_optimizer=True, with_rng=True, for_load=False)[0]


@dataclasses.dataclass
class Snapshot:
    """This rank's part of a save, taken on the training thread: host copies of its pieces and (rank 0)
    ``common.json``. Everything after it (plan, write, publish) may run on another thread."""

    iteration: int
    state: Dict[str, Any]
    common: Optional[Dict[str, Any]]
    copy_seconds: float


def snapshot(config: CheckpointConfig, iteration: int, consumed_samples: int, model, optimizer, scheduler, arena=None,
             defer: bool = False) -> Snapshot:
    """Step 0 of a save (this rank, no collective): copies of this rank's pieces in host memory (into
    ``arena``'s buffers when given; ``defer``: see ``save_state_dict``) and, on rank 0, what ``common.json``
    will say."""
    from . import save_steps

    files.check_fault_spec(dist.get_world_size())
    start = time.perf_counter()
    state = save_steps.host_copies(save_state_dict(model, optimizer, arena, defer))
    common = None if dist.get_rank() != 0 else common_record(config.record, iteration, consumed_samples, scheduler)
    return Snapshot(iteration, state, common, time.perf_counter() - start)


def common_record(record: Mapping[str, Any], iteration: int, consumed_samples: int, scheduler) -> Dict[str, Any]:
    """What ``common.json`` says: iteration, samples, the schedule, the model's and the layout's arguments, and
    every argument of the run (``record``)."""
    return {
        "format": FORMAT, "version": VERSION, "manifest": manifest.MANIFEST, "iteration": iteration,
        "consumed_train_samples": consumed_samples, "world_size": dist.get_world_size(),
        "scheduler": scheduler.state_dict(), "model_args": model_args(record),
        "parallel_layout": parallel_layout(record),
        "args": {k: _json_value(v) for k, v in sorted(record.items())},
    }


def plan_snapshot(config: CheckpointConfig, snap: Snapshot, group=None):
    """Step 1 of a save (all ranks of ``group``, any thread): the temporary directory (after the free-space
    check) and DCP's agreed plan; returns a ``save_steps.StagedSave`` for ``write_step`` and ``save_steps.finish``."""
    from . import save_steps

    tmp = _prepare_directory(config, snap.iteration, snap.state, group)
    return save_steps.stage(snap.state, tmp, Path(config.save), snap.iteration, snap.common, snap.copy_seconds,
                            group)


def stage_checkpoint(config: CheckpointConfig, iteration: int, consumed_samples: int, model, optimizer, scheduler,
                     arena=None):
    """Steps 0 and 1 of a synchronous save (all ranks, the training thread): ``snapshot`` and ``plan_snapshot``.

    Before them every rank waits for the slowest to reach the save (logged apart:
    rank skew, not the save's cost).
    """
    arrived = time.perf_counter()
    dist.all_reduce(torch.zeros(1))  # every rank at the save: waiting for the slowest is not the save's cost
    start = time.perf_counter()
    staged = plan_snapshot(config, snapshot(config, iteration, consumed_samples, model, optimizer, scheduler, arena))
    staged.arrival_seconds = start - arrived
    return staged


def write_step(staged):
    """Step 2 (this rank alone, any thread): the DCP write of this rank's files, checksummed while
    written (``checkpoint_manifest``); running out of space becomes one line naming the directory,
    the bytes needed and free. The one function a background writer calls."""
    from . import save_steps

    try:
        return save_steps.write_pieces(staged)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - one line below, or re-raised
        if not paths.is_out_of_space(exc, staged.root):
            raise
        raise CheckpointError(
            f"saving iteration {staged.iteration} to {staged.root} ran out of space (ENOSPC): "
            f"{paths.free_bytes(staged.root)} bytes are free; the partial save was removed, "
            "earlier checkpoints are intact") from None


def save_checkpoint(config: CheckpointConfig, iteration: int, consumed_samples: int, model, optimizer,
                    scheduler) -> Path:
    """Write ``--save``'s ``iter_XXXXXXX`` atomically (all ranks); returns its path."""
    from . import save_steps

    if config.ckpt_format == "torch_dist":  # the Megatron-Core DDP baseline
        from . import torch_dist as torch_dist_checkpoint

        return torch_dist_checkpoint.save_checkpoint(config, iteration, consumed_samples, model, optimizer, scheduler)

    start = time.perf_counter()
    staged = stage_checkpoint(config, iteration, consumed_samples, model, optimizer, scheduler)
    try:
        results = write_step(staged)
    except (Exception, CheckpointException) as exc:  # every rank learns of it in ``finish`` and raises it
        results = files.failure_as_value(exc)
    final = save_steps.finish(staged, results)
    print_rank_0(f" saved checkpoint at iteration {iteration:8d} to {final} in "
                 f"{time.perf_counter() - start - staged.arrival_seconds:.3f} s (after "
                 f"{staged.arrival_seconds:.3f} s waiting for the slowest rank to reach the save)")
    return final


def checkpoint_problems(directory: Path) -> List[str]:
    """What is wrong with a checkpoint, checked against its manifest (each rank a share; a collective; the same
    list on every rank): damaged or missing files, a missing ``.metadata``, a manifest it must have and lacks."""
    mine = manifest.verify(directory, dist.get_rank(), dist.get_world_size())
    gathered: List[Optional[List[str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    problems = sorted(p for per_rank in gathered for p in per_rank)
    if not problems and not (Path(directory) / ".metadata").is_file():
        problems = [f"{Path(directory) / '.metadata'} is missing"]
    return problems


def verify_checkpoint(directory: Path) -> None:
    """``checkpoint_problems`` as one line naming the damage and the newest other checkpoint that verifies."""
    problems = checkpoint_problems(directory)
    if not problems and not (Path(directory) / manifest.MANIFEST).is_file():
        print_rank_0(f" checkpoint {directory} has no {manifest.MANIFEST} (published before manifests existed): its "
                     "files are not verified")
    source = None if problems else manifest.read_source(directory)
    if source is not None and not source.get("verified"):
        print_rank_0(f" checkpoint {directory}: its files are as they were converted; {manifest.source_line(source)}")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        good = manifest.previous_good(Path(directory).parent, Path(directory))
        hint = (f"; load the previous good checkpoint with --ckpt-step {good}" if good is not None
                else f"; no other complete checkpoint in {Path(directory).parent} verifies")
        raise CheckpointError(f"checkpoint {directory} is damaged: {problems[0]}{more}{hint}")


# ------------------------------------------------------------------------ the --save lock
def hold_save_directory(config: CheckpointConfig) -> None:
    """At start-up (all ranks, a collective of the world group): rank 0 takes ``--save``'s lock; a live holder
    stops every rank with the same line, before anything is saved."""
    if not config.save:
        return
    verdict: list = [None, None]
    if dist.get_rank() == 0:
        try:
            verdict = list(ownership.acquire_save_lock(Path(config.save)))
        except OSError as exc:
            verdict = [f"--save {config.save}: cannot take its lock file ({exc.strerror or exc})", None]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[1]:
        print_rank_0(verdict[1])
    if verdict[0]:
        raise CheckpointError(verdict[0])
    _held_save.append(Path(config.save))


def release_save_directory() -> None:
    """At the end of the job however it ends, a failed build included (rank 0; nothing elsewhere or if not held)."""
    while _held_save:
        ownership.release_save_lock(_held_save.pop())


# ------------------------------------------------------------------------ load
def validate_keys(state: Mapping[str, Any], directory: Path, prefixes: Tuple[str, ...], reader=None,
                  unread=lambda key: False) -> None:
    """Compare the union of every rank's state dict with the checkpoint (a collective; the same verdict everywhere).

    Checkpoint keys under ``prefixes`` must all be asked for, every asked key must
    exist with the same shape, dtype and kind (the engine's rule: ``megatron.fsdp.checkpoint.metadata``).
    ``reader``: the checkpoint's metadata as that storage reader gives it (a layout-1 checkpoint's,
    translated); ``unread(key)``: checkpoint keys this load leaves (FP8 scaling state of another recipe).
    Raises ``CheckpointError`` naming them.
    """
    gathered: List[Optional[Dict[str, Tuple]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, describe_state_dict(state))
    wanted: Dict[str, Tuple] = {}
    wrong = []
    for desc in gathered:
        for key, d in desc.items():
            if wanted.setdefault(key, d) != d:
                wrong.append(f"{key} (ranks disagree: {show(wanted[key])} vs {show(d)})")
    saved = {k: d for k, d in describe_checkpoint(directory, reader).items() if not unread(k)}
    missing, unexpected, mismatched = key_mismatches(wanted, saved, prefixes, label="model")
    error = mismatch_error(f"checkpoint {directory} does not fit this model", sorted(missing), sorted(unexpected),
                           wrong + sorted(mismatched))
    if error is not None:
        raise CheckpointError(str(error) + expert_layout_hint(missing, unexpected))


def tp_global(common: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's keys and shapes are TP-global as stored (else ``checkpoint_v1`` translates them).

    Layout version 2 always; version 1 when it was written without tensor
    parallelism and without grouped-GEMM experts (its keys and shapes are then
    the same as version 2's: this job had no SwiGLU then).
    """
    if common.get("version", 1) >= 2:
        return True
    saved = common.get("model_args", {})
    return (saved.get("tensor_model_parallel_size") in (1, None)
            and saved.get("expert_tensor_parallel_size") in (1, None) and not saved.get("moe_grouped_gemm"))


def layout_v1_reader(model, directory: Path):
    """A storage reader that shows a layout-1 checkpoint in TP-global terms (a collective: every rank's split
    rules are gathered, so that all translate every key alike, under PP too)."""
    from . import layout_v1 as checkpoint_v1

    mine = {k: v for chunk in model for k, v in chunk.split_rules().items()}
    gathered: List[Optional[Dict[str, Tuple]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    rules = {k: checkpoint_v1.Rule(*v) for per_rank in gathered for k, v in per_rank.items()}
    return checkpoint_v1.TranslatedReader(directory, rules)


def check_model_args(common: Mapping[str, Any], record: Mapping[str, Any], directory: Path) -> None:
    """Name every argument that fixes the model's shape or numerics and differs from the checkpoint's.

    TP, expert TP and EP sizes may change (every checkpoint loads in TP-global
    terms), and the padded vocabulary where the tokenizer's size is recorded
    (padding rows are cut or added: ``load_checkpoint``). ``record``: this run's arguments.
    """
    if common.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {directory} has format {common.get('format')!r}, expected {FORMAT!r}")
    saved, now = common.get("model_args", {}), model_args(record)
    free = set(KEY_LAYOUT_ARGS) | {"expert_model_parallel_size"}
    if saved.get("true_vocab_size") is not None:
        free.add("padded_vocab_size")
    diffs = [f"--{k.replace('_', '-')} {saved.get(k)!r} in the checkpoint, {v!r} now"
             for k, v in now.items() if k in saved and saved[k] != v and k not in free]
    diffs += compatibility.numeric_differences(common.get("args", {}), record)
    if diffs:
        raise CheckpointError(f"checkpoint {directory} was saved with a different model: " + "; ".join(diffs))


def _check_not_torch_dist(directory: Path) -> None:
    from . import torch_dist as torch_dist_checkpoint

    if not (directory / files.COMMON).is_file() and torch_dist_checkpoint.is_torch_dist(directory):
        raise CheckpointError(
            f"checkpoint {directory} is a torch_dist checkpoint (the Megatron-Core DDP baseline's format); "
            f"--use-megatron-fsdp loads fsdp_dtensor: convert it with {CONVERT} "
            f"from-torch-dist {directory.parent} FSDP_DIR and pass --load FSDP_DIR")


def check_save_directory(config: CheckpointConfig, start_iteration: int) -> None:
    """At start-up, after the load (all ranks, a collective when checkpoints newer than ``start_iteration`` exist):
    no save of this run may overwrite a newer checkpoint of ``--save`` that verifies (``paths``)."""
    if not config.save or not Path(config.save).is_dir():
        return
    fsdp = config.ckpt_format == FORMAT
    problem = paths.newer_checkpoint_problem(Path(config.save), start_iteration,
                                             checkpoint_problems if fsdp else (lambda directory: []),
                                             files.is_complete if fsdp else _torch_dist_complete)
    if problem:
        raise CheckpointError(problem)


def _torch_dist_complete(directory: Path) -> bool:
    from . import torch_dist as torch_dist_checkpoint

    return torch_dist_checkpoint.is_torch_dist(directory)


def load_checkpoint(config: CheckpointConfig, model, optimizer, scheduler) -> Tuple[int, int]:
    """Load ``--load`` into model, optimizer, scheduler and RNG; returns ``(iteration, consumed samples)``.

    Without a checkpoint (no tracker yet: the first run of a job that saves and
    loads the same directory) it says so and starts from scratch.
    """
    if config.ckpt_format == "torch_dist":  # the Megatron-Core DDP baseline
        from . import torch_dist as torch_dist_checkpoint

        return torch_dist_checkpoint.load_checkpoint(config, model, optimizer, scheduler)
    start = time.perf_counter()
    directory = find_checkpoint(config.load, config.ckpt_step, problems=checkpoint_problems)
    if directory is None:
        print_rank_0(f" no checkpoint in {config.load} (no {files.TRACKER}, no complete iter_*): starting from scratch")
        return 0, 0
    return load_directory(config, model, optimizer, scheduler, directory, start)


def _read_pieces(state: Dict[str, Any], directory: Path, prefixes: Tuple[str, ...], reader=None,
                 unread=lambda key: False) -> None:
    """Fill ``state`` from a checkpoint all ranks wrote together (a collective: the keys are checked first)."""
    validate_keys(state, directory, prefixes, reader, unread)
    dcp.load(state, storage_reader=reader or dcp.FileSystemReader(str(directory)))


def load_directory(config: CheckpointConfig, model, optimizer, scheduler, directory: Path, start: float,
                   verify: bool = True, read_pieces=_read_pieces) -> Tuple[int, int]:
    """Load one checkpoint directory (``load_checkpoint`` after choosing it; ``non_persistent`` too).

    ``verify``: check the manifest here (False: the caller verified it). ``read_pieces(state, directory,
    prefixes, reader)`` fills the state dict (a per-rank reader for a local checkpoint: ``non_persistent``).
    """
    _check_not_torch_dist(directory)
    if verify:
        verify_checkpoint(directory)
    common = files.read_common(directory)
    check_model_args(common, config.record, directory)
    if not config.finetune and common["iteration"] > config.train_iters:
        raise CheckpointError(f"--train-iters {config.train_iters} is below the iteration of checkpoint {directory} "
                              f"({common['iteration']}): nothing would train; pass a larger --train-iters")
    with_optimizer = not (config.finetune or config.no_load_optim)
    with_rng = not (config.finetune or config.no_load_rng)
    if with_rng and common.get("converted_from") and not common.get("converted_rng"):
        print_rank_0(f" checkpoint converted from {common['converted_from']}: it has no RNG states (not restored)")
        with_rng = False
    if with_rng and common["world_size"] != dist.get_world_size():
        print_rank_0(f" checkpoint saved on {common['world_size']} ranks, loading on {dist.get_world_size()}: "
                     "RNG states not restored")
        with_rng = False
    if with_optimizer:  # the schedule's verdict, before anything is read (the same on every rank)
        problem = compatibility.scheduler_problem(common.get("scheduler") or {}, scheduler, directory)
        if problem:
            raise CheckpointError(problem)
    reader = None if tp_global(common) else layout_v1_reader(model, directory)
    rows, padded = common["model_args"].get("padded_vocab_size"), config.record.get("padded_vocab_size")
    if rows is not None and rows != padded:
        print_rank_0(f" checkpoint padded vocabulary {rows} rows, this model {padded}: "
                     + ("padding rows cut" if rows > padded
                        else "the added padding rows keep this model's initial values (optimizer state zero)"))
    for chunk in model:  # the keys and coordinates the checkpoint was written in
        chunk.use_checkpoint_layout(vocab_rows=rows)
    dcp_keys = describe_checkpoint(directory, reader) if reader or (directory / ".metadata").is_file() else None
    scaling = fp8_state.plan(common.get("args", {}), dcp_keys, config.record, directory)
    if scaling.line:
        print_rank_0(scaling.line)
    try:
        state, mains = _state_dict(model, optimizer, with_optimizer, with_rng)
        prefixes = ("model.",) + (("optimizer.",) if with_optimizer else ()) + (("rng.",) if with_rng else ())
        kept = {} if scaling.load else {k: state["model"].pop(k) for k in list(state["model"])
                                         if fp8_state.is_scaling_state(k)}  # this run's own values, loaded back
        read_pieces(state, directory, prefixes, reader,
                    **({} if scaling.load else {"unread": fp8_state.is_scaling_state}))
        state["model"].update(kept)
        for chunk in model:
            keys = set(chunk.checkpoint_keys().to_global.values())
            chunk.load_state_dict({k: v for k, v in state["model"].items() if k in keys})
        if with_optimizer:
            bounds = compatibility.lr_bounds(optimizer)
            optimizer.load_state_dict({**state["optimizer"], **{k: state["model"][k[5:]] for k in mains}})
            if common.get("scheduler"):
                compatibility.load_scheduler(common["scheduler"], scheduler, optimizer, bounds)
    finally:
        for chunk in model:
            chunk.use_checkpoint_layout()
    if with_rng:
        set_rng_state(state["rng"][f"rank{dist.get_rank()}"])
    iteration, consumed = (0, 0) if config.finetune else (common["iteration"], common["consumed_train_samples"])
    print_rank_0(f" loaded checkpoint {directory} (iteration {common['iteration']}) in "
                 f"{time.perf_counter() - start:.2f} s"
                 + compatibility.weights_only_suffix(config.finetune, config.weights_only_purpose))
    return iteration, consumed

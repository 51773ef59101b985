"""``--ckpt-format torch_dist``: the Megatron-Core DDP baseline saves and loads with Megatron-Core's own
``dist_checkpointing`` (the format Megatron-LM users already have).

Why Megatron-Core's code and not ours: a Megatron-LM user's checkpoint must load here and
ours in Megatron-LM, so the state dict is the one Megatron-LM builds: ``model`` (``model0``,
``model1``, ... under virtual pipelining) from each ``GPTModel.sharded_state_dict``
(layers stacked along a leading layer dimension, TP shards as offsets of TP-global tensors),
``optimizer`` from the optimizer's own ``sharded_state_dict`` (the DistributedOptimizer in
Megatron-LM's default ``dp_reshardable`` layout: its flat buffers per bucket, loads at another DP
size; with ``--dist-ckpt-optim-fully-reshardable`` in ``fully_reshardable`` layout: per-parameter
``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`` in each parameter's global shape, so any
TP/PP/DP loads it; both convert to fsdp_dtensor; a load uses the layout the checkpoint names),
``rng_state`` (one ``ShardedObject`` per pipeline x tensor rank, as Megatron-LM), and the
common values Megatron-LM keeps (``iteration``, ``args``, ``checkpoint_version``,
``opt_param_scheduler``). The directory layout is Megatron-LM's
(``latest_checkpointed_iteration.txt``, ``iter_0000010/``), written into a temporary
directory and published atomically with the same protocol as ``fsdp_dtensor``
(``checkpoint_files.publish``).

On CPU/gloo the ``torch_dist`` strategy works as shipped (the CPU mode maps its CUDA calls);
the fully parallel save wrapper is not used (it exchanges shards with NCCL-sized buckets and
buys nothing on one host). Checkpoints converted from ``fsdp_dtensor``
(``megatron-fsdp-convert to-torch-dist``) hold the tensors but not the baseline
optimizer's bookkeeping (its param-group structure): the load takes that from the live
optimizer and the step count from ``converted.optimizer_step``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron.fsdp.commands import CONVERT

from . import files
from . import compatibility
from . import fp8_state
from .checkpoint_config import CheckpointConfig
from .compatibility import MODEL_SHAPE_ARGS
from .paths import find_checkpoint
from .files import CheckpointError
from megatron.fsdp.mcore_releases import TORCH_DIST_BUCKET_WRITER, read_torch_dist_common, torch_dist_load
from ..logs.lines import print_rank_0

FORMAT = "torch_dist"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's
# Megatron-LM's sharded_state_dict metadata: the DistributedOptimizer's layout (``dp_reshardable`` by default,
# ``fully_reshardable`` with --dist-ckpt-optim-fully-reshardable), layers stacked, no chained-optimizer prefix.
DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"
SHARDED_METADATA = {"distrib_optim_sharding_type": FULLY_RESHARDABLE, "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True}


def sharded_metadata(fully_reshardable: bool) -> Dict[str, Any]:
    """The metadata a save of this job writes (Megatron-LM's ``_build_sharded_state_dict_metadata``;
    ``fully_reshardable``: ``--dist-ckpt-optim-fully-reshardable``)."""
    layout = FULLY_RESHARDABLE if fully_reshardable else DP_RESHARDABLE
    return {**SHARDED_METADATA, "distrib_optim_sharding_type": layout}


def allow_args_in_common() -> None:
    """The common state holds ``args`` (a Namespace): allow it in ``torch.load``'s weights-only unpickler."""
    torch.serialization.add_safe_globals([argparse.Namespace])


def is_torch_dist(directory: Path) -> bool:
    try:
        return json.loads((Path(directory) / "metadata.json").read_text()).get("sharded_backend") == FORMAT
    except (OSError, ValueError):
        return False


def _unwrap(chunk):
    """The ``GPTModel`` inside Megatron-Core's DDP and Float16Module wrappers (they share its parameters)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    while isinstance(chunk, (DistributedDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk


def _model_key(i: int, count: int) -> str:
    return "model" if count == 1 else f"model{i}"


# ------------------------------------------------------------------------- RNG
def _rng_object(load: bool):
    """Megatron-LM's ``rng_state``: this rank's generators, one object per (PP, TP) rank, DP ranks replicas."""
    from megatron.core import parallel_state as ps, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = None
    if not load:
        tracker = tensor_parallel.get_cuda_rng_tracker()
        state = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                  "torch_rng_state": torch.get_rng_state(),
                  "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
                  "rng_tracker_states": tracker.get_states() if getattr(tracker, "states_", None) else None}]
    pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    return ShardedObject("rng_state", state, (pp, tp),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _set_rng(states: List[Dict[str, Any]]) -> None:
    from megatron.core import tensor_parallel

    state = states[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("cuda_rng_state") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    if state.get("rng_tracker_states") is not None:
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _keep_step_on_load(optimizer) -> None:
    """Adapter for a Megatron-Core 0.16.1 bug without Transformer Engine or Apex: torch's Adam keeps ``step``
    in each parameter's state, and ``fully_reshardable`` loading copies every state entry from the checkpoint,
    which has no ``step`` (it is restored from the param groups just before): KeyError; ``dp_reshardable``
    loading copies the ``step`` of the live optimizer's dummy initialisation over it (a wrong bias correction
    after the resume). Each parameter's own, restored ``step`` is passed through unchanged."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer) or "_set_main_param_and_optimizer_states" in vars(opt):
            continue
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, opt=opt, original=original):
            group, order = opt.model_param_group_index_map[model_param]
            state = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
            return original(model_param, tensors)
        opt._set_main_param_and_optimizer_states = set_states


def _unshare_steps(optimizer) -> None:
    """Adapter for the same path: it gives every parameter's Adam state one shared ``step`` tensor, and
    torch's single-tensor Adam increments it in place once per parameter, so the bias correction of the
    next update is wrong. Each parameter gets its own copy, as a fresh optimizer has."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


# ------------------------------------------------------------------ state dicts
def _create_optimizer_state(optimizer) -> None:
    """A fresh DistributedOptimizer has no Adam state, and its ``state_dict`` needs the step count: create it
    as Megatron-Core does for a load (one step on zero gradients), at learning rate 0, so no weight moves."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            lrs = [g["lr"] for g in opt.optimizer.param_groups]
            for g in opt.optimizer.param_groups:
                g["lr"] = 0.0
            opt._init_optimizer_states_with_dummy_values()
            for g, lr in zip(opt.optimizer.param_groups, lrs):
                g["lr"] = lr


def sharded_state_dict(model, optimizer, is_loading: bool, content: Dict[str, Any], with_optimizer: bool = True,
                       with_rng: bool = True) -> Dict[str, Any]:
    """Megatron-LM's ``generate_state_dict``: model chunks, optimizer (in ``content``'s layout) and RNG as
    sharded objects."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    metadata = ensure_metadata_has_dp_cp_group(dict(content))
    state: Dict[str, Any] = {}
    for i, chunk in enumerate(model):
        state[_model_key(i, len(model))] = _unwrap(chunk).sharded_state_dict(metadata=metadata)
    if with_optimizer:
        if is_loading:
            _create_optimizer_state(optimizer)
        model_sd = {k: v for k, v in state.items() if k.startswith("model")}
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    if with_rng:
        state["rng_state"] = _rng_object(load=is_loading)
    return state


# ------------------------------------------------------------------------ save
def _write_in_process(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """Megatron-Core's bucket writer (``mcore_releases.TORCH_DIST_BUCKET_WRITER``) without its worker per bucket: the same
    per-bucket writer, run here. Forking a process that holds gloo threads is fragile, and a daemon
    process (a worker pool) may not fork at all."""
    import queue

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results: "queue.Queue" = queue.Queue()
    count: "queue.Queue" = queue.Queue()
    out: Any = {}
    for i, bucket in enumerate(write_buckets):
        count.put(i)
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, results, count, True,
                                                   **({"use_msc": use_msc} if use_msc else {}))
        index, written = results.get()
        if isinstance(written, Exception):
            out = written
            break
        out[index] = written
    global_results_queue.put(out)


@contextlib.contextmanager
def _in_process_writes():
    """Adapter: Megatron-Core's torch_dist writer forks one process per bucket and keeps its results in a
    ``multiprocessing.Manager`` queue (another process); here both stay in this process."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if fa._results_queue is None:
        fa._results_queue = queue.Queue()
    original = fa.FileSystemWriterAsync.__dict__[TORCH_DIST_BUCKET_WRITER]
    setattr(fa.FileSystemWriterAsync, TORCH_DIST_BUCKET_WRITER, staticmethod(_write_in_process))
    try:
        yield
    finally:
        setattr(fa.FileSystemWriterAsync, TORCH_DIST_BUCKET_WRITER, original)


def save_checkpoint(config: CheckpointConfig, iteration: int, consumed_samples: int, model, optimizer,
                    scheduler) -> Path:
    """``dist_checkpointing.save`` into a temporary directory, then rank 0 publishes it (tracker last). The
    common state holds the run's arguments (``config.record``) as Megatron-LM's ``args``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    start = time.perf_counter()
    rank, root = dist.get_rank(), Path(config.save)
    plan: List[Any] = [None, None]
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            plan[0] = files.temporary_dir(root, iteration, files.new_nonce())
            plan[0].mkdir()
        except OSError as exc:
            plan[1] = f"cannot save to --save {root}: {exc.strerror or exc}"
    dist.broadcast_object_list(plan, src=0)
    if plan[1]:
        raise CheckpointError(plan[1])
    tmp: Path = plan[0]
    content = sharded_metadata(config.dist_ckpt_optim_fully_reshardable)
    state = sharded_state_dict(model, optimizer, is_loading=False, content=content)
    saved_args = argparse.Namespace(**config.record)
    saved_args.consumed_train_samples = consumed_samples  # where Megatron-LM keeps it
    saved_args.iteration = iteration
    state.update(args=saved_args, checkpoint_version=CHECKPOINT_VERSION, iteration=iteration,
                 opt_param_scheduler=scheduler.state_dict(), num_floating_point_operations_so_far=0)
    with _in_process_writes():  # one bucket per rank, written by this process
        dist_checkpointing.save(state, str(tmp), sharded_strategy=TorchDistSaveShardedStrategy(FORMAT, 1, thread_count=1),
                                content_metadata=content)  # ends with a barrier: every rank wrote
    final: List[Any] = [None]
    if rank == 0:
        files.fsync_dir(tmp)
        final[0] = files.publish(tmp, root, iteration)
    dist.broadcast_object_list(final, src=0)
    print_rank_0(f" saved checkpoint at iteration {iteration:8d} to {final[0]} ({FORMAT}) in "
                 f"{time.perf_counter() - start:.2f} s")
    return final[0]


# ------------------------------------------------------------------------ load
def read_common(directory: Path) -> Dict[str, Any]:
    """The common state (``common.pt`` before Megatron-Core 0.19, inside the DCP files from 0.19): iteration,
    args, scheduler, the optimizer's non-tensor state."""
    allow_args_in_common()
    return read_torch_dist_common(directory)


def _check_model(saved_args, record: Mapping[str, Any], directory: Path) -> None:
    """The arguments that fix a parameter's shape must agree (TP, PP and DP may change: torch_dist reshards);
    ``saved_args``: the checkpoint's arguments, ``record``: this run's."""
    now = {k: record.get(k) for k in MODEL_SHAPE_ARGS}
    diffs = [f"--{k.replace('_', '-')} {getattr(saved_args, k, None)!r} in the checkpoint, {v!r} now"
             for k, v in now.items() if hasattr(saved_args, k) and getattr(saved_args, k) != v]
    diffs += compatibility.numeric_differences(vars(saved_args), record)
    if diffs:
        raise CheckpointError(f"checkpoint {directory} was saved with a different model: " + "; ".join(diffs))


def _check_dp_reshardable(saved_args, record: Mapping[str, Any], directory: Path) -> None:
    """``dp_reshardable`` optimizer state is the flat buffers of each model-parallel rank: it loads at another
    DP size only (Megatron-Core would stop on a bucket-size assertion)."""
    names = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
             "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size")
    diffs = [f"--{k.replace('_', '-')} {getattr(saved_args, k, None)} in the checkpoint, {record.get(k)} now"
             for k in names if getattr(saved_args, k, None) != record.get(k)]
    if diffs:
        raise CheckpointError(
            f"checkpoint {directory} holds the optimizer state in the dp_reshardable layout (Megatron-LM's default), "
            f"which loads at another data-parallel size only: {'; '.join(diffs)}. Load it at its own sizes and save "
            "with --dist-ckpt-optim-fully-reshardable, or load the weights only with --no-load-optim")


def _drop_from_request(state: Dict[str, Any], leave) -> List[Tuple[Tuple[str, ...], Any]]:
    """Remove from the request each sharded entry ``leave(entry)`` names; returns ``(path, value)`` pairs to put back
    for ``load_state_dict``: None for an ``_extra_state`` object (None for local layers), this run's own tensor
    for FP8 scaling state the load leaves (``fp8_state``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    dropped: List[Tuple[Tuple[str, ...], Any]] = []

    def walk(d: dict, path: Tuple[str, ...]):
        for k in list(d):
            v = d[k]
            if isinstance(v, dict):
                walk(v, path + (k,))
            elif isinstance(v, (ShardedObject, ShardedTensor)) and leave(v):
                dropped.append((path + (k,), v.data if isinstance(v, ShardedTensor) else None))
                del d[k]
    walk(state, ())
    return dropped


def _left_by_this_load(saved_keys, scaling: fp8_state.ScalingStatePlan):
    """What the load does not request: ``_extra_state`` objects the checkpoint lacks (a converted one has none),
    and FP8 scaling state of another recipe."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    def leave(v) -> bool:
        if isinstance(v, ShardedObject):
            return v.key.endswith("_extra_state") and v.unique_key not in saved_keys
        return not scaling.load and fp8_state.is_scaling_state(v.key)
    return leave


def _put_back(loaded: Dict[str, Any], dropped: List[Tuple[Tuple[str, ...], Any]]) -> None:
    for path, value in dropped:
        d = loaded
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = value


def _live_common(value):
    """The non-sharded leaves of a sharded state dict (the live optimizer's bookkeeping), or a marker."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if isinstance(value, dict):
        return {k: _live_common(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_live_common(v) for v in value]
    return _SKIP if isinstance(value, ShardedBase) else value


_SKIP = object()


def _fill_missing(loaded, live) -> None:
    """Add to ``loaded`` every entry of ``live`` it lacks (a converted checkpoint has no optimizer bookkeeping).

    Lists pair up element by element: the non-distributed optimizers' param groups come back from the checkpoint
    holding only their parameters, and take their hyperparameters (``wd_mult``, ...) from the live optimizer."""
    if isinstance(loaded, dict) and isinstance(live, dict):
        for k, v in live.items():
            if k not in loaded:
                if v is not _SKIP:
                    loaded[k] = v
            else:
                _fill_missing(loaded[k], v)
    elif isinstance(loaded, list) and isinstance(live, list) and len(loaded) == len(live):
        for item, live_item in zip(loaded, live):
            _fill_missing(item, live_item)


def _set_step(optimizer_state: Dict[str, Any], step: int) -> None:
    """The Adam step count of a converted checkpoint, where each Megatron-Core optimizer keeps it."""
    inner = optimizer_state.get("optimizer", optimizer_state)
    for group in inner.get("param_groups", []):
        if "step" in group:
            group["step"] = step
    if "state" in inner and isinstance(inner["state"], dict):
        inner["state"]["common_step"] = torch.tensor(float(step)) if step else None


def load_checkpoint(config: CheckpointConfig, model, optimizer, scheduler) -> Tuple[int, int]:
    """Load ``--load`` (a torch_dist checkpoint) into the baseline; returns ``(iteration, consumed samples)``."""
    from torch.distributed.checkpoint import FileSystemReader

    start = time.perf_counter()
    directory = find_checkpoint(config.load, config.ckpt_step, complete=is_torch_dist)
    if directory is None:
        print_rank_0(f" no checkpoint in {config.load} (no {files.TRACKER}): starting from scratch")
        return 0, 0
    if not is_torch_dist(directory):
        raise CheckpointError(
            f"checkpoint {directory} is not a torch_dist checkpoint (no metadata.json naming torch_dist); an "
            f"fsdp_dtensor checkpoint converts with: {CONVERT} to-torch-dist {config.load} OUT")
    common = read_common(directory)
    saved_args = common["args"]
    _check_model(saved_args, config.record, directory)
    if not config.finetune and int(common["iteration"]) > config.train_iters:
        raise CheckpointError(f"--train-iters {config.train_iters} is below the iteration of checkpoint {directory} "
                              f"({common['iteration']}): nothing would train; pass a larger --train-iters")
    converted = common.get("converted") or {}
    with_optimizer = not (config.finetune or config.no_load_optim)
    problem = compatibility.scheduler_problem(common.get("opt_param_scheduler") or {}, scheduler, directory)
    if with_optimizer and problem:
        raise CheckpointError(problem)
    same_model_parallel = all(getattr(saved_args, k, None) == config.record[k] for k in
                              ("tensor_model_parallel_size", "pipeline_model_parallel_size"))
    # Megatron-LM's load: the layout the checkpoint was saved in (older checkpoints have no content metadata)
    content = common.get("content_metadata") or dict(SHARDED_METADATA)
    if with_optimizer and content.get("distrib_optim_sharding_type") == DP_RESHARDABLE:
        _check_dp_reshardable(saved_args, config.record, directory)
    with_rng = not (config.finetune or config.no_load_rng) and same_model_parallel and "rng" not in converted.get(
        "missing", ())
    if not (config.finetune or config.no_load_rng) and not with_rng:
        print_rank_0(" RNG states not restored: " + ("the checkpoint was converted and has none" if same_model_parallel
                     else "saved at another tensor or pipeline parallel size (they are per rank)"))
    state = sharded_state_dict(model, optimizer, is_loading=True, content=content, with_optimizer=with_optimizer,
                               with_rng=with_rng)
    saved_keys = set(FileSystemReader(str(directory)).read_metadata().state_dict_metadata)
    scaling = fp8_state.plan(vars(saved_args), saved_keys, config.record, directory)
    if scaling.line:
        print_rank_0(scaling.line)
    dropped = _drop_from_request(state, _left_by_this_load(saved_keys, scaling))
    live = _live_common(state)
    try:
        loaded = torch_dist_load(state, directory)
    except Exception as exc:  # CheckpointingException: missing keys, shape mismatches (the same on every rank)
        raise CheckpointError(f"checkpoint {directory} does not fit this model: {exc}") from None
    _put_back(loaded, dropped)
    if converted:
        _fill_missing(loaded, live)
    for i, chunk in enumerate(model):
        _unwrap(chunk).load_state_dict(loaded[_model_key(i, len(model))], strict=True)
    if with_optimizer:
        if converted:
            _set_step(loaded["optimizer"], int(converted.get("optimizer_step", 0)))
        _keep_step_on_load(optimizer)
        bounds = compatibility.lr_bounds(optimizer)
        # no_grad: Megatron-Core 0.16.1 copies dp_reshardable state into fp32 main params that are views of the
        # model's leaf parameters without it (autograd refuses; its fully_reshardable load has the guard)
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        _unshare_steps(optimizer)
        if common.get("opt_param_scheduler"):
            compatibility.load_scheduler(common["opt_param_scheduler"], scheduler, optimizer, bounds)
    if with_rng:
        _set_rng(loaded["rng_state"])
    iteration = int(common["iteration"])
    consumed = int(getattr(saved_args, "consumed_train_samples", 0))
    print_rank_0(f" loaded checkpoint {directory} ({FORMAT}, iteration {iteration}) in "
                 f"{time.perf_counter() - start:.2f} s"
                 + compatibility.weights_only_suffix(config.finetune, config.weights_only_purpose))
    return (0, 0) if config.finetune else (iteration, consumed)

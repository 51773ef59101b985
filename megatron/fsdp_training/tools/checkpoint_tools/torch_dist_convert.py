"""torch_dist (Megatron-Core dist_checkpointing, the baseline's format) <-> fsdp_dtensor (``--use-megatron-fsdp``).

    megatron-fsdp-convert from-torch-dist TORCH_DIST_DIR FSDP_DIR   # then --use-megatron-fsdp --load FSDP_DIR
    megatron-fsdp-convert to-torch-dist FSDP_DIR TORCH_DIST_DIR     # then the baseline --load TORCH_DIST_DIR

Both formats are torch DCP files underneath with TP-global tensors, so a conversion is a
renaming and a reshape, in one process without a process group:

- model weights: torch_dist stacks the layers (``decoder.layers.<name>``, a leading layer
  dimension, Megatron-Core's default), fsdp_dtensor keeps one tensor per layer
  (``model.decoder.layers.<i>.<name>``); SwiGLU ``linear_fc1`` is ``[2 x ffn, hidden]`` in
  torch_dist and ``[2, ffn, hidden]`` in fsdp_dtensor (the same row-major data).
  fsdp_dtensor's model weights are the fp32 main weights: from torch_dist they come from
  the optimizer's fp32 copy (``optimizer.state.param``/``fp32_param``) where there is one;
- MoE (torch_dist -> fsdp_dtensor only): Megatron-Core's SequentialMLP experts are stacked
  ``[layers, experts, ...]`` (``decoder.layers.mlp.experts.experts.<name>``, global expert
  numbers), fsdp_dtensor keeps ``decoder.layers.<i>.mlp.experts.local_experts.<e>.<name>``; the
  ChainedOptimizer's states (dense, experts) give the param groups and the step. GroupedMLP
  (``--moe-grouped-gemm``) experts are refused;
- Adam state: torch_dist's model-space layouts (the DistributedOptimizer's ``fully_reshardable``,
  Megatron-Core's non-distributed optimizers: ``optimizer.state.{exp_avg,exp_avg_sq}.<key>``)
  <-> ``optimizer.state.<key>.<name>``; the step count and hyperparameters per param group.
  Megatron-LM's (and the baseline's) default ``dp_reshardable`` layout (flat per-bucket
  buffers) is sliced per parameter first (``torch_dist_dp_layout.py``; TP 1 and PP 1, else
  weights only, said with the fix: ``--dist-ckpt-optim-fully-reshardable``);
- iteration, consumed samples and the LR schedule are carried; RNG states torch_dist ->
  fsdp_dtensor only (each rank of the saved layout gets its (PP, TP) rank's ``rng_state``;
  a load at another world size says it skips them); fsdp_dtensor -> torch_dist has none.

Memory: each tensor is read on its own (DCP reads only that key's chunks), and the
writer asks for each tensor only when it writes it (``_LazyPlanner``): a stacked
torch_dist tensor (one weight of every layer) is the largest piece this code holds. DCP's
file writer was seen to keep more resident (a synthetic 160 MB write peaked ~200 MB above
the import); peak memory on a large model is not measured yet.
"""

from __future__ import annotations

import argparse
import json
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from . import output
from .torch_dist_dp_layout import EXPERTS, STACKED, DpReshardable, SavedLayout, WeightsOnly, is_dp_reshardable

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
ADAM = ("exp_avg", "exp_avg_sq")
# Megatron-Core's checkpoint names for the local spec's separate norms (its sharded_state_dict_keys_map: the
# Transformer Engine layout, where the norm is fused into the next linear) <-> the module names.
NORMS = ((".self_attention.linear_qkv.layer_norm_", ".input_layernorm."),
         (".mlp.linear_fc1.layer_norm_", ".pre_mlp_layernorm."))


def module_name(td_name: str) -> str:
    for td, module in NORMS:
        if td in f".{td_name}":
            return f".{td_name}".replace(td, module, 1)[1:]
    return td_name


def torch_dist_name(name: str) -> str:
    for td, module in NORMS:
        if module in f".{name}":
            return f".{name}".replace(module, td, 1)[1:]
    return name
MAIN_COPIES = ("param", "fp32_param")  # DistributedOptimizer's and Float16Optimizer's fp32 main weights
TORCH_DIST_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                       "common_backend": "torch", "common_backend_version": 1}


# ----------------------------------------------------------------- DCP pieces
def _metadata(directory: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(directory)).read_metadata()


def _tensor_keys(metadata) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {k: (tuple(md.size), md.properties.dtype) for k, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


def _read(directory: Path, keys: Dict[str, Tuple[Tuple[int, ...], torch.dtype]]) -> Dict[str, torch.Tensor]:
    """These tensors in full (one process; DCP reads only their chunks)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in keys.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _load_state_dict(state, storage_reader=FileSystemReader(str(directory)), no_dist=True)
    return state


def _lazy_planner(produce: Callable[[str], torch.Tensor]):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class _LazyPlanner(DefaultSavePlanner):
        """Plans from meta tensors (shape and dtype) and produces each tensor when the writer reaches it."""

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            return produce(write_item.index.fqn)
    return _LazyPlanner(dedup_save_to_lowest_rank=False)


def _write(tmp: Path, shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]], produce, objects: Dict[str, Any]):
    import torch.distributed.checkpoint as dcp

    state: Dict[str, Any] = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (shape, dtype) in shapes.items()}
    state.update(objects)
    with output.progress(len(shapes), "converting") as bar:
        def produce_one(key: str) -> torch.Tensor:
            bar.update(1)
            return produce(key)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp), thread_count=1),
                     planner=_lazy_planner(produce_one), no_dist=True)


def _fc1_gated(key: str, swiglu: bool) -> bool:
    return swiglu and re.search(r"\.linear_fc1\.(weight|bias)$", key) is not None


def _refuse_grouped_experts(num_experts: Optional[int], grouped_gemm: bool) -> None:
    if num_experts and grouped_gemm:
        raise SystemExit("the torch_dist converter handles MoE models with Megatron-Core's SequentialMLP experts; "
                         "--moe-grouped-gemm (GroupedMLP) experts are stored in another layout and are not converted yet")


def _refuse_moe(num_experts: Optional[int]) -> None:
    if num_experts:
        raise SystemExit("the torch_dist converter handles dense GPT models; MoE expert layouts differ between "
                         "the formats and are not converted yet")


# ------------------------------------------------------------ torch_dist -> fsdp
def _indices(shape, layers: int, stacked, experts):
    """The pieces of one torch_dist tensor: itself, one per layer, or one per layer and expert."""
    if experts:
        return [(i, e) for i in range(layers) for e in range(shape[1])]
    return [(i,) for i in range(layers)] if stacked else [()]


def _fsdp_name(td_key: str, index: tuple, stacked, experts) -> str:
    if experts:
        return module_name(f"decoder.layers.{index[0]}.mlp.experts.local_experts.{index[1]}.{experts.group(1)}")
    return module_name(f"decoder.layers.{index[0]}.{stacked.group(1)}" if stacked else td_key)


def _adam_group(source: Dict[str, Any], weight_decay: float) -> Dict[str, Any]:
    """One param group's hyperparameters as the engine's AdamW holds them (Megatron's extras left out)."""
    probe = torch.optim.AdamW([torch.zeros(1)], lr=float(source.get("lr", 1e-3)),
                              betas=tuple(source.get("betas", (0.9, 0.999))), eps=float(source.get("eps", 1e-8)),
                              weight_decay=weight_decay)
    group = {k: v for k, v in probe.param_groups[0].items() if k != "params"}
    # Megatron's per-group fields, which the engine's param groups carry too (the LR scheduler reads them)
    group.update({k: source.get(k, default) for k, default in (
        ("is_decoupled_lr", False), ("is_expert_parallel", False), ("lr_mult", 1.0),
        ("max_lr", source.get("lr", 1e-3)), ("min_lr", 0.0), ("wd_mult", 1.0 if weight_decay else 0.0))})
    return group


def _torch_dist_groups_and_step(optimizer: Dict[str, Any]) -> Tuple[list, int]:
    """Every param group and the step count; a ChainedOptimizer (MoE: the dense and the expert optimizer)
    saves one state per optimizer under keys 0, 1, ..."""
    parts = [optimizer[k] for k in sorted(k for k in optimizer if isinstance(k, int))] or [optimizer]
    groups, step = [], None
    for part in parts:
        inner = part.get("optimizer", part)
        groups += list(inner.get("param_groups", []))
        if step is None:
            step = next((g["step"] for g in groups if g.get("step") is not None), None)
        if step is None:
            step = (inner.get("state") or {}).get("common_step")  # Megatron-Core's non-distributed optimizers
    return groups, int(float(step)) if step is not None else 0


RNG = re.compile(r"^rng_state/shard_(\d+)\.(\d+)_(\d+)\.(\d+)$")  # one object per (PP, TP) rank


def _rng_objects(directory: Path, metadata, tp: int, pp: int, world: int) -> Dict[str, bytes]:
    """fsdp_dtensor's ``rng.rank<r>`` of each rank of the saved layout (``world`` ranks, ``tp`` x ``pp`` model
    parallel), from torch_dist's ``rng_state`` of that rank's (PP, TP) coordinates (Megatron's rank order: TP
    fastest, PP slowest; DP ranks share a state); empty where the checkpoint lacks some."""
    import pickle

    from megatron.fsdp_training.checkpointing.portable_state import portable
    from .torch_dist_dp_layout import read_objects

    keys = {tuple(int(x) for x in m.groups()[:2]): k for k in metadata.state_dict_metadata if (m := RNG.match(k))}
    if set(keys) != {(p, t) for p in range(pp) for t in range(tp)}:
        return {}
    states = read_objects(directory, keys.values())
    out = {}
    for rank in range(world):
        state = states[keys[(rank // (world // pp), rank % tp)]]
        state = state[0] if isinstance(state, list) else state
        out[f"rng.rank{rank}"] = pickle.dumps(portable({  # fsdp_dtensor's rng blob (save_load.rng_state)
            "python": state["random_rng_state"], "numpy": state["np_rng_state"], "torch": state["torch_rng_state"],
            "cuda": state.get("cuda_rng_state"), "tracker": state.get("rng_tracker_states")}))
    return out


def from_torch_dist(source: str, out: str, iteration: Optional[int] = None, overwrite: bool = False) -> Path:
    """A torch_dist checkpoint (the baseline's, or Megatron-LM's) as an fsdp_dtensor one under ``out``."""
    from megatron.fsdp_training.checkpointing import files
    from megatron.fsdp_training.checkpointing import save_load as checkpointing
    from megatron.fsdp_training.checkpointing.torch_dist import is_torch_dist
    from . import source as checked
    from .inspect import resolve

    directory = resolve(source, iteration)
    if not is_torch_dist(directory):
        raise SystemExit(f"error: {directory}: not a torch_dist checkpoint (no metadata.json naming torch_dist)")
    common = checked.check_torch_dist(directory)  # damaged files: one line, before anything is written
    args = common["args"]
    _refuse_grouped_experts(getattr(args, "num_experts", None), getattr(args, "moe_grouped_gemm", False))
    metadata = _metadata(directory)
    saved = _tensor_keys(metadata)
    layers = int(args.num_layers)
    optimizer = common.get("optimizer") or {}
    buckets, why = None, f"its layout ({optimizer.get('param_state_sharding_type')}) is not per parameter"
    if is_dp_reshardable(saved):  # Megatron-LM's default layout: per parameter from the flat buckets
        try:
            recorded = SavedLayout(num_layers=args.num_layers, **{
                name: getattr(args, name, None) for name in ("tensor_model_parallel_size",
                "pipeline_model_parallel_size", "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size",
                "expert_model_parallel_size")})
            buckets = DpReshardable(directory, recorded, saved, metadata.state_dict_metadata,
                                    lambda keys: _read(directory, keys))
        except WeightsOnly as exc:
            why = f"{exc}; or save it with --dist-ckpt-optim-fully-reshardable"
        else:
            optimizer = buckets.optimizer_common()
            saved.update({f"optimizer.state.{state}.{k}": saved[k] for (k, _) in buckets.slots
                          for state in buckets.saved_states()})
    with_optimizer = any(k.startswith("optimizer.state.exp_avg.") for k in saved)
    if optimizer and not with_optimizer:
        print(f"  optimizer state not converted: {why}; load the result with --no-load-optim")
    plan: Dict[str, Tuple[str, tuple]] = {}  # fsdp key -> (torch_dist key, index into it: (), (layer,), (layer, expert))
    swiglu = bool(getattr(args, "swiglu", False))
    shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
    for k in sorted(k for k in saved if not k.startswith(("optimizer.", "chained_"))):
        shape = saved[k][0]
        stacked, experts = STACKED.match(k), EXPERTS.match(k)
        main = next((f"optimizer.state.{m}.{k}" for m in MAIN_COPIES if f"optimizer.state.{m}.{k}" in saved), k)
        sources = [("model.{}", main)] + ([(f"optimizer.state.{{}}.{n}", f"optimizer.state.{n}.{k}") for n in ADAM]
                                         if with_optimizer else [])
        # Grouped by source tensor: the writer takes them in this order (within a size), one read each.
        for pattern, td_key in sources:
            for index in _indices(shape, layers, stacked, experts):
                name = _fsdp_name(k, index, stacked, experts)
                inner = shape[len(index):]
                if _fc1_gated(name, swiglu):
                    inner = (2, inner[0] // 2) + inner[1:]
                plan[pattern.format(name)] = (td_key, index)
                shapes[pattern.format(name)] = (inner, torch.float32)
    objects: Dict[str, Any] = {}
    step = 0
    if with_optimizer:
        groups, step = _torch_dist_groups_and_step(optimizer)
        decay = next((g for g in groups if float(g.get("wd_mult", 1.0)) != 0.0), groups[0] if groups else {})
        no_decay = next((g for g in groups if float(g.get("wd_mult", 1.0)) == 0.0), decay)
        for g, (src, wd) in enumerate(((decay, float(args.weight_decay)), (no_decay, 0.0))):
            for hp, value in _adam_group(src, wd).items():
                objects[f"optimizer.param_groups.{g}.{hp}"] = value
            shapes[f"optimizer.param_groups.{g}.state.step"] = ((), torch.float32)
        shapes["optimizer.state_initialized"] = ((), torch.bool)  # a tensor, as the engine writes it
    cache: Dict[str, torch.Tensor] = {}

    def produce(key: str) -> torch.Tensor:
        if key.endswith(".state.step"):
            return torch.tensor(float(step))
        if key == "optimizer.state_initialized":
            return torch.tensor(step > 0)
        td_key, index = plan[key]
        if td_key not in cache:  # one (stacked) torch_dist tensor in memory at a time
            cache.clear()
            state_name, _, model_key = td_key[len("optimizer.state."):].partition(".")
            if buckets is not None and td_key.startswith("optimizer.state."):
                cache[td_key] = buckets.read(state_name, model_key)
            else:
                cache.update(_read(directory, {td_key: saved[td_key]}))
        value = cache[td_key][index]
        return value.to(torch.float32).reshape(shapes[key][0]).contiguous()
    it = int(common["iteration"])
    layout = {name: getattr(args, name, None) for name in checkpointing.PARALLEL_ARGS}
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    world = model_parallel * args.data_parallel_size
    layout.update(world_size=world, data_parallel_size=args.data_parallel_size)
    rng = _rng_objects(directory, metadata, int(args.tensor_model_parallel_size),
                       int(args.pipeline_model_parallel_size), world)
    objects.update(rng)
    root, tmp = output.destination(out, it, overwrite)
    _write(tmp, shapes, produce, objects)
    files.write_common(tmp, {
        "format": checkpointing.FORMAT, "version": checkpointing.VERSION, "iteration": it,
        "consumed_train_samples": int(getattr(args, "consumed_train_samples", 0)),
        # the RNG states are those of this world size's ranks (a load at another says so and skips them)
        "world_size": world if rng else None, "converted_rng": bool(rng),
        "converted_from": "torch_dist", "scheduler": common.get("opt_param_scheduler"),
        "model_args": checkpointing.model_args(vars(args)),
        "parallel_layout": {k: checkpointing._json_value(v) for k, v in layout.items()},
        "args": {k: checkpointing._json_value(v) for k, v in sorted(vars(args).items())}})
    return output.publish(tmp, root, it, source=checked.torch_dist_record(directory))


# ------------------------------------------------------------ fsdp -> torch_dist
def _param_of(fsdp_key: str) -> str:
    """The parameter's name in an fsdp_dtensor key (``model.<p>``, ``optimizer.state.<p>.<state>``)."""
    if fsdp_key.startswith("model."):
        return fsdp_key[len("model."):]
    return fsdp_key[len("optimizer.state."):].rsplit(".", 1)[0]


def _is_layer(fsdp_key: str) -> bool:
    return LAYER.match(_param_of(fsdp_key)) is not None


def to_torch_dist(source: str, out: str, iteration: Optional[int] = None, overwrite: bool = False) -> Path:
    """An fsdp_dtensor checkpoint as a torch_dist one under ``out`` (the baseline loads it with its optimizer)."""
    from megatron.fsdp.mcore.checkpoint_keys import tp1_shape

    from megatron.fsdp_training.checkpointing import fp8_state
    from megatron.fsdp_training.checkpointing.torch_dist import CHECKPOINT_VERSION, SHARDED_METADATA
    from . import source as checked

    directory, common = checked.tp_global_fsdp_dtensor(source, iteration)
    args = argparse.Namespace(**common["args"])
    _refuse_moe(getattr(args, "num_experts", None))
    saved = _tensor_keys(_metadata(directory))
    note = fp8_state.conversion_note([k for k in saved if k.startswith("model.")],
                                     "a run that loads this checkpoint with FP8 delayed scaling starts its own")
    if note:
        print(note)
    saved = {k: v for k, v in saved.items() if not fp8_state.is_scaling_state(k)}
    layers = int(args.num_layers)
    with_optimizer = any(k.startswith("optimizer.state.") for k in saved)
    plan: Dict[str, list] = {}  # torch_dist key -> the fsdp keys it stacks (one per layer) or its one key
    for k in sorted(saved):
        if k.startswith("model."):
            name, prefixes = k[len("model."):], [""] + ([f"optimizer.state.{MAIN_COPIES[0]}."] if with_optimizer else [])
        elif k.startswith("optimizer.state.") and k.rsplit(".", 1)[-1] in ADAM:
            name, state_name = k[len("optimizer.state."):].rsplit(".", 1)
            prefixes = [f"optimizer.state.{state_name}."]
        else:
            continue
        layer = LAYER.match(name)
        for prefix in prefixes:
            td_key = prefix + torch_dist_name(f"decoder.layers.{layer.group(2)}" if layer else name)
            slots = plan.setdefault(td_key, [None] * layers if layer else [None])
            slots[int(layer.group(1)) if layer else 0] = k
    shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
    for td_key, sources in plan.items():
        if None in sources:
            raise SystemExit(f"{directory}: no layers {[i for i, s in enumerate(sources) if s is None]} of {td_key}")
        inner = tp1_shape(_param_of(sources[0]), saved[sources[0]][0])
        shapes[td_key] = ((layers,) + inner if _is_layer(sources[0]) else inner, torch.float32)

    def produce(td_key: str) -> torch.Tensor:
        sources, shape = plan[td_key], shapes[td_key][0]
        values = _read(directory, {s: saved[s] for s in sources})  # the layers of one weight (or one tensor)
        if _is_layer(sources[0]):
            return torch.stack([values[s].reshape(shape[1:]) for s in sources])
        return values[sources[0]].reshape(shape)
    step = 0
    if with_optimizer:
        steps = [k for k in saved if re.match(r"^optimizer\.param_groups\.\d+\.state\.step$", k)]
        step = int(max(float(v) for v in _read(directory, {k: saved[k] for k in steps}).values())) if steps else 0
    it = int(common["iteration"])
    args.consumed_train_samples = int(common.get("consumed_train_samples", 0))
    args.iteration = it
    root, tmp = output.destination(out, it, overwrite)
    _write(tmp, shapes, produce, {})
    torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": it,
                "opt_param_scheduler": common.get("scheduler"), "num_floating_point_operations_so_far": 0,
                "content_metadata": dict(SHARDED_METADATA),
                "converted": {"from": "fsdp_dtensor", "optimizer_step": step,
                              "missing": ["rng"] + ([] if with_optimizer else ["optimizer"])}},
               tmp / "common.pt")
    (tmp / "metadata.json").write_text(json.dumps(TORCH_DIST_METADATA))
    return output.publish(tmp, root, it)

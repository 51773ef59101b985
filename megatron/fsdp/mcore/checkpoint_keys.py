"""Checkpoint keys of a Megatron-Core model chunk: global names, independent of PP and EP.

Why: ``torch.distributed.checkpoint`` identifies a tensor by its key, and its
planner keeps one copy of chunks with the same key and offsets. Megatron-Core
names layers by their index inside a pipeline stage (or virtual chunk) and
experts by their index inside an expert-parallel rank, so two stages, or two EP
ranks, would write *different* tensors under the *same* key and DCP would
silently keep one. The engine's keys are the wrapped module's own names, so the
adapter renames:

- ``decoder.layers.{local}.`` -> ``decoder.layers.{global}.``, ``global`` from
  each ``TransformerLayer.layer_number`` (1-based, already offset by the stage
  and virtual chunk): a checkpoint loads under another pipeline layout;
- ``...mlp.experts.local_experts.{i}.`` -> ``{MoELayer.local_expert_indices[i]}``
  (``ep_rank * num_local_experts + i``): a checkpoint loads under another EP size;
- the last stage's copy of a tied output layer (``output_layer.weight`` on a stage
  without the embedding) -> ``embedding.word_embeddings.weight``: both copies hold
  the same values (their gradients are all-reduced over the embedding group), so
  DCP writes one, and a checkpoint is the same with or without pipeline stages;
- legacy ``GroupedMLP`` weights (``mlp.experts.weight1/weight2``, the local experts
  concatenated along one dimension) get an ``ep{rank}.`` prefix under EP > 1: they
  load only at the same EP size (the training job says so when EP differs);
- with tensor parallelism every key gets a ``tp{rank}.`` prefix (the expert
  tensor-parallel rank for experts): TP shards of one parameter are different
  tensors of the same shape. Changing TP needs a conversion of the checkpoint.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, Iterable, Mapping, Optional, Tuple

import torch

_LAYER = re.compile(r"(^|\.)decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_GROUPED = re.compile(r"\.mlp\.experts\.weight\d+$")


@dataclasses.dataclass(frozen=True)
class ParallelRanks:
    """The ranks that make same-named parameters different tensors: (rank, size) per kind."""

    tp: Tuple[int, int] = (0, 1)
    expert_tp: Tuple[int, int] = (0, 1)
    ep: Tuple[int, int] = (0, 1)

    @classmethod
    def from_parallel_state(cls, tp: Optional[Tuple[int, int]] = None) -> "ParallelRanks":
        """Megatron's parallel state (or ``tp`` alone when it is not initialised, e.g. a ``pg_collection``)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return cls(tp=tp or (0, 1), expert_tp=tp or (0, 1))
        return cls(tp=(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
                   expert_tp=(ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()),
                   ep=(ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()))


@dataclasses.dataclass(frozen=True)
class CheckpointKeys:
    """Both directions of one chunk's renaming (parameters and persistent buffers)."""

    to_global: Mapping[str, str]
    to_local: Mapping[str, str]

    def globalize(self, state_dict: Mapping[str, object], prefix: str = "") -> Dict[str, object]:
        return {prefix + self.to_global.get(k, k): v for k, v in state_dict.items()}

    def localize(self, state_dict: Mapping[str, object]) -> Dict[str, object]:
        """Unknown keys pass through unchanged, so the engine's validation names them."""
        return {self.to_local.get(k, k): v for k, v in state_dict.items()}


def _layer_maps(module: torch.nn.Module):
    """``{local layer index: global index}`` and ``{local layer index: global expert indices}``."""
    layers = getattr(getattr(module, "decoder", None), "layers", None) or []
    offsets, experts = {}, {}
    for i, layer in enumerate(layers):
        offsets[i] = getattr(layer, "layer_number", i + 1) - 1
        indices = getattr(getattr(layer, "mlp", None), "local_expert_indices", None)
        if indices is not None:
            experts[i] = list(indices)
    return offsets, experts


def global_key(name: str, module: torch.nn.Module, ranks: ParallelRanks, maps=None) -> str:
    """The checkpoint key of parameter or buffer ``name`` of ``module`` (see the module docstring)."""
    offsets, experts = maps if maps is not None else _layer_maps(module)
    key, local_layer = name, None
    m = _LAYER.search(key)
    if m is not None:
        local_layer = int(m.group(2))
        key = f"{key[:m.start(2)]}{offsets.get(local_layer, local_layer)}{key[m.end(2):]}"
    e = _EXPERT.search(key)
    if e is not None and local_layer in experts:
        key = f"{key[:e.start(1)]}{experts[local_layer][int(e.group(1))]}{key[e.end(1):]}"
    pre, post = getattr(module, "pre_process", True), getattr(module, "post_process", True)
    if key == "output_layer.weight" and getattr(module, "share_embeddings_and_output_weights", False) \
            and post and not pre:
        key = "embedding.word_embeddings.weight"
    is_expert = ".mlp.experts." in f".{name}"
    if is_expert and _GROUPED.search(f".{name}") and ranks.ep[1] > 1:
        key = f"ep{ranks.ep[0]}.{key}"
    rank, size = ranks.expert_tp if is_expert else ranks.tp
    return f"tp{rank}.{key}" if size > 1 else key


def chunk_keys(module: torch.nn.Module, names: Iterable[str], ranks: ParallelRanks) -> CheckpointKeys:
    """The renaming of every name in ``names`` (a chunk's parameter and buffer names)."""
    maps = _layer_maps(module)
    forward = {n: global_key(n, module, ranks, maps) for n in names}
    inverse = {g: n for n, g in forward.items()}
    if len(inverse) != len(forward):
        dup = sorted({g for g in forward.values() if list(forward.values()).count(g) > 1})
        raise ValueError(f"two parameters of one model chunk map to the same checkpoint keys: {dup[:5]}")
    return CheckpointKeys(forward, inverse)


def optimizer_keys(chunk_maps: Iterable[CheckpointKeys]) -> CheckpointKeys:
    """The renaming of the engine optimizer's keys over several chunks.

    The engine names a parameter ``name`` (one model) or ``chunk{k}.name`` (several,
    virtual pipeline) in ``main.<param>`` and ``state.<param>.<state key>``; global
    layer numbers tell the chunks apart, so the chunk prefix is dropped.
    """
    chunk_maps = list(chunk_maps)
    params: Dict[str, str] = {}
    for k, keys in enumerate(chunk_maps):
        for local, glob in keys.to_global.items():
            params[local if len(chunk_maps) == 1 else f"chunk{k}.{local}"] = glob
    return CheckpointKeys(params, {g: q for q, g in params.items()})


def rename_optimizer_key(key: str, params: Mapping[str, str]) -> str:
    """Apply a parameter renaming to one optimizer key; hyperparameter keys are unchanged."""
    if key.startswith("main."):
        return "main." + params.get(key[5:], key[5:])
    if key.startswith("state."):
        param, _, what = key[6:].rpartition(".")
        return f"state.{params.get(param, param)}.{what}"
    return key

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
  (``ep_rank * num_local_experts + i``): a checkpoint loads under another EP size; also in the
  multi-token prediction layers (``mtp.layers.{j}.transformer_layer.``: all on one stage, so ``j``
  is already global; Megatron-Core 0.17 names the module ``mtp_model_layer``, its checkpoint key stays
  ``transformer_layer``, as in Megatron-Core's own ``sharded_state_dict``);
- the last stage's copy of a tied output layer (``output_layer.weight`` on a stage
  without the embedding) -> ``embedding.word_embeddings.weight``: both copies hold
  the same values (their gradients are all-reduced over the embedding group), so
  DCP writes one, and a checkpoint is the same with or without pipeline stages;
- tensor parallelism changes no key: each TP-sharded parameter is one TP-global
  tensor and each rank's shard a box of it (``tp_placements``, below), so a
  checkpoint loads at another TP (and expert-TP) size.

Layout version 1 (checkpoints written before TP-global coordinates) prefixed every
key with ``tp{rank}.`` under TP > 1 and legacy ``GroupedMLP`` weights with
``ep{rank}.`` under EP > 1, each key in TP-local shape; the training job reads such
a checkpoint in TP-global coordinates (``megatron/fsdp_training/checkpointing/layout_v1.py``),
told how each parameter was split by ``split_rules``.

TP-global coordinates (``tp_placements``): where Megatron-Core's TP-1 model
has the parameter, i.e. the shards concatenated along the partition dimension
(``param.partition_dim``), with these layouts:

- fused QKV (``linear_qkv``, dim 0): Megatron's own order, interleaved per query
  group (``[q of group 0, k 0, v 0, q of group 1, ...]``); TP ranks hold whole
  groups, so a shard is one block of rows (converting to separate Q, K, V
  matrices is a reshape per group);
- fused gate/up of SwiGLU (``linear_fc1`` with ``partition_stride`` 2, weight
  and bias): stored as ``[2, ffn, ...]`` (``[0]`` gate, ``[1]`` up, the TP-1
  tensor's rows in order): each TP rank's ``[gate_r; up_r]`` is one box;
- vocabulary-parallel embedding and output layer (dim 0): padded rows included;
  ``vocab_rows`` places them in a checkpoint with another padded size (rows
  beyond it are neither saved nor loaded: they keep this model's initial values);
- legacy ``GroupedMLP`` weights: ``weight1`` as ``[experts, hidden, (2,) ffn]``,
  ``weight2`` as ``[experts, ffn, hidden]`` (how its forward views them), experts
  by global index and the ffn dimension TP-global, so EP and expert TP can change.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Dict, Iterable, Mapping, Optional, Tuple

import torch

from megatron.fsdp.checkpoint.pieces import GlobalPlacement

from megatron.fsdp import mcore_releases as compat

_LAYER = re.compile(r"(^|\.)decoder\.layers\.(\d+)\.")
# A multi-token prediction layer's transformer layer: the module's attribute (this release's name) in
# parameter names, ``transformer_layer`` in checkpoint keys on every release (mcore_releases.CHECKPOINT_MTP_LAYER).
_MTP_LAYER = re.compile(
    rf"(^|\.)mtp\.layers\.(\d+)\.({'|'.join(sorted({compat.MTP_LAYER_ATTRIBUTE, compat.CHECKPOINT_MTP_LAYER}))})\.")
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
    for j, layer in enumerate(getattr(getattr(module, "mtp", None), "layers", None) or []):
        indices = getattr(getattr(compat.mtp_inner_layer(layer), "mlp", None), "local_expert_indices", None)
        if indices is not None:
            experts[("mtp", j)] = list(indices)
    return offsets, experts


def _local_layer(name: str):
    """The key of ``_layer_maps`` for the layer ``name`` lies in: a decoder layer's local index, ``("mtp", j)``
    for a multi-token-prediction layer, None outside layers."""
    m = _LAYER.search(name)
    if m is not None:
        return int(m.group(2))
    mtp = _MTP_LAYER.search(name)
    return ("mtp", int(mtp.group(2))) if mtp is not None else None


def global_key(name: str, module: torch.nn.Module, ranks: ParallelRanks, maps=None) -> str:
    """The checkpoint key of parameter or buffer ``name`` of ``module``."""
    offsets, experts = maps if maps is not None else _layer_maps(module)
    key, local_layer = name, _local_layer(name)
    m = _LAYER.search(key)
    if m is not None:
        key = f"{key[:m.start(2)]}{offsets.get(local_layer, local_layer)}{key[m.end(2):]}"
    e = _EXPERT.search(key)
    if e is not None and local_layer in experts:
        key = f"{key[:e.start(1)]}{experts[local_layer][int(e.group(1))]}{key[e.end(1):]}"
    mtp = _MTP_LAYER.search(key)
    if mtp is not None:
        key = f"{key[:mtp.start(3)]}{compat.CHECKPOINT_MTP_LAYER}{key[mtp.end(3):]}"
    pre, post = getattr(module, "pre_process", True), getattr(module, "post_process", True)
    if key == "output_layer.weight" and getattr(module, "share_embeddings_and_output_weights", False) \
            and post and not pre:
        key = "embedding.word_embeddings.weight"
    return key


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


# ------------------------------------------------------------ TP-global coordinates
VOCAB_PARAMETERS = ("embedding.word_embeddings.weight", "output_layer.weight")


def split_placement(shape: Tuple[int, ...], dim: int, stride: int, rank: int, size: int,
                    rows: Optional[int] = None) -> Optional[GlobalPlacement]:
    """Shard ``rank`` of ``size`` in the TP-global tensor: ``dim`` holds ``stride`` blocks, each split over ranks.

    ``stride`` 1 is a plain concatenation; 2 is SwiGLU's fused gate/up, stored with
    an extra dimension ``[2, ...]`` at every TP size. ``rows`` replaces the global
    first dimension (another padded vocabulary). None where the shard is the tensor.
    """
    shape = tuple(shape)
    if size == 1 and stride == 1 and rows in (None, shape[0]):
        return None
    if shape[dim] % stride:
        raise ValueError(f"partition dimension {dim} of {shape} does not hold {stride} equal blocks")
    block = shape[dim] // stride
    if stride > 1:
        view = shape[:dim] + (stride, block) + shape[dim + 1:]
        glob = shape[:dim] + (stride, block * size) + shape[dim + 1:]
        offsets = tuple(rank * block if d == dim + 1 else 0 for d in range(len(view)))
    else:
        view = shape
        glob = tuple(n * size if d == dim else n for d, n in enumerate(shape))
        offsets = tuple(rank * block if d == dim else 0 for d in range(len(shape)))
    if rows is not None:
        if dim != 0 or stride != 1:
            raise ValueError("another row count applies to a tensor split along its first dimension only")
        glob = (rows,) + glob[1:]
    return GlobalPlacement(view, glob, offsets)


def _grouped_placement(module: torch.nn.Module, name: str, shape: Tuple[int, ...], ranks: ParallelRanks,
                       first_expert: int) -> GlobalPlacement:
    """Legacy ``GroupedMLP.weight1/weight2``: the local experts' blocks, viewed as its forward does."""
    experts = module.get_submodule(name.rsplit(".", 1)[0])
    config = experts.config
    e_local, e_total = experts.num_local_experts, config.num_moe_experts
    t, size = ranks.expert_tp
    ffn = config.moe_ffn_hidden_size
    f_local = ffn // size
    if name.endswith("weight1"):
        h = shape[0]
        glu = (2,) if config.gated_linear_unit else ()
        view, glob = (e_local, h) + glu + (f_local,), (e_total, h) + glu + (ffn,)
    else:
        h = shape[1]
        view, glob = (e_local, f_local, h), (e_total, ffn, h)
    ffn_dim = len(view) - 1 if name.endswith("weight1") else 1
    offsets = tuple(first_expert if d == 0 else t * f_local if d == ffn_dim else 0 for d in range(len(view)))
    return GlobalPlacement(view, glob, offsets)


def tp_placements(module: torch.nn.Module, shapes: Mapping[str, Tuple[int, ...]], ranks: ParallelRanks,
                  vocab_rows: Optional[int] = None) -> Dict[str, GlobalPlacement]:
    """Every parameter of ``shapes`` (name: TP-local shape; a sharded parameter's own tensor may be
    released) whose checkpoint tensor is larger than (or shaped unlike) the parameter.

    From Megatron-Core's own attributes: ``tensor_model_parallel``,
    ``partition_dim``, ``partition_stride`` (expert parameters use the expert TP
    rank); legacy grouped-GEMM weights by name (see the module docstring).
    """
    params = dict(module.named_parameters())
    _, experts = _layer_maps(module)
    out: Dict[str, GlobalPlacement] = {}
    for name, shape in shapes.items():
        param = params.get(name)
        if param is None:
            continue
        shape = tuple(shape)
        if _GROUPED.search(f".{name}"):
            out[name] = _grouped_placement(module, name, shape, ranks, experts[_local_layer(name)][0])
            continue
        if not getattr(param, "tensor_model_parallel", False):
            continue
        rank, size = ranks.expert_tp if ".mlp.experts." in f".{name}" else ranks.tp
        rows = vocab_rows if name in VOCAB_PARAMETERS else None
        placement = split_placement(shape, param.partition_dim, getattr(param, "partition_stride", 1),
                                    rank, size, rows)
        if placement is not None:
            out[name] = placement
    return out


def tp1_shape(key: str, stored: Tuple[int, ...]) -> Tuple[int, ...]:
    """The shape a single-rank ``GPTModel`` gives the parameter stored under ``key`` (same row-major data)."""
    stored = tuple(stored)
    if _GROUPED.search(f".{key}"):
        if key.endswith("weight1"):
            return (stored[1], stored[0] * math.prod(stored[2:]))
        return (stored[0] * stored[1], stored[2])
    if re.search(r"\.linear_fc1\.(weight|bias)$", key) and len(stored) >= 2 and stored[0] == 2 \
            and len(stored) == (3 if key.endswith("weight") else 2):
        return (2 * stored[1],) + stored[2:]
    return stored


def split_rules(module: torch.nn.Module, placements: Mapping[str, GlobalPlacement],
                keys: CheckpointKeys) -> Dict[str, Tuple[str, int, Tuple[int, ...]]]:
    """How layout version 1 split each parameter over TP (and EP) ranks, by checkpoint key: ``("split", dim, ())``
    for a TP shard along Megatron-Core's ``partition_dim``, ``("grouped", ffn dim, TP-global shape)`` for a
    legacy GroupedMLP weight (``placements``: this chunk's ``tp_placements``); replicated ones are absent."""
    out: Dict[str, Tuple[str, int, Tuple[int, ...]]] = {}
    for name, param in module.named_parameters():
        key = keys.to_global.get(name)
        if key is None:
            continue
        if _GROUPED.search(f".{name}"):
            glob = tuple(placements[name].shape)
            out[key] = ("grouped", len(glob) - 1 if name.endswith("weight1") else 1, glob)
        elif getattr(param, "tensor_model_parallel", False):
            if getattr(param, "partition_stride", 1) != 1:
                raise ValueError(f"{name}: layout version 1 never stored a strided TP split")
            out[key] = ("split", param.partition_dim, ())
    return out

"""Megatron-Core DistributedOptimizer's ``dp_reshardable`` torch_dist layout (Megatron-LM's default) read back
per parameter, for ``torch_dist_convert.py``.

Why a reconstruction: that layout saves the optimizer's flat buffers as they are in memory, one tensor per
(optimizer, TPxPP or expert group, buffer, bucket, state) —
``[chained_<o>.]optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_<d>.bucket_idx_<k>.<state>`` —
and records nothing of which parameter sits where. Megatron-Core's ``_ParamAndGradBuffer`` fixes it: the
parameters of one buffer in ``named_parameters`` order, reversed, each start padded to 64 elements, cut into
buckets (the saved ``per_bucket_numel_unpadded`` tells where); a checkpoint tensor is one bucket without its
end padding, so a parameter's offset in it does not depend on the DP size. The order is taken from the
checkpoint's own model keys (the order ``GPTModel.sharded_state_dict`` wrote them) and every slice of the
fp32 main weights is checked against the saved model weight: a layout that does not fit is refused, never
half-trusted. Tensor and pipeline parallel 1 only (the buffers then hold whole parameters, one chunk);
other sizes convert the weights only, said in one line.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

BUCKET = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                    r"\.bucket_idx_(\d+)\.(\w+)$")
OBJECT = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.(\w+)/shard_0_1$")
ALIGN = 64  # _ParamAndGradBuffer._pad_start_of_param_if_needed with the distributed optimizer
STATES = ("param", "exp_avg", "exp_avg_sq")
STACKED = re.compile(r"^decoder\.layers\.(.+)$")
# Megatron-Core's SequentialMLP in torch_dist: the layers and the (global) experts both stacked,
# [layers, experts, ...]; fsdp_dtensor: one tensor per layer and expert, global expert numbers.
EXPERTS = re.compile(r"^decoder\.layers\.mlp\.experts\.experts\.(.+)$")
RESAVE = ("load it with the baseline at its own sizes and save it with --dist-ckpt-optim-fully-reshardable, "
          "then convert that")


class WeightsOnly(Exception):
    """A dp_reshardable layout this reader does not slice (the converter then converts the weights only)."""


@dataclass(frozen=True)
class Slot:
    """Where one parameter (one layer, one expert of a stacked torch_dist key) lives: its bucket tensor
    (without the state name) and its flat range there."""
    bucket: str
    start: int
    numel: int


def read_objects(directory: Path, keys) -> Dict[str, Any]:
    """ShardedObjects of a torch_dist checkpoint (pickled in the DCP files), in one process."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: Dict[str, Any] = {k: None for k in keys}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _load_state_dict(state, storage_reader=FileSystemReader(str(directory)), no_dist=True)
    return {k: v[0] if isinstance(v, list) and len(v) == 1 else v for k, v in state.items()}


def is_dp_reshardable(saved_keys) -> bool:
    return any(BUCKET.match(k) for k in saved_keys)


@dataclass(frozen=True)
class SavedLayout:
    """The saving run's sizes the dp_reshardable layout depends on, as its recorded arguments hold them (a size
    not recorded: None)."""
    num_layers: int
    tensor_model_parallel_size: Optional[int] = None
    pipeline_model_parallel_size: Optional[int] = None
    expert_tensor_parallel_size: Optional[int] = None
    virtual_pipeline_model_parallel_size: Optional[int] = None
    expert_model_parallel_size: Optional[int] = None

    def problem(self) -> Optional[str]:
        """The recorded size this reader does not slice at (None: it does)."""
        for name, label in (("tensor_model_parallel_size", "--tensor-model-parallel-size"),
                            ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
                            ("expert_tensor_parallel_size", "--expert-tensor-parallel-size")):
            if (getattr(self, name) or 1) != 1:
                return f"{label} {getattr(self, name)}"
        if self.virtual_pipeline_model_parallel_size:
            return "--virtual-pipeline-model-parallel-size"
        return None


class DpReshardable:
    """The per-parameter view of one dp_reshardable checkpoint: ``optimizer_common()`` (param groups per
    optimizer, as the other layouts keep them in ``common.pt``) and ``read(state, td_key)`` (one stacked
    torch_dist tensor of ``state``, assembled from the buckets)."""

    def __init__(self, directory: Path, layout: SavedLayout, saved: Dict[str, Tuple[Tuple[int, ...], torch.dtype]],
                 object_keys, read_tensors):
        problem = layout.problem()
        if problem:
            raise WeightsOnly(f"its dp_reshardable layout (Megatron-LM's default) converts at tensor and pipeline "
                              f"parallel size 1 only (saved with {problem})")
        self.directory, self.saved, self.read_tensors = directory, saved, read_tensors
        self.objects = read_objects(directory, [k for k in object_keys if OBJECT.match(k)])
        self.layers = int(layout.num_layers)
        ep = int(layout.expert_model_parallel_size or 1)
        self.slots: Dict[Tuple[str, tuple], Slot] = {}
        buckets = self._bucket_sizes()
        model = [k for k in saved if not k.startswith(("optimizer.", "chained_"))]  # the order they were written
        for (chained, group), (prefix, sizes) in buckets.items():
            expert = chained is not None and int(chained) > 0  # a ChainedOptimizer's second: the experts
            params = self._expert_params(model, group, ep) if expert else self._dense_params(model)
            self._place(params, prefix, sizes)
        self._buckets: Dict[str, torch.Tensor] = {}  # every bucket tensor read so far (see read)
        for key in {key for key, _ in self.slots}:  # the whole layout is checked before anything is written
            self.read("param", key)

    # ------------------------------------------------------------ the layout
    def _bucket_sizes(self) -> Dict[Tuple[Optional[str], str], Tuple[str, List[int]]]:
        """(optimizer, group) -> (bucket key prefix, unpadded numel per bucket), from per_bucket_numel_unpadded."""
        out = {}
        for key, value in self.objects.items():
            chained, group, name = OBJECT.match(key).groups()
            if name != "per_bucket_numel_unpadded":
                continue
            if len(value) != 1 or len(value[0]) != 1:
                raise WeightsOnly(f"its dp_reshardable layout has {len(value)} buffers or several dtypes in one "
                                  "(model chunks, mixed parameter dtypes), which this converter does not slice")
            (dtype, sizes), = value[0].items()
            head = f"chained_{chained}." if chained is not None else ""
            out[(chained, group)] = (f"{head}optimizer.distributed.dp_group_idx_{group}.gbuf_idx_0.dtype_{dtype}",
                                     list(sizes))
        return out

    def _dense_params(self, model) -> List[Tuple[str, tuple]]:
        stacked = [k for k in model if STACKED.match(k) and not EXPERTS.match(k)]
        pre = [k for k in model if not STACKED.match(k) and k.startswith("embedding.")]
        post = [k for k in model if not STACKED.match(k) and not k.startswith("embedding.")]
        return ([(k, ()) for k in pre] + [(k, (i,)) for i in range(self.layers) for k in stacked]
                + [(k, ()) for k in post])

    def _expert_params(self, model, group: str, ep: int) -> List[Tuple[str, tuple]]:
        keys = [k for k in model if EXPERTS.match(k)]
        experts = self.saved[keys[0]][0][1]
        local = experts // ep
        first = int(group) * local  # the expert group index is the EP rank (ETP 1, PP 1)
        return [(k, (i, e)) for i in range(self.layers) for e in range(first, first + local) for k in keys]

    def _place(self, params, prefix: str, sizes: List[int]) -> None:
        bucket, start = 0, 0
        for key, index in reversed(params):
            shape = self.saved[key][0][len(index):]
            numel = math.prod(shape)
            start = -(-start // ALIGN) * ALIGN
            if bucket >= len(sizes) or start + numel > sizes[bucket]:
                raise SystemExit(f"{self.directory}: the dp_reshardable buckets {sizes} do not fit this model's "
                                 f"parameters (at {key}); {RESAVE}")
            self.slots[(key, index)] = Slot(f"{prefix}.bucket_idx_{bucket}", start, numel)
            start += numel
            if start == sizes[bucket]:
                bucket, start = bucket + 1, 0
        if bucket != len(sizes):
            raise SystemExit(f"{self.directory}: the dp_reshardable buckets {sizes} hold more than this model's "
                             f"parameters; {RESAVE}")

    # ------------------------------------------------------------ the values
    def optimizer_common(self) -> Dict[int, Dict[str, Any]]:
        """Each optimizer's saved state (param groups with the step), keyed as a ChainedOptimizer's."""
        parts = {}
        for key, value in sorted(self.objects.items()):
            chained, group, name = OBJECT.match(key).groups()
            index = int(chained or 0)
            if name == "optimizer" and index not in parts:
                parts[index] = value
        return parts

    def read(self, state: str, td_key: str) -> torch.Tensor:
        """``state`` (``param``, ``exp_avg``, ``exp_avg_sq``) of one torch_dist model key, in its saved shape;
        the main weights are checked against the saved model weights. Each bucket tensor is read once and
        kept: the layers of one stacked key lie in different buckets, and DCP reads a tensor whole (host
        memory: the whole flat optimizer state, three fp32 copies of the model)."""
        shape, _ = self.saved[td_key]
        slots = {index: slot for (key, index), slot in self.slots.items() if key == td_key}
        wanted = {f"{s.bucket}.{state}" for s in slots.values()} - set(self._buckets)
        self._buckets.update(self.read_tensors({k: self.saved[k] for k in wanted}))
        out = torch.empty(shape, dtype=torch.float32)
        for index, slot in slots.items():
            piece = self._buckets[f"{slot.bucket}.{state}"][slot.start:slot.start + slot.numel]
            out[index] = piece.reshape(shape[len(index):])
        if state == "param":
            weight = self.read_tensors({td_key: self.saved[td_key]})[td_key]
            if not torch.equal(out.to(weight.dtype), weight):
                raise SystemExit(f"{self.directory}: the dp_reshardable main weights of {td_key} do not match its "
                                 f"saved weights (a DDP layout this converter does not know); {RESAVE}")
        return out

    def saved_states(self) -> List[str]:
        return [s for s in STATES if any(k.endswith(f".{s}") and BUCKET.match(k) for k in self.saved)]

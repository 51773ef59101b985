"""``convert.py to-hf`` and ``from-hf``: fsdp_dtensor checkpoints <-> HuggingFace safetensors, streamed.

``to_hf`` reads a checkpoint one layer at a time (``DcpTensors``), maps each layer's
Megatron tensors to HuggingFace's (``hf_layouts``) and appends them to the open
safetensors shard, whose header was written from a plan made on meta tensors.
``from_hf`` plans the DCP save on meta tensors and produces each Megatron tensor
from its HuggingFace sources only when DCP's writer asks for it. Neither ever
holds more than one layer's tensors, whatever the model's size; both report the
process's peak resident memory.

A checkpoint written by ``from_hf`` is iteration 0 with the model weights only:
``pretrain_gpt.py --load DIR --finetune`` (with the flags ``from_hf`` prints)
starts training from it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from . import hf_checks, hf_io, hf_tokenizer, output
from .hf_layouts import Arch, ConversionError, Rule
from .hf_models import (arch_from_args, arch_from_hf, check_exportable, default_model_type, hf_config,
                                        note, rules_for)
from .source import LAYOUT_V1

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class ConversionReport:
    """What a conversion wrote and the memory it took (bytes)."""

    written: Path
    model_bytes: int  # the converted tensors' size, as written
    rss_before: int  # resident memory before the first tensor was read (interpreter, torch, ...)
    peak_rss: int  # VmHWM at the end
    note: str = ""  # what happened to weights transformers has no module for (hf_models.note)

    def line(self) -> str:
        mib = 2 ** 20
        return (f"peak resident memory {self.peak_rss / mib:.1f} MiB ({self.rss_before / mib:.1f} MiB before "
                f"converting, +{(self.peak_rss - self.rss_before) / mib:.1f} MiB); model "
                f"{self.model_bytes / mib:.1f} MiB")


def _group(rules: List[Rule]) -> List[List[Rule]]:
    """Rules by layer, in order (embeddings first, then each layer, then the final norm and output)."""
    groups: Dict[Any, List[Rule]] = {}
    for rule in rules:
        m = _LAYER.match(rule.megatron[0])
        groups.setdefault(int(m.group(1)) if m else ("post" if any(type(k) is int for k in groups) else "pre"),
                          []).append(rule)
    return list(groups.values())


def _apply(rule: Rule, tensors: Dict[str, torch.Tensor], to_hf: bool) -> List[Tuple[str, torch.Tensor]]:
    src, dst, fn = (rule.megatron, rule.hf, rule.to_hf) if to_hf else (rule.hf, rule.megatron, rule.from_hf)
    out = fn(*(tensors[k] for k in src))
    if len(out) != len(dst):
        raise RuntimeError(f"rule {src} -> {dst} gave {len(out)} tensors")
    return list(zip(dst, out))


# ------------------------------------------------------------------------ to HF
def to_hf(checkpoint: str, out: str, model_type: Optional[str] = None, iteration: Optional[int] = None,
          dtype: Optional[str] = None, max_shard_bytes: int = 5 * 2 ** 30, overwrite: bool = False) -> ConversionReport:
    """Write ``checkpoint``'s model as a HuggingFace directory ``out`` (config.json, shards, index)."""
    from megatron.fsdp_training.checkpointing import files, fp8_state
    from megatron.fsdp_training.checkpointing.save_load import tp_global
    from .inspect import resolve

    hf_io.return_large_buffers_to_the_os()
    rss_before = hf_io.current_rss_bytes()
    directory = resolve(checkpoint, iteration)
    common = files.read_common(directory)
    if not tp_global(common):
        raise ConversionError(LAYOUT_V1)
    arch = arch_from_args(common["args"])
    model_type = model_type or default_model_type(common, arch)
    saved_hf = common.get("hf", {})
    torch_dtype = DTYPES[dtype or saved_hf.get("dtype", "float32")]
    check_exportable(model_type, arch)
    reader = hf_io.DcpTensors(directory)
    stored = {k[len("model."):]: v for k, v in reader.meta.items() if k.startswith("model.")}
    fp8_note = fp8_state.conversion_note(stored, "a HuggingFace model has none")
    stored = {k: v for k, v in stored.items() if not fp8_state.is_scaling_state(k)}
    rules = rules_for(model_type, arch)
    needed = {k for r in rules for k in r.megatron}
    unknown, missing = sorted(set(stored) - needed), sorted(needed - set(stored))
    if unknown or missing:
        raise ConversionError(f"{directory} does not hold a {model_type} model: "
                              + (f"tensors without a HuggingFace place: {unknown[:6]}; " if unknown else "")
                              + (f"tensors the mapping needs but the checkpoint lacks: {missing[:6]}" if missing else ""))
    groups = _group(rules)

    def run(group, tensors):
        for rule in group:
            for name, t in _apply(rule, tensors, to_hf=True):
                yield name, t.to(torch_dtype)

    entries = []
    for group in groups:  # the plan, on meta tensors
        meta = {k: torch.empty(stored[k][0], dtype=stored[k][1], device="meta") for r in group for k in r.megatron}
        entries += [(name, tuple(t.shape), t.dtype) for name, t in run(group, meta)]

    def tensors() -> Iterator[Tuple[str, torch.Tensor]]:
        with output.progress(len(groups), "to-hf (layers)") as bar:
            for group in groups:
                loaded = reader.read(["model." + k for k in dict.fromkeys(k for r in group for k in r.megatron)])
                yield from run(group, {k[len("model."):]: v for k, v in loaded.items()})
                del loaded
                bar.update(1)

    root = output.check_empty(out, overwrite)
    written = hf_io.write_safetensors_shards(root, entries, tensors(), max_shard_bytes)
    config = saved_hf.get("config") if saved_hf.get("model_type") == model_type else None
    config = dict(config or hf_config(model_type, arch, torch_dtype))
    config = hf_tokenizer.write_generation_files(root, config, common)
    (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model_bytes = sum(p.stat().st_size for p in written if p.suffix == ".safetensors")
    notes = "\n".join(n for n in (note(arch, exporting=True), fp8_note) if n)
    return ConversionReport(root, model_bytes, rss_before, hf_io.peak_rss_bytes(), notes)


# ---------------------------------------------------------------------- from HF
def from_hf(hf_dir: str, save_dir: str, overwrite: bool = False) -> Tuple[ConversionReport, Arch]:
    """Write HuggingFace model ``hf_dir`` as the fsdp_dtensor checkpoint ``save_dir/iter_0000000``."""
    from megatron.fsdp_training.checkpointing import files
    from megatron.fsdp_training.checkpointing.save_load import FORMAT, VERSION

    hf_io.return_large_buffers_to_the_os()
    rss_before = hf_io.current_rss_bytes()
    source = Path(hf_dir)
    config = hf_checks.read_config(source)
    reader = hf_io.SafetensorsReader(source)
    plan = hf_checks.plan_import(source, config, reader)  # every check, before anything is written
    arch, owner, shapes = plan.arch, plan.owner, plan.shapes
    cache: Dict[str, torch.Tensor] = {}

    def produce(key: str) -> torch.Tensor:
        bar.update(1)
        if key not in cache:
            rule = owner[key]
            made = _apply(rule, {k: reader.read(k).to(torch.float32) for k in rule.hf}, to_hf=False)
            cache.update({"model." + name: t.contiguous() for name, t in made})
        return cache.pop(key)

    with output.writing(save_dir, 0, overwrite) as (root, tmp):  # a failure leaves save_dir as it was
        with output.progress(len(shapes), "from-hf") as bar:
            hf_io.write_dcp_lazily(tmp, shapes, produce)
        files.write_common(tmp, {
            "format": FORMAT, "version": VERSION, "iteration": 0, "consumed_train_samples": 0, "world_size": 1,
            "scheduler": {}, "model_args": arch.model_args(), "args": arch.as_args(),
            "parallel_layout": {"world_size": 1, "data_parallel_size": 1, "tensor_model_parallel_size": 1,
                                "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
                                "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1},
            "hf": {"model_type": plan.model_type, "dtype": plan.dtype, "config": config,
                   "source": str(source.resolve())},
        })
        written = output.publish(tmp, root, 0)
    model_bytes = sum(_nbytes(*v) for v in shapes.values())
    notes = "\n".join(line for line in (plan.note, note(arch, exporting=False, config=config)) if line)
    return ConversionReport(written, model_bytes, rss_before, hf_io.peak_rss_bytes(), notes), arch


def _nbytes(shape, dtype) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()

"""Convert a checkpoint to one torch file of full tensors, a HuggingFace model or Megatron's torch_dist, and back.

    megatron-fsdp-convert to-torch CKPT OUT.pt [--model-only]
    megatron-fsdp-convert from-torch IN.pt SAVE_DIR
    megatron-fsdp-convert to-hf CKPT HF_DIR [--model-type gpt2|llama|qwen2|qwen2_moe|mixtral|qwen3|qwen3_moe|deepseek_v3]
    megatron-fsdp-convert from-hf HF_DIR SAVE_DIR
    megatron-fsdp-convert from-torch-dist TORCH_DIST_DIR SAVE_DIR   # baseline -> --use-megatron-fsdp
    megatron-fsdp-convert to-torch-dist CKPT TORCH_DIST_DIR         # --use-megatron-fsdp -> baseline
    megatron-fsdp-convert to-megatron-lm CKPT SAVE_DIR    # -> Megatron-LM's trainer (docs/trainers.md)
    megatron-fsdp-convert from-megatron-lm CKPT SAVE_DIR  # Megatron-LM's trainer -> this job

``to-torch`` reads a ``--save`` directory's latest checkpoint (or an
``iter_XXXXXXX`` directory) into full, unsharded tensors, in one process without
a process group: ``{"model": {key: tensor}, "optimizer": {...}, "rng": {...},
"common": common.json}``. With ``--model-only`` the file is the model's state
dict alone, loadable by ``GPTModel.load_state_dict`` of an unsharded model
(TP 1; keys use global layer and expert numbers, which are the single-rank names), from a
checkpoint written at any TP, PP, EP or DP layout.
``from-torch`` writes such a file (not ``--model-only``) back as a checkpoint
``SAVE_DIR/iter_XXXXXXX`` with the same atomic protocol as training, so
``pretrain_gpt.py --load SAVE_DIR`` resumes from it at any DP size or level.
``to-hf`` / ``from-hf``: HuggingFace safetensors directories, streamed one layer
at a time (``hf_convert.py``; docs/checkpoint-conversion.md, "HuggingFace").
``from-torch-dist`` / ``to-torch-dist`` convert between Megatron-Core's
``torch_dist`` (the Megatron-Core DDP baseline's ``--ckpt-format``) and
``fsdp_dtensor``: weights, Adam state, iteration and LR schedule
(``torch_dist_convert.py``).
"""

import argparse
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

from megatron.fsdp.commands import PRETRAIN


def read_checkpoint(directory: Path) -> Dict[str, Any]:
    """Every value of a DCP checkpoint as full tensors and objects (one process, no process group)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: Dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(str(directory)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return state


def to_torch(checkpoint: str, out: str, model_only: bool = False, iteration: Optional[int] = None) -> Path:
    import torch

    from megatron.fsdp_training.checkpointing import files
    from . import source
    from .inspect import resolve

    directory = resolve(checkpoint, iteration)
    source.check_fsdp_dtensor(directory)
    state = read_checkpoint(directory)
    state["common"] = files.read_common(directory)
    torch.save(model_state(state) if model_only else state, out)
    return directory


def model_state(state: Dict[str, Any]) -> Dict[str, Any]:
    """``GPTModel.load_state_dict`` of a single-rank model: TP-global tensors in the parameters' own shapes.

    Fused SwiGLU and grouped-GEMM weights are stored with extra dimensions
    (``checkpoint_keys.tp1_shape``); the data is the TP-1 parameter's, row-major.
    A layout-version-1 checkpoint written at TP > 1 holds TP shards under
    ``tp<rank>.`` keys instead: they are not merged here.
    """
    from megatron.fsdp.mcore.checkpoint_keys import tp1_shape

    from megatron.fsdp_training.checkpointing.save_load import tp_global

    from . import source

    if not tp_global(state["common"]):
        raise SystemExit(source.LAYOUT_V1)
    # ``from-hf`` writes flat ``model.<name>`` keys (no nested state dict to unflatten).
    model = state["model"] if "model" in state else {k[len("model."):]: v for k, v in state.items()
                                                      if k.startswith("model.")}
    return {k: v.reshape(tp1_shape(k, tuple(v.shape))) if hasattr(v, "reshape") else v
            for k, v in model.items()}


def from_torch(path: str, save_dir: str, overwrite: bool = False) -> Path:
    """Write a ``to-torch`` file as ``save_dir/iter_XXXXXXX`` (temporary directory, rename, tracker)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from megatron.fsdp_training.checkpointing import files
    from . import output, source

    state = torch.load(path, weights_only=False)
    # (a checkpoint from-hf wrote holds flat ``model.<name>`` keys instead of a nested ``model``)
    if not isinstance(state, dict) or "common" not in state or not ("model" in state or any(
            isinstance(k, str) and k.startswith("model.") for k in state)):
        raise SystemExit(f"{path}: not a file written by 'convert.py to-torch' (without --model-only): "
                         "it needs the 'model' and 'common' entries")
    common = state.pop("common")
    root, tmp = output.destination(save_dir, common["iteration"], overwrite)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=True)
    files.write_common(tmp, common)
    return output.publish(tmp, root, common["iteration"], source=source.torch_file_record(Path(path)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("to-torch", help="checkpoint -> one torch file of full tensors")
    a.add_argument("checkpoint")
    a.add_argument("out")
    a.add_argument("--iteration", type=int, default=None)
    a.add_argument("--model-only", action="store_true", help="write the model's state dict alone")
    b = sub.add_parser("from-torch", help="torch file (from to-torch) -> checkpoint in SAVE_DIR")
    b.add_argument("torch_file")
    b.add_argument("save_dir")
    _add_overwrite(a, b)
    for name, what in (("from-torch-dist", "torch_dist checkpoint (Megatron-Core DDP baseline) -> fsdp_dtensor"),
                       ("to-torch-dist", "fsdp_dtensor checkpoint -> torch_dist (Megatron-Core DDP baseline)"),
                       ("from-megatron-lm", "checkpoint of Megatron-LM's trainer with megatron.fsdp -> this job's"),
                       ("to-megatron-lm", "this job's checkpoint -> one Megatron-LM's trainer loads with megatron.fsdp")):
        c = sub.add_parser(name, help=what)
        c.add_argument("checkpoint", help="a --save directory (its latest checkpoint) or one iter_* directory")
        c.add_argument("save_dir", help=f"written as SAVE_DIR/iter_XXXXXXX with the tracker ({PRETRAIN} "
                                           "--load)")
        c.add_argument("--iteration", type=int, default=None)
        _add_overwrite(c)
    _add_hf_commands(sub)
    args = p.parse_args(argv)
    from torch.distributed.checkpoint.api import CheckpointException  # DCP's: a BaseException

    from . import output, source

    try:
        _run(args)
    except SystemExit:
        output.abandon()
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - one line, the destination left as it was
        undone = output.abandon()
        raise SystemExit(f"error: {args.command} failed ({source.first_line(exc)})"
                         + (f"; {undone} is as it was before the conversion" if undone else "")) from None
    except BaseException:  # an interrupt: the destination as it was too
        output.abandon()
        raise


# command -> (module beside this one, its function (source, save_dir, iteration, overwrite), how it reads)
CONVERTERS = {
    "from-torch-dist": ("torch_dist_convert", "from_torch_dist", "one tensor at a time"),
    "to-torch-dist": ("torch_dist_convert", "to_torch_dist", "one tensor at a time"),
    "from-megatron-lm": ("megatron_lm_convert", "from_megatron_lm", "full tensors, one process"),
    "to-megatron-lm": ("megatron_lm_convert", "to_megatron_lm", "full tensors, one process"),
}


def _run(args) -> None:
    """Run the command ``args`` (this tool's own command line, not the job's flags) names."""
    start = time.perf_counter()
    if args.command in ("to-hf", "from-hf"):
        _run_hf_command(args, start)
    elif args.command in CONVERTERS:
        import importlib

        module, function, how = CONVERTERS[args.command]
        convert = getattr(importlib.import_module(f".{module}", __package__), function)
        print(f"> converting {args.checkpoint} ({args.command}, {how}) ...", flush=True)
        written = convert(args.checkpoint, args.save_dir, args.iteration, args.overwrite)
        print(f"wrote {written}{_rate(written, start)}")
    elif args.command == "to-torch":
        print(f"> reading {args.checkpoint} (full tensors, one process) ...", flush=True)
        from . import output

        output.check_empty(args.out, args.overwrite)
        directory = to_torch(args.checkpoint, args.out, args.model_only, args.iteration)
        print(f"wrote {args.out} from {directory}{_rate(Path(args.out), start)}")
    else:
        print(f"> writing {args.torch_file} as a checkpoint under {args.save_dir} ...", flush=True)
        written = from_torch(args.torch_file, args.save_dir, args.overwrite)
        print(f"wrote {written}{_rate(written, start)}")


def _add_hf_commands(sub) -> None:
    from .hf_models import MODEL_TYPES

    a = sub.add_parser("to-hf", help="checkpoint -> HuggingFace directory (safetensors shards, index, config.json)")
    a.add_argument("checkpoint")
    a.add_argument("out")
    a.add_argument("--model-type", choices=MODEL_TYPES, default=None,
                   help="default: the one it came from (from-hf), else deepseek_v3 with multi-latent attention, "
                        "qwen3 (qwen3_moe with experts) with --qk-layernorm, qwen2_moe with shared experts, "
                        "mixtral with experts, qwen2 with q/k/v biases, llama with SwiGLU, gpt2 otherwise")
    a.add_argument("--iteration", type=int, default=None)
    a.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="tensor dtype written (default: the HuggingFace source's, else float32)")
    a.add_argument("--max-shard-size", type=float, default=5.0, help="GiB per safetensors shard (default 5)")
    b = sub.add_parser("from-hf", help="HuggingFace directory -> checkpoint SAVE_DIR/iter_0000000 (weights only)")
    b.add_argument("hf_dir")
    b.add_argument("save_dir")
    _add_overwrite(a, b)


def _add_overwrite(*parsers) -> None:
    for parser in parsers:
        parser.add_argument("--overwrite", action="store_true",
                            help="write into a directory (or file) that is not empty, replacing the iteration "
                                 "converted; a tracker is never moved backwards (docs/checkpoint-conversion.md)")


def _run_hf_command(args, start: float) -> None:
    """to-hf / from-hf of this tool's own command line ``args``."""
    from . import hf_tokenizer
    from .hf_convert import from_hf, to_hf
    from .hf_layouts import ConversionError

    try:
        if args.command == "to-hf":
            print(f"> writing {args.checkpoint} as a HuggingFace model in {args.out} (streamed, one layer at a "
                  "time) ...", flush=True)
            report = to_hf(args.checkpoint, args.out, args.model_type, args.iteration, args.dtype,
                           int(args.max_shard_size * 2 ** 30), args.overwrite)
            print(f"wrote {report.written}{_rate(report.written, start)}")
            if report.note:
                print(report.note)
        else:
            print(f"> writing {args.hf_dir} as a checkpoint under {args.save_dir} (streamed, one tensor at a "
                  "time) ...", flush=True)
            report, arch = from_hf(args.hf_dir, args.save_dir, args.overwrite)
            print(f"wrote {report.written}{_rate(report.written, start)}")
            if report.note:
                print(report.note)
            print("train from it with: " + hf_tokenizer.training_command(arch, args.hf_dir, args.save_dir))
            note = hf_tokenizer.tokenizer_note(arch, args.hf_dir)
            if note:
                print(note)
    except (ConversionError, OSError) as exc:  # (a missing file, a full disk: the destination is as it was)
        raise SystemExit(f"error: {exc}") from None
    print(report.line())


def _rate(path: Path, start: float) -> str:
    """Progress for a user waiting on a large conversion: bytes written, seconds, MB/s."""
    size = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    seconds = max(time.perf_counter() - start, 1e-9)
    return f" ({size / 2**20:.1f} MB in {seconds:.1f} s, {size / 2**20 / seconds:.1f} MB/s)"


if __name__ == "__main__":
    main()

"""Print what a checkpoint holds: iteration, arguments, and every key with its shape and dtype.

    megatron-fsdp-inspect CKPT [--keys REGEX] [--json]
    megatron-fsdp-inspect CKPT --verify     # every file against manifest.json

``CKPT`` is a ``--save`` directory (its latest checkpoint, or ``--iteration N``)
or one ``iter_XXXXXXX`` directory. Reads the DCP metadata and ``common.json``
only: no process group, no tensor data, no model.
"""

import argparse
import json
import re
from pathlib import Path
from typing import Optional


def resolve(path: str, iteration: Optional[int] = None) -> Path:
    """An ``iter_*`` directory from a save directory (tracker or ``iteration``) or the directory itself; a tracker
    that is damaged or names a missing directory is one line naming the iterations there are."""
    from megatron.fsdp_training.checkpointing import files

    root = Path(path)
    if (root / ".metadata").is_file() or (root / "manifest.json").is_file():
        return root
    present = sorted((int(p.name[5:]) for p in root.glob("iter_*") if p.is_dir() and p.name[5:].isdigit()),
                     reverse=True)
    hint = (f"; pass --iteration N for one it holds ({', '.join(map(str, present[:5]))})" if present
            else f"; {root} holds no iter_* directory")
    named = "--iteration" if iteration is not None else "its tracker"
    try:
        iteration = iteration if iteration is not None else files.read_tracker(root)
    except files.CheckpointError:
        raise SystemExit(f"error: {root / files.TRACKER} is damaged (not an iteration number){hint}") from None
    if iteration is None:
        raise SystemExit(f"error: {root}: neither a checkpoint directory nor a --save directory with {files.TRACKER}")
    try:
        return files.checkpoint_dir(root, iteration)
    except files.CheckpointError:
        raise SystemExit(f"error: {root} has no {files.iteration_dir_name(iteration)} ({named} names iteration "
                         f"{iteration}){hint}") from None


def describe(directory: Path) -> dict:
    """``{"common": common.json, "keys": {key: {"shape", "dtype", "chunks"} or {"bytes": True}}}``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron.fsdp_training.checkpointing import files

    metadata = FileSystemReader(str(directory)).read_metadata()
    keys = {}
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            keys[key] = {"shape": list(md.size), "dtype": str(md.properties.dtype).replace("torch.", ""),
                         "chunks": len(md.chunks)}
        else:
            keys[key] = {"bytes": True}
    return {"directory": str(directory), "common": files.read_common(directory), "keys": keys}


def layout_lines(common: dict) -> list:
    """The parallel layout a checkpoint was written with (what it records of it), and the layouts it loads at."""
    saved = common.get("parallel_layout") or {}
    args = common.get("model_args", {})
    if saved:
        sizes = " x ".join(f"{name} {saved[key]}" for name, key in (
            ("TP", "tensor_model_parallel_size"), ("PP", "pipeline_model_parallel_size"),
            ("CP", "context_parallel_size"), ("DP", "data_parallel_size")) if key in saved)
        extra = [f"{name} {saved[key]}" for name, key in (("EP", "expert_model_parallel_size"),
                                                          ("expert TP", "expert_tensor_parallel_size"))
                 if key in saved]
        if "data_parallel_sharding_strategy" in saved:
            extra.append(f"level {saved['data_parallel_sharding_strategy']}")
        if "num_distributed_optimizer_instances" in saved:
            extra.append(f"{saved['num_distributed_optimizer_instances']} instance(s)")
        written = f"world {saved.get('world_size')} = {sizes}" + (f"; {', '.join(extra)}" if extra else "")
        if "hf" in common:
            written += f" (converted from HuggingFace {common['hf'].get('model_type')}: no training layout)"
    else:
        written = f"world {common.get('world_size')}, TP {args.get('tensor_model_parallel_size')}"
    from megatron.fsdp_training.checkpointing.save_load import tp_global

    if tp_global(common):
        loads = "any TP, PP, EP, expert TP and DP size, level or mesh (TP-global keys)"
        if args.get("true_vocab_size") is not None:
            loads += f"; padded vocabulary {args.get('padded_vocab_size')} rows, cut or added to the new padding"
    else:
        loads = (f"TP {args.get('tensor_model_parallel_size')} and expert TP "
                 f"{args.get('expert_tensor_parallel_size')} only"
                 + (f", EP {args['expert_model_parallel_size']} only (grouped GEMM)"
                    if args.get("moe_grouped_gemm") and args.get("expert_model_parallel_size") else "")
                 + "; any PP and DP size, level or mesh (layout version 1: keys per TP rank; load it there and "
                   "save again for a checkpoint that loads anywhere)")
    return [f"  written at: {written}", f"  loads at: {loads}"]


def verify(directory: Path) -> int:
    """Offline check of one checkpoint; prints one line per problem (or one ``verified`` line); the exit code."""
    import time

    from megatron.fsdp_training.checkpointing import manifest

    listed = manifest.read_manifest(directory)
    if listed is None and not manifest.verify(directory):  # one a save of today must have fails below
        print(f"{directory}: no {manifest.MANIFEST} (saved before manifests existed): nothing to verify against")
        return 1
    start = time.perf_counter()
    problems = manifest.verify(directory)
    if not (directory / ".metadata").is_file() and not any(".metadata" in p for p in problems):
        problems.append(f"{directory / '.metadata'} is missing")
    for problem in problems:
        print(f"damaged: {problem}")
    if problems:
        good = manifest.previous_good(directory.parent, directory)
        if good is not None:
            print(f"previous good checkpoint: iteration {good} (--ckpt-step {good})")
        return 1
    total = sum(e["size"] for e in (listed or {}).values())
    source = manifest.read_source(directory)
    if source is not None and not source.get("verified"):
        print(f"{directory}: its {len(listed)} files ({total} bytes) are as the conversion wrote them (sizes and "
              f"CRC-32 match {manifest.MANIFEST}); {manifest.source_line(source)}")
        return 0
    print(f"{directory}: verified {len(listed)} files, {total} bytes in {time.perf_counter() - start:.2f} s")
    return 0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--iteration", type=int, default=None,
                   help="read iter_N of the save directory instead of the latest (the tracker's)")
    p.add_argument("--keys", default=None, help="only keys matching this regular expression")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--verify", action="store_true",
                   help="check every file's size and CRC-32 against the checkpoint's manifest.json; exit 1 if damaged")
    args = p.parse_args(argv)
    from megatron.fsdp_training.checkpointing.files import CheckpointError

    if args.verify:
        raise SystemExit(verify(resolve(args.checkpoint, args.iteration)))
    try:
        info = describe(resolve(args.checkpoint, args.iteration))
    except CheckpointError as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.keys:
        info["keys"] = {k: v for k, v in info["keys"].items() if re.search(args.keys, k)}
    if args.json:
        print(json.dumps(info, indent=1))
        return
    common = info["common"]
    print(f"checkpoint {info['directory']}")
    print(f"  format {common['format']} v{common['version']}, iteration {common['iteration']}, consumed samples "
          f"{common['consumed_train_samples']}, saved on {common['world_size']} ranks")
    print("  model: " + ", ".join(f"{k}={v}" for k, v in common["model_args"].items()))
    print("\n".join(layout_lines(common)))
    params = 0
    for key, v in info["keys"].items():
        if v.get("bytes"):
            print(f"  {key:<72} (object)")
            continue
        numel = 1
        for n in v["shape"]:
            numel *= n
        params += numel if key.startswith("model.") else 0
        print(f"  {key:<72} {str(tuple(v['shape'])):>16} {v['dtype']:<9} {v['chunks']} chunk(s)")
    print(f"  {len(info['keys'])} keys, {params:,} model elements")


if __name__ == "__main__":
    main()

"""Build peak per rank of the Megatron GPT: eager build vs ``--init-model-with-meta-device`` (ZeRO-3).

Run under torchrun; model arguments as for pretrain_gpt.py::

    torchrun --nproc_per_node 4 tools/meta_init_peak.py --num-layers 8 --hidden-size 1024 \\
        --num-attention-heads 16 --seq-length 64

Each rank builds the model chunk and wraps it in ``FullyShardedDataParallel`` twice, eager
then on the meta device, and reports the resident-set high-water mark (``VmHWM``, reset
through ``/proc/self/clear_refs``) above the resident set before the build. Large blocks
are served by ``mmap`` (a fixed 64 KiB ``M_MMAP_THRESHOLD``, ``MEASURE_MMAP_THRESHOLD`` of
``megatron/fsdp_training/allocator.py``) so freed memory leaves the resident set, and a small build of each kind runs first (the first meta build loads torch's meta
kernels). The bound column is ``persistent + root + 2 units`` (the meta build's promise)
and, as a fraction of the eager peak, ``1/N + root + 2 units``.
"""

from __future__ import annotations

import copy
import gc
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.bench.measure import peak_rss_bytes, reset_peak_rss, rss_bytes, trim_heap  # noqa: E402

MIB = 2 ** 20


def _build(args, meta: bool):
    from megatron.fsdp.mcore import FullyShardedDataParallel, FullyShardedDataParallelConfig
    from megatron.fsdp_training import model as model_lib

    args = copy.copy(args)
    args.init_model_with_meta_device = meta
    cpu = not torch.cuda.is_available()
    config = model_lib.transformer_config(args, cpu)
    chunks = model_lib.build_model_chunks(args, config, args.padded_vocab_size, cpu)
    ddp = FullyShardedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
                                         grad_reduce_in_fp32=True)
    return [FullyShardedDataParallel(config, ddp, chunk) for chunk in chunks]


def _measure(args, meta: bool) -> dict:
    trim_heap()
    dist.barrier()
    start = rss_bytes()
    reset_peak_rss()
    model = _build(args, meta)
    peak = peak_rss_bytes() - start
    units = [u for chunk in model for u in chunk.fsdp.units]
    sizes = {u.name: u.storage.layout.padded_size * 4 for u in units}
    nested = max((sizes[n] + sizes.get(n + ".mlp", 0) for n in sizes if n != "<root>"), default=0)
    out = {"peak": peak, "persistent": sum(chunk.fsdp.memory_report().total for chunk in model),
           "model": sum(sizes.values()), "root": sizes.get("<root>", 0), "unit": nested}
    del model, units
    gc.collect()
    return out


def main(argv) -> None:
    from megatron.fsdp_training.arguments import parse_args, validate_args
    from megatron.fsdp_training.data.datasets import build_tokenizer, padded_vocab_size
    from megatron.fsdp_training.initialize import initialize

    args = parse_args(argv + ["--mock-data", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                              "optim_grads_params"])
    validate_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    initialize(args)
    from megatron.fsdp_training.allocator import MEASURE_MMAP_THRESHOLD, fix_mmap_threshold

    fix_mmap_threshold(MEASURE_MMAP_THRESHOLD)  # the resident set follows every tensor over 64 KiB
    args.padded_vocab_size = padded_vocab_size(build_tokenizer(args).vocab_size, args)
    tiny = copy.copy(args)
    tiny.num_layers, tiny.hidden_size, tiny.ffn_hidden_size = args.pipeline_model_parallel_size, 64, 256
    tiny.num_attention_heads = 4 * args.tensor_model_parallel_size
    for meta in (False, True):
        _measure(tiny, meta)
    rows = {kind: _measure(args, kind == "meta") for kind in ("eager", "meta")}
    mine = torch.tensor([[rows[k][f] for f in ("peak", "persistent", "model", "root", "unit")]
                         for k in ("eager", "meta")], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    if dist.get_rank() == 0:
        n = args.data_parallel_size
        print(f"build peak per rank (MiB), ZeRO-3, {dist.get_world_size()} ranks (DP {n}), "
              f"{args.num_layers} layers x hidden {args.hidden_size}")
        print(" rank | eager peak | meta peak | meta/eager | bound (MiB) | bound/eager (1/N + root + 2 units)")
        for rank, t in enumerate(everyone):
            (e_peak, *_), (m_peak, persistent, model, root, unit) = t.tolist()
            bound = persistent + root + 2 * unit
            print(f" {rank:4d} | {e_peak / MIB:10.1f} | {m_peak / MIB:9.1f} | {m_peak / e_peak:10.3f} | "
                  f"{bound / MIB:11.1f} | {1 / n + (root + 2 * unit) / model:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])

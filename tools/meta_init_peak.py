"""The meta-device build's memory against what it keeps: the engine alone and the training job, per world size.

    python tools/meta_init_peak.py                     # 2, 4 and 8 ranks; a 641 MiB GPT (12 x 1024, vocabulary 8192)
    python tools/meta_init_peak.py --ranks 2 --layers 2 --builds job   # only the job's row, 2 ranks, 2 layers

For each world size, one ``torchrun`` launch per build (``--builds``: both unless told), with every
``MALLOC_*`` variable taken out of the environment (glibc's defaults):

- ``engine``: a torch-only GPT (pre-norm blocks of ``nn.Linear``/``nn.LayerNorm``, untied head)
  built under ``torch.device("meta")`` and wrapped by ``megatron.fsdp.fully_shard`` at ZeRO-3,
  one unit per block: what a user of ``megatron.fsdp`` gets, nothing tuned;
- ``job``: the same shape as Megatron-Core's GPT (``--untie-embeddings-and-output-weights``), built by
  the job's model code with ``--init-model-with-meta-device`` and wrapped by the adapter's
  ``FullyShardedDataParallel``, after the job's ``initialize`` (which applies its allocator setting,
  ``megatron/fsdp_training/allocator.py``), as ``pretrain_gpt.py`` does.

Each rank first builds a tiny model both ways (the first meta build loads torch's meta kernels), then
measures the meta build, then the eager one. **Peak**: the resident set's high-water mark
(``VmHWM``, reset by writing ``5`` to ``/proc/self/clear_refs`` right before the build) above the
resident set before it, the heap trimmed first (so what an earlier build freed is not reused unseen);
CPU only, as the resident set sees it (on a GPU the promise is about ``max_memory_allocated``). **Bound**: this rank's persistent state after the build (its storages as
``memory_report()`` counts them, plus the model's buffers) plus the largest unit in fp32; the promise
is peak / bound <= 1.05. **After**: the resident set right after the build (no trim by this tool)
minus the persistent state. Each row is the rank with the largest ratio.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import subprocess
import sys
from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2 ** 20
_TAG = "META_INIT_PEAK "


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm1, self.qkv, self.proj = nn.LayerNorm(hidden), nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)


class GPT(nn.Module):
    """The parameters of a GPT (no forward: only its build is measured)."""

    def __init__(self, vocab: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)


def _measure(build) -> Dict[str, float]:
    """``build()`` returns wrapped models; their build's peak, persistent state, largest unit and what stays.

    The heap is trimmed first (glibc's ``malloc_trim``): what an earlier build freed would otherwise be
    resident already, and a build reusing it would look free."""
    from tools.bench.measure import peak_rss_bytes, reset_peak_rss, rss_bytes, trim_heap

    trim_heap()  # gc.collect(), then malloc_trim(0)
    dist.barrier()
    start = rss_bytes()
    if not reset_peak_rss():  # writes "5" to /proc/self/clear_refs: VmHWM restarts from the resident set
        raise RuntimeError("/proc/self/clear_refs is not writable here: the build's peak cannot be isolated")
    models = build()
    peak, after = peak_rss_bytes() - start, rss_bytes() - start
    units = [u for m in models for u in m.units]
    persistent = sum(m.memory_report().total for m in models)
    persistent += sum(b.untyped_storage().nbytes() for m in models for b in m.module.buffers())
    out = dict(peak=peak, after=after, persistent=persistent, unit=max(4 * u.storage.layout.padded_size for u in units),
               model=sum(4 * u.storage.layout.padded_size for u in units))
    del models, units
    gc.collect()
    return out


def _engine_worker(opts) -> Dict[str, Dict[str, float]]:
    import megatron.fsdp as mfsdp

    dist.init_process_group("gloo")

    def build(meta: bool, vocab: int, hidden: int, layers: int):
        torch.manual_seed(0)
        with torch.device("meta" if meta else "cpu"):
            module = GPT(vocab, hidden, layers)
        return [mfsdp.fully_shard(module, strategy="optim_grads_params", unit_modules=(Block,),
                                   meta_init=mfsdp.MetaInit(device="cpu"))]

    for meta in (True, False):
        build(meta, 256, 64, 1)
    return {kind: _measure(lambda: build(kind == "meta", opts.vocab, opts.hidden, opts.layers))
            for kind in ("meta", "eager")}


def _job_worker(opts) -> Dict[str, Dict[str, float]]:
    from megatron.fsdp.mcore import FullyShardedDataParallel, FullyShardedDataParallelConfig
    from megatron.fsdp_training import model as model_lib
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.data.data_config import TokenizerConfig
    from megatron.fsdp_training.data.datasets import build_tokenizer, padded_vocab_size
    from megatron.fsdp_training.arguments import validate_args
    from megatron.fsdp_training.initialize import initialize, launch_world_size
    from megatron.fsdp_training.parallel_config import ParallelConfig

    args = parse_args(["--mock-data", "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                       "--num-layers", str(opts.layers), "--hidden-size", str(opts.hidden),
                       "--num-attention-heads", str(max(1, opts.hidden // 64)), "--seq-length", "64",
                       "--max-position-embeddings", "64", "--untie-embeddings-and-output-weights",
                       "--tokenizer-type", "NullTokenizer", "--vocab-size", str(opts.vocab - 1),
                       "--micro-batch-size", "1"])
    validate_args(args, launch_world_size())
    initialize(ParallelConfig.from_args(args), args.seed)
    vocab = padded_vocab_size(build_tokenizer(TokenizerConfig.from_args(args)).vocab_size,
                              args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)

    def build(meta: bool, layers: int, hidden: int, vocab: int):
        a = copy.copy(args)
        a.init_model_with_meta_device, a.num_layers, a.hidden_size = meta, layers, hidden
        a.ffn_hidden_size, a.num_attention_heads = 4 * hidden, max(1, hidden // 64)
        config = model_lib.transformer_config(a, cpu=True)
        chunks = model_lib.build_model_chunks(config, model_lib.ModelBuildConfig.from_args(a, cpu=True), vocab)
        ddp = FullyShardedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
                                             grad_reduce_in_fp32=True)
        return [FullyShardedDataParallel(config, ddp, chunk).fsdp for chunk in chunks]

    for meta in (True, False):
        build(meta, 1, 64, 256)
    return {kind: _measure(lambda: build(kind == "meta", opts.layers, opts.hidden, vocab))
            for kind in ("meta", "eager")}


def _worker(opts) -> None:
    rows = (_engine_worker if opts.worker == "engine" else _job_worker)(opts)
    everyone: List[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    if dist.get_rank() == 0:
        print(_TAG + json.dumps(everyone), flush=True)
    dist.destroy_process_group()


def ratio(row: Dict[str, Dict[str, float]]) -> float:
    """A rank's meta-build peak over what it keeps (the promise: at most 1.05)."""
    m = row["meta"]
    return m["peak"] / (m["persistent"] + m["unit"])


def launch(kind: str, ranks: int, opts) -> List[Dict[str, Dict[str, float]]]:
    """One ``torchrun`` of ``kind`` (``engine`` or ``job``) at ``ranks`` (``opts``: layers, hidden, vocab):
    each rank's ``meta`` and ``eager`` measurements (``_measure``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           os.path.abspath(__file__), "--worker", kind, "--layers", str(opts.layers), "--hidden", str(opts.hidden),
           "--vocab", str(opts.vocab)]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(_TAG)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} at {ranks} ranks failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(_TAG):])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192, help="a multiple of 128 (the job pads to one)")
    parser.add_argument("--builds", nargs="+", choices=("engine", "job"), default=["engine", "job"])
    parser.add_argument("--worker", choices=("engine", "job"), help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker:
        return _worker(opts)
    print(f"meta-device build, ZeRO-3, fp32 GPT {opts.layers} x {opts.hidden}, vocabulary {opts.vocab}; "
          "MiB per rank (the rank with the largest ratio)")
    print("| ranks | build | model | persistent | largest unit | peak | peak / (persistent + unit) "
          "| after - persistent | eager peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for ranks in opts.ranks:
        for kind in opts.builds:
            worst = max(launch(kind, ranks, opts), key=ratio)
            m, e = worst["meta"], worst["eager"]
            print(f"| {ranks} | {kind} | {m['model'] / MIB:.1f} | {m['persistent'] / MIB:.1f} | {m['unit'] / MIB:.1f} "
                  f"| {m['peak'] / MIB:.1f} | {ratio(worst):.3f} "
                  f"| {(m['after'] - m['persistent']) / MIB:+.1f} | {e['peak'] / MIB:.1f} |", flush=True)


if __name__ == "__main__":
    main()

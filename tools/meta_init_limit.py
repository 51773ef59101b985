"""Train a model larger than each rank's memory limit: built on meta, 3 Adam steps at ZeRO-3, saved, resumed.

    python tools/meta_init_limit.py                     # 4 ranks, a 352 MiB GPT, limit 0.9 of it per rank
    python tools/meta_init_limit.py --hidden 768 --layers 8 --budget 0.9    # the test's model

Four processes (spawned: glibc's and torch's defaults, nothing inherited) each limit their data segment
(``RLIMIT_DATA``, the soft limit) to its size after a warm-up plus ``--budget`` times the model's full fp32
size, then: build the model on the meta device, train three steps saving after the second, build it again
from another seed, load, run the third step, and compare losses and every weight and optimizer-state byte
with the run that never stopped; then try the eager build of the same model under the same limit (it must
fail). ``tests/engine/test_memory_limit.py`` runs the same case (``trains_under_limit``) and asserts it.

Why these choices:

- ``RLIMIT_DATA``, not ``RLIMIT_AS``: both limit virtual memory, but the address space also holds what a
  process reserves and never touches (glibc's 64 MiB arena reservation per thread, shared libraries);
  the data segment is the private writable memory (heap, anonymous mappings, thread stacks), where
  tensors live. A cgroup's ``memory.max`` would count resident pages, but none is writable here.
- The warm-up (a tiny model through the same steps, one block of the model's width forward and backward)
  starts what a process starts once (gloo's and the engine's threads and their stacks, the CPU kernels'
  JIT code for these shapes): the budget goes to the model.
- glibc's mmap threshold fixed at 256 KiB: a limit on virtual memory counts the freed blocks a heap keeps,
  and under glibc's dynamic threshold (up to 32 MiB) a step's freed gathers and gradient buffers stay in
  it (an 88 MiB model of this shape: the data segment grew by up to twice the model in three steps);
  mapped blocks leave when freed. The build needs no setting (``test_meta_init.py`` holds it to its bound
  under glibc's defaults).
- bf16 weights (``MixedPrecision(main_dtype=bf16)``), Adam moments and gradients: at 4 ranks a rank
  trains with 8 B/param / 4 = 0.5 of the fp32 model, and a save or a load holds a copy of the optimizer's
  part beside it (state dicts hold copies; a load makes the new state while the loaded copy lives): 0.75.
  fp32 weights or moments make that 1.0 or more.
- Model and optimizer in two checkpoints, one file per item (``single_file_per_rank=False``): torch's
  ``FileSystemWriter`` keeps every tensor it wrote to a file until the file closes, its clones of box
  views included, so one file per rank held a second copy of the pieces that are not whole rows.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import re
import resource
from typing import Dict, List

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

import megatron.fsdp as mfsdp
from megatron.fsdp.testing.engine_training import GLOBAL_MICRO_BATCH, RunConfig, train_step
from megatron.fsdp.testing.models import MLP, ResetBlock, make_batches

STEPS, SAVED_AFTER = 3, 2
MMAP_THRESHOLD = 256 << 10
WARMUP = dict(vocab=96, hidden=32, heads=4, layers=2)
MIXED = mfsdp.MixedPrecision(param_dtype=torch.bfloat16, main_dtype=torch.bfloat16, grad_reduce_dtype=torch.bfloat16)


class LM(nn.Module):
    """Tied embedding and head around ``ResetBlock``s (each with a nested ``MLP`` unit); every weight is
    set by ``reset_parameters``, so it builds on meta."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(ResetBlock(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def model_bytes(model: Dict[str, int]) -> int:
    """The model's full size in fp32."""
    with torch.device("meta"):
        return sum(4 * p.numel() for p in LM(**model).parameters())


def _data_segment_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmData:\s+(\d+) kB", f.read()).group(1)) * 1024


def _build(ctx, model: Dict[str, int], seed: int, meta: bool = True):
    torch.manual_seed(seed)
    with torch.device("meta") if meta else contextlib.nullcontext():
        module = LM(**model)
    fsdp = mfsdp.fully_shard(module, strategy="optim_grads_params", unit_modules=(ResetBlock, MLP),
                             mesh=ctx.group, mixed_precision=MIXED)
    opt = mfsdp.FullyShardedOptimizer(fsdp, torch.optim.Adam, lr=1e-3, precision=mfsdp.OptimizerPrecision(
        torch.bfloat16, torch.bfloat16, main_grads_dtype=torch.bfloat16))
    return fsdp, opt


def _train(ctx, fsdp, opt, first: int, last: int) -> List[float]:
    batches = make_batches(STEPS, 1, GLOBAL_MICRO_BATCH)
    return [train_step(ctx, fsdp, opt, step, RunConfig())[0] for step in batches[first:last]]


def _save(ctx, fsdp, opt, path: str) -> None:
    for name, obj in (("model", fsdp), ("optim", opt)):
        writer = dcp.FileSystemWriter(os.path.join(path, name), single_file_per_rank=False)
        dcp.save({name: obj.state_dict()}, storage_writer=writer, process_group=ctx.group)


def _load(ctx, fsdp, opt, path: str) -> None:
    for name, obj in (("model", fsdp), ("optim", opt)):
        state = {name: obj.state_dict()}
        dcp.load(state, checkpoint_id=os.path.join(path, name), process_group=ctx.group)
        obj.load_state_dict(state[name])
        del state


def _digest(fsdp, opt) -> str:
    """This rank's weights and optimizer state, bitwise."""
    h = hashlib.sha256()
    tensors = [u.storage.main for u in fsdp.units]
    tensors += [v for st in opt.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def _run(ctx, model: Dict[str, int], path: str) -> Dict[str, object]:
    """Three steps, saving after the second; then a model from another seed loads it and runs the third."""
    fsdp, opt = _build(ctx, model, seed=1)
    straight = _train(ctx, fsdp, opt, 0, SAVED_AFTER)
    _save(ctx, fsdp, opt, path)
    straight += _train(ctx, fsdp, opt, SAVED_AFTER, STEPS)
    straight_digest = _digest(fsdp, opt)
    del fsdp, opt
    gc.collect()
    fsdp, opt = _build(ctx, model, seed=2)
    _load(ctx, fsdp, opt, path)
    resumed = _train(ctx, fsdp, opt, SAVED_AFTER, STEPS)
    resumed_digest = _digest(fsdp, opt)
    del fsdp, opt
    gc.collect()
    return {"straight": straight, "resumed": resumed, "same_state": straight_digest == resumed_digest}


def _eager_build_error(ctx, model: Dict[str, int]):
    """What building the same model eagerly raises (None: it was built)."""
    try:
        _build(ctx, model, seed=1, meta=False)
    except (RuntimeError, MemoryError) as exc:  # torch's CPU allocator raises RuntimeError
        return f"{type(exc).__name__}: {str(exc).splitlines()[0].rpartition('DefaultCPUAllocator: ')[2]}"
    return None


def _block_forward_backward(ctx, model: Dict[str, int]) -> None:
    """One block of the model's width, forward and backward in bf16 on a micro-batch's shape: the CPU
    kernels' code for these shapes (JIT-compiled, ~20 MiB of the data segment) is made before the limit."""
    block = ResetBlock(model["hidden"], model["heads"]).to(torch.bfloat16)
    x = torch.randn(GLOBAL_MICRO_BATCH // ctx.size, 8, model["hidden"], dtype=torch.bfloat16, requires_grad=True)
    block(x).float().sum().backward()


def trains_under_limit(ctx, path: str, model: Dict[str, int], budget_fraction: float) -> Dict[str, object]:
    """Warm up, limit the data segment to its size now plus ``budget_fraction`` of the model's fp32 bytes,
    run (build on meta, train, save, resume), then try the eager build under the same limit."""
    from megatron.fsdp_training.allocator import fix_mmap_threshold
    from tools.bench.measure import peak_rss_bytes, reset_peak_rss, rss_bytes

    fix_mmap_threshold(MMAP_THRESHOLD, respect_env=False)  # this pool's workers only
    _run(ctx, WARMUP, os.path.join(path, "warmup"))
    _block_forward_backward(ctx, model)
    gc.collect()
    full = model_bytes(model)
    out: Dict[str, object] = {"model_bytes": full, "budget_bytes": int(budget_fraction * full)}
    base, base_resident = _data_segment_bytes(), rss_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    reset_peak_rss()  # VmHWM from here: the run's resident peak, reported beside the limit
    resource.setrlimit(resource.RLIMIT_DATA, (base + out["budget_bytes"], hard))
    try:
        out.update(_run(ctx, model, os.path.join(path, "run")))
        out["resident_peak_bytes"] = peak_rss_bytes() - base_resident
        out["eager_error"] = _eager_build_error(ctx, model)
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    return out


def main(argv=None) -> int:
    import argparse
    import sys
    import tempfile

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatron.fsdp.testing.pool import WorkerPool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--budget", type=float, default=0.9, help="the limit above the warmed-up process, "
                        "as a fraction of the model's fp32 size")
    opts = parser.parse_args(argv)
    model = dict(vocab=opts.vocab, hidden=opts.hidden, heads=opts.heads, layers=opts.layers)
    pool = WorkerPool(4)
    try:
        with tempfile.TemporaryDirectory() as path:
            results = pool.run(trains_under_limit, size=4, timeout=1800, path=path, model=model,
                               budget_fraction=opts.budget)
    finally:
        pool.close()
    mib = 2 ** 20
    print(f"4 ranks, ZeRO-3, Adam; a GPT of {results[0]['model_bytes'] / mib:.1f} MiB in fp32; per rank (MiB):")
    print("| rank | limit above the warmed-up process | resident peak above it | losses (straight) | resumed: losses, state "
          "| eager build under the limit |")
    print("|---|---|---|---|---|---|")
    ok = True
    for rank, r in enumerate(results):
        same = r["straight"][SAVED_AFTER:] == r["resumed"] and r["same_state"]
        ok &= same and r["eager_error"] is not None and r["budget_bytes"] < r["model_bytes"]
        losses = ", ".join(f"{x:.4f}" for x in r["straight"])
        print(f"| {rank} | {r['budget_bytes'] / mib:.1f} | {r['resident_peak_bytes'] / mib:.1f} | {losses} "
              f"| {'bitwise equal' if same else 'DIFFERENT'} | {r['eager_error'] or 'built (no failure)'} |")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

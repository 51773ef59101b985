"""Step time on a two-axis mesh (HSDP, HFSDP, ZeRO-3 x ZeRO-3), side by side for two source trees.

    python tools/bench/mesh_step.py --trees main=/tmp/main_tree branch=. --size 5M --rounds 3

Trains the benchmark model (``tools/bench``'s ``TinyTransformer``, blocks as units, fp32)
on a 2 x 2 mesh of gloo CPU processes for ``--warmup`` + ``--steps`` steps per level pair
and reports the median step time (the slowest rank of each step). Each ``--trees``
entry ``label=PATH`` names a directory whose ``megatron/fsdp`` is the engine to time
(the rest, harness and model, comes from this checkout); the trees run in alternating
rounds, each in a fresh process and pool, so slow drift of the machine lands on both
alike. The table gives each tree's median and the ratio against the first tree.

To time ``main`` against a branch: ``mkdir /tmp/main_tree && git -C /work/main archive
main megatron | tar -x -C /tmp/main_tree`` (only ``megatron/`` is needed). Timings on a
shared machine are noisy: compare ratios from one run, not numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Dict, List, Optional


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = {  # label: (inner level, outer level)
    "HSDP": ("optim_grads_params", "no_shard"),
    "HFSDP": ("optim_grads_params", "optim"),
    "ZeRO-3 x ZeRO-3": ("optim_grads_params", "optim_grads_params"),
}


def step_times(ctx, model_size: str, inner: str, outer: str, warmup: int, steps: int) -> List[float]:
    """Pool case (4 ranks, the 2 x 2 mesh): seconds per timed step on this rank."""
    import time

    import torch

    import megatron.fsdp as mfsdp
    from examples.tiny_transformer import Block
    from tools.bench.spec import SIZES
    from tools.bench.torch_case import SEED, build_model

    torch.set_num_threads(1)
    fsdp = mfsdp.fully_shard(build_model(model_size), strategy=inner, outer_strategy=outer, mesh=ctx.meshes[(2, 2)],
                             unit_modules=(Block,))
    optimizer = mfsdp.FullyShardedOptimizer(fsdp, torch.optim.AdamW, lr=1e-4, clip_grad=1.0)
    shape = SIZES[model_size]
    gen = torch.Generator().manual_seed(SEED + ctx.rank)
    tokens = torch.randint(0, shape.vocab, (shape.rows, shape.seq + 1), generator=gen)
    out = []
    for k in range(warmup + steps):
        torch.distributed.barrier(ctx.group)
        t0 = time.perf_counter()
        fsdp(tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        if k >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def _one_tree(args) -> Dict[str, List[float]]:
    """Child process: every config once in one pool; per config, the slowest rank's time of each step."""
    import megatron.fsdp
    from megatron.fsdp.testing import WorkerPool
    pool = WorkerPool(4, start_timeout=600.0)
    try:
        result = {"engine": os.path.dirname(megatron.fsdp.__file__)}
        for label in args.configs:
            inner, outer = CONFIGS[label]
            per_rank = pool.run(step_times, timeout=1800, model_size=args.size, inner=inner,
                                outer=outer, warmup=args.warmup, steps=args.steps)
            result[label] = [max(ts) for ts in zip(*per_rank)]
    finally:
        pool.close()
    return result


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", nargs="+", default=[f"this={_ROOT}"], help="label=PATH (PATH holds megatron/fsdp)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--size", choices=("tiny", "5M", "50M"), default="5M")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds over the trees")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for tree in args.trees:
        label, sep, path = tree.partition("=")
        if not sep or not os.path.isdir(os.path.join(path, "megatron", "fsdp")):
            p.error(f"--trees {tree!r}: expected label=PATH with PATH/megatron/fsdp")
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Dict[str, List[float]]]:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(_one_tree(args)))
        return {}
    trees = [t.partition("=")[::2] for t in args.trees]
    times: Dict[str, Dict[str, List[float]]] = {label: {c: [] for c in args.configs} for label, _ in trees}
    for r in range(args.rounds):
        for label, path in trees[r % len(trees):] + trees[:r % len(trees)]:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(path), _ROOT]),
                       TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--size", args.size, "--warmup",
                   str(args.warmup), "--steps", str(args.steps), "--configs", *args.configs]
            done = subprocess.run(cmd, env=env, cwd=_ROOT, capture_output=True, text=True, check=False)
            if done.returncode:
                raise RuntimeError(f"tree {label} failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"round {r + 1}/{args.rounds}: {label} ({result.pop('engine')}) done", flush=True)
            for config, values in result.items():
                times[label][config] += values
    first = trees[0][0]
    header = f"{'config':<18}" + "".join(f"{label + ' ms':>14}" for label, _ in trees) + "".join(
        f"{label + '/' + first:>16}" for label, _ in trees[1:])
    lines = [f"step time, 2 x 2 mesh, {args.size} fp32, median of {args.rounds} x {args.steps} steps "
             "(slowest rank per step)", header, "-" * len(header)]
    for config in args.configs:
        med = {label: statistics.median(times[label][config]) for label, _ in trees}
        lines.append(f"{config:<18}" + "".join(f"{1e3 * med[label]:>14.1f}" for label, _ in trees)
                     + "".join(f"{med[label] / med[first]:>16.3f}" for label, _ in trees[1:]))
    print("\n".join(lines))
    return times


if __name__ == "__main__":
    main()

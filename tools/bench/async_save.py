"""How long a checkpoint save stops training: synchronous against ``--async-save``, side by side.

    python tools/bench/async_save.py                      # 51 M GPT, 4 CPU ranks, ZeRO-3 (docs/checkpoints.md)
    python tools/bench/async_save.py --ranks 2 --layers 2 --hidden 64 --vocab 1000   # a smoke run
    python tools/bench/async_save.py --writer-compare     # thread vs process writer under a busy training thread

The first form runs ``pretrain_gpt.py`` twice (``--save-interval`` saves, once
synchronous and once with ``--async-save``) and prints one table: the save's cost
to training (the synchronous save time; the async blocked time: the host copy, plus
any wait for the previous save), the background time (plan, write, publish), their ratio, and the wall time of the
iterations around each save (the interval between consecutive iteration log
lines, so a save's blocking lands in the iteration it follows) against the
median of the others. The synchronous save time starts once every rank has reached
the save (the log line gives the wait for the slowest rank apart: it is rank skew,
which the next collective of training would absorb without a save too); an async
save runs no collective on the training thread, so it waits for no rank.

``--writer-compare`` measures what a background writer costs the training
thread (GIL contention, memory bandwidth): a step loop of many small torch ops
(Python-bound, like a training step's hooks) alone, with the same bytes written
by a thread of this process, and by a separate process.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERATION = re.compile(r"^ iteration\s+(\d+)/")
SYNC = re.compile(r"saved checkpoint at iteration\s+(\d+) to .* in ([0-9.]+) s")
ASYNC = re.compile(r"saved checkpoint at iteration\s+(\d+) to .*\(async\): training blocked ([0-9.]+) s, "
                   r"background save ([0-9.]+) s")


def _run(args, extra: List[str], save_dir: str) -> Dict[str, object]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks),
           os.path.join(_ROOT, "pretrain_gpt.py"), "--mock-data", "--use-megatron-fsdp",
           "--data-parallel-sharding-strategy", "optim_grads_params", "--num-layers", str(args.layers),
           "--hidden-size", str(args.hidden), "--num-attention-heads", "8", "--seq-length", "128",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", str(args.vocab), "--micro-batch-size", "1",
           "--global-batch-size", str(args.ranks), "--train-iters", str(args.iters), "--eval-iters", "0",
           "--save", save_dir, "--save-interval", str(args.interval), "--lr", "1e-4"] + extra
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", PYTHONPATH=_ROOT)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=_ROOT)
    stamps, saves, log = {}, {}, []
    for line in proc.stdout:
        log.append(line)
        m = ITERATION.match(line)
        if m:
            stamps[int(m.group(1))] = time.perf_counter()
        for pattern in (SYNC, ASYNC):
            s = pattern.search(line)
            if s:
                saves[int(s.group(1))] = tuple(float(v) for v in s.groups()[1:])
    if proc.wait() != 0:
        raise SystemExit("pretrain_gpt.py failed:\n" + "".join(log[-40:]))
    if args.log:
        with open(args.log, "a") as f:
            f.write(f"==== {' '.join(extra) or 'synchronous'}\n" + "".join(log))
    walls = {i: stamps[i] - stamps[i - 1] for i in stamps if i - 1 in stamps}
    return {"walls": walls, "saves": saves}


def compare_saves(args) -> None:
    results = {}
    for mode, extra in (("sync", []), ("async", ["--async-save"])):
        directory = tempfile.mkdtemp(prefix=f"bench_{mode}_", dir=args.dir)
        try:
            results[mode] = _run(args, extra, directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    print(f"\n{args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; {args.ranks} CPU ranks, ZeRO-3, "
          f"save every {args.interval} of {args.iters} iterations (the last at the end)")
    print(f"{'mode':<6} {'save at':>8} {'training blocked (s)':>21} {'background (s)':>15} {'blocked / sync':>15} "
          f"{'iteration after (s)':>20} {'other iterations (s)':>21}")
    sync_times = {it: v[0] for it, v in results["sync"]["saves"].items()}
    for mode, res in results.items():
        walls, saves = res["walls"], res["saves"]
        after = {it + 1 for it in saves} | {it + 2 for it in saves}
        others = [w for i, w in walls.items() if i not in after]
        median = statistics.median(others) if others else float("nan")
        for it, values in sorted(saves.items()):
            blocked = values[0]
            write = values[1] if len(values) > 1 else values[0]
            ratio = blocked / sync_times[it] if it in sync_times and sync_times[it] else float("nan")
            next_walls = "/".join(f"{walls[i]:.2f}" for i in (it + 1, it + 2) if i in walls) or "-"
            print(f"{mode:<6} {it:>8} {blocked:>21.3f} {write:>15.2f} {ratio:>15.3f} {next_walls:>20} "
                  f"{median:>21.2f}")


# --------------------------------------------------------------- writer compare
def _busy_steps(steps: int) -> List[float]:
    import torch

    layers = [torch.nn.Linear(64, 64) for _ in range(24)]
    x = torch.randn(16, 64)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        h = x
        for layer in layers:
            h = torch.nn.functional.gelu(layer(h)) + h * 0.5
        h.sum().backward()
        times.append(time.perf_counter() - start)
    return times


def _write_forever(path: str, tensors, stop) -> None:
    import torch

    while not stop.is_set():
        with open(path, "wb") as f:
            for t in tensors:
                torch.save(t, f)
            f.flush()
            os.fsync(f.fileno())


def compare_writers(args) -> None:
    import multiprocessing as mp
    import threading

    import torch

    tensors = [torch.randn(args.mib * 2**18 // 16) for _ in range(16)]  # args.mib MiB of fp32
    for t in tensors:
        t.share_memory_()
    path = os.path.join(args.dir or tempfile.gettempdir(), f"writer_compare_{os.getpid()}.bin")
    rows = {}
    try:
        for mode in ("alone", "thread", "process"):
            if mode == "thread":
                stop = threading.Event()
                worker = threading.Thread(target=_write_forever, args=(path, tensors, stop), daemon=True)
            elif mode == "process":
                ctx = mp.get_context("fork")
                stop = ctx.Event()
                worker = ctx.Process(target=_write_forever, args=(path, tensors, stop), daemon=True)
            if mode != "alone":
                worker.start()
                time.sleep(0.2)
            times = _busy_steps(args.steps)
            if mode != "alone":
                stop.set()
                worker.join()
            rows[mode] = statistics.median(times[5:])
    finally:
        if os.path.exists(path):
            os.remove(path)
    print(f"\ntraining-like step (many small ops) while {args.mib} MiB are written over and over")
    print(f"{'writer':<8} {'median step (ms)':>17} {'vs alone':>9}")
    for mode, t in rows.items():
        print(f"{mode:<8} {t * 1000:>17.2f} {t / rows['alone']:>9.2f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=50256)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--interval", type=int, default=4)
    p.add_argument("--dir", default=None, help="where the checkpoints go (a temporary directory, removed)")
    p.add_argument("--log", default=None, help="append both runs' full output to this file")
    p.add_argument("--writer-compare", action="store_true")
    p.add_argument("--mib", type=int, default=150, help="--writer-compare: bytes written per round")
    p.add_argument("--steps", type=int, default=60, help="--writer-compare: training-like steps per writer")
    args = p.parse_args(argv)
    if args.writer_compare and args.steps <= 5:
        p.error(f"--steps {args.steps}: the first 5 steps are warm-up, not counted; give at least 6")
    compare_writers(args) if args.writer_compare else compare_saves(args)


if __name__ == "__main__":
    main()

"""The time model on this machine against measured steps: the benchmark's shapes, trained for real and estimated.

    python tools/estimate_vs_measured.py [--iterations 8] [--ranks 2 4] [--shapes 5M 50M]

For each of the benchmark's GPT shapes (``tools/bench/spec.py``'s 5M and 50M: vocabulary, hidden, layers, heads,
sequence, two sequences per rank per step) and each rank count, ``pretrain_gpt.py`` trains at ZeRO-3 under
``torchrun`` (fp32, mock data) and its iterations' elapsed times are read from its log (the median of all but the
first two); then ``megatron-fsdp-estimate --hardware this-machine`` predicts the same configuration's step
(``this-machine`` measures one thread's GEMM FLOP/s and gloo's latency and bandwidth first). Prints a markdown
table with the ratio. Run it on a quiet machine: both sides are timed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from typing import List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.bench.spec import SIZES  # noqa: E402

ELAPSED = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def flags(shape: str, ranks: int, iterations: int) -> List[str]:
    size = SIZES[shape]
    return ["--num-layers", str(size.layers), "--hidden-size", str(size.hidden), "--num-attention-heads",
            str(size.heads), "--seq-length", str(size.seq), "--max-position-embeddings", str(size.seq),
            "--vocab-size", str(size.vocab), "--tokenizer-type", "NullTokenizer", "--micro-batch-size",
            str(size.rows), "--global-batch-size", str(size.rows * ranks), "--train-iters", str(iterations),
            "--lr", "1e-4", "--mock-data", "--log-interval", "1", "--eval-iters", "0", "--attention-dropout", "0",
            "--hidden-dropout", "0", "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]


def _env() -> dict:
    return dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


def measured(shape: str, ranks: int, iterations: int) -> float:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                           os.path.join(ROOT, "pretrain_gpt.py"), *flags(shape, ranks, iterations)],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=3600)
    if done.returncode:
        raise SystemExit(f"{shape} on {ranks} ranks failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    times = [float(ms) / 1000 for ms in ELAPSED.findall(done.stdout)]
    if len(times) <= 2:
        raise SystemExit(f"{shape} on {ranks} ranks: {len(times)} iterations logged; pass --iterations 4 or more")
    return statistics.median(times[2:])


def predicted(shape: str, ranks: int, iterations: int) -> dict:
    with tempfile.TemporaryDirectory() as where:
        path = os.path.join(where, "estimate.json")
        done = subprocess.run([sys.executable, "-m", "megatron.fsdp_training.tools.estimate", "--world-size",
                               str(ranks), "--rank", "0", "--hardware", "this-machine", "--json", path,
                               *flags(shape, ranks, iterations)], capture_output=True, text=True, env=_env(), cwd=ROOT,
                              timeout=3600)
        if done.returncode:
            raise SystemExit(f"the estimate of {shape} on {ranks} ranks failed:\n{done.stderr[-2000:]}")
        with open(path) as f:
            return json.load(f)["ranks"][0]["predicted"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--shapes", nargs="+", default=["5M", "50M"], choices=sorted(SIZES))
    args = parser.parse_args(argv)
    rows = ["| shape | ranks | measured s/step (median) | predicted s/step | predicted / measured | predicted GEMMs, "
            "elementwise, exposed communication, optimizer s |", "|---|---|---|---|---|---|"]
    for shape in args.shapes:
        for ranks in args.ranks:
            real = measured(shape, ranks, args.iterations)
            model = predicted(shape, ranks, args.iterations)
            rows.append(f"| {shape} | {ranks} | {real:.3f} | {model['step_seconds']:.3f} | "
                        f"{model['step_seconds'] / real:.2f} | {model['gemm_seconds']:.3f}, "
                        f"{model['elementwise_seconds']:.3f}, "
                        f"{model['exposed_communication_seconds']:.3f}, {model['optimizer_seconds']:.3f} |")
            print(rows[-1], file=sys.stderr, flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

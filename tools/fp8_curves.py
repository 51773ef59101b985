"""Train the stdlib GPT in bf16, FP8 hybrid delayed and MXFP8; print the validation-loss curves side by side.

    python tools/fp8_curves.py [--train-iters 300] [--eval-interval 25] [--nproc 2] [--fp8-param-gather]
                               [-- extra pretrain_gpt.py args]

The corpus of ``examples/train_gpt_on_stdlib.sh`` (the Python standard library's sources, byte-level tokens) and
the smallest GPT that learns it in a few minutes on 2 CPU cores (2 layers, hidden 64, sequence 128, global
batch 32; validation on 8 batches), megatron.fsdp ZeRO-3 with ``--bf16``; the FP8 runs add Megatron-LM's flags (docs/precision.md, "FP8"),
and ``--fp8-param-gather`` if asked (the engine then gathers the weights in FP8). Each run is one torchrun launch
of pretrain_gpt.py; the validation losses are read from its log, each curve printed as its run ends. The last line
says how far each FP8 run ends from the bf16 run, against the 2% the FP8 recipes are held to.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import sysconfig
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "128",
         "--micro-batch-size", "16", "--global-batch-size", "32", "--lr", "3e-3", "--min-lr", "3e-4",
         "--lr-warmup-iters", "10", "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0",
         "--split", "98,2,0", "--tokenizer-type", "ByteLevelTokenizer", "--bf16", "--use-megatron-fsdp",
         "--data-parallel-sharding-strategy", "optim_grads_params"]
RUNS = {
    "bf16": [],
    "fp8 hybrid delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16",
                           "--fp8-amax-compute-algo", "max"],
    "mxfp8": ["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"],
}
TOLERANCE = 0.02
_VALID = re.compile(r"validation loss at iteration\s+(\d+) \| lm loss value: ([0-9.E+-]+)")


def corpus(directory: str) -> str:
    """The examples' indexed dataset of the stdlib's sources (built once, as train_gpt_on_stdlib.sh builds it)."""
    prefix = os.path.join(directory, "stdlib")
    if not os.path.exists(prefix + "_text_document.idx"):
        os.makedirs(directory, exist_ok=True)
        stdlib = sysconfig.get_paths()["stdlib"]
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input",
                        os.path.join(stdlib, "*.py"), "--input-format", "text", "--tokenizer-type", "ByteLevelTokenizer",
                        "--append-eod", "--workers", "2", "--output-prefix", prefix], check=True, cwd=ROOT)
    return prefix + "_text_document"


def train(nproc: int, argv: List[str]) -> Dict[int, float]:
    """One torchrun launch of pretrain_gpt.py: its validation losses by iteration."""
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                          "--master_port", os.environ.get("MASTER_PORT", "29561"), os.path.join(ROOT, "pretrain_gpt.py")]
                         + argv, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"pretrain_gpt.py {' '.join(argv)} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    for line in out.stdout.splitlines():
        if line.startswith("> FP8"):
            print(line, flush=True)
    return {int(i): float(v) for i, v in _VALID.findall(out.stdout)}


def table(curves: Dict[str, Dict[int, float]]) -> List[str]:
    base = curves["bf16"]
    names = list(curves)
    rows = ["| iteration | " + " | ".join(f"{n} validation loss" for n in names) + " |",
            "|---:|" + "---:|" * len(names)]
    for it in sorted(base):
        cells = [f"{base[it]:.4f}"] + [f"{curves[n][it]:.4f} ({(curves[n][it] - base[it]) / base[it]:+.2%})"
                                       for n in names[1:]]
        rows.append(f"| {it} | " + " | ".join(cells) + " |")
    last = max(base)
    gaps = {n: (curves[n][last] - base[last]) / base[last] for n in names[1:]}
    within = all(abs(g) <= TOLERANCE for g in gaps.values())
    rows.append("")
    rows.append(f"at iteration {last}: " + ", ".join(f"{n} {g:+.2%}" for n, g in gaps.items())
                + f" of bf16's validation loss (within {TOLERANCE:.0%}: {'yes' if within else 'no'})")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument("--eval-iters", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--fp8-param-gather", action="store_true", help="the FP8 runs gather their weights in FP8")
    parser.add_argument("--data-dir", default=os.environ.get("DATA_DIR") or os.path.join(
        os.environ.get("TMPDIR", "/tmp"), "mfsdp-stdlib"))
    parser.add_argument("extra", nargs="*", help="further pretrain_gpt.py arguments (after --)")
    args = parser.parse_args(argv)
    data = ["--data-path", corpus(args.data_dir), "--train-iters", str(args.train_iters),
            "--eval-interval", str(args.eval_interval), "--eval-iters", str(args.eval_iters),
            "--log-interval", str(args.eval_interval)]
    curves = {}
    for name, flags in RUNS.items():
        gather = ["--fp8-param-gather"] if flags and args.fp8_param_gather else []
        curves[name] = train(args.nproc, MODEL + data + flags + gather + list(args.extra))
        print(f"{name}: " + ", ".join(f"{it} {v:.4f}" for it, v in sorted(curves[name].items())), flush=True)
    print("\n".join(table(curves)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

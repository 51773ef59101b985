"""The estimate at the sizes users train: Llama-3 8B, 70B and 405B at ZeRO-3 and HSDP, 64 to 1,024 ranks.

    python tools/estimate_at_scale.py [--published] [--only NAME ...] [--json PATH]

Each configuration runs ``megatron-fsdp-estimate`` in a process of its own (a simulation: the job's build and
one step as ranks 0, the middle one and the last of the world, on torch's fake process group with fake
tensors), and this prints one markdown table (docs/estimate.md, "At the sizes users train", is this output):
per configuration the persistent and peak bytes of rank 0, one step's bytes sent and the share that crosses
nodes (8 GPUs a node), the checkpoint's size, the time model's prediction on H100s, and the estimate's own
cost (seconds and host memory). It fails if the sampled ranks disagree on the step's collectives (calls per
axis and kind) or on anything but the tail's padding.

The model shapes are the published ones (Meta's Llama 3 and 3.1 configurations); the layouts are what a fully
sharded run of that size uses: data parallel alone up to 8B, tensor parallel 8 inside a node beyond it; HSDP
keeps 8 replicas
(``--num-distributed-optimizer-instances 8``) with the shard axis inside them. ``--published`` estimates the
configurations of published runs (torchtitan's H100 benchmarks, Megatron-Bridge's Megatron-FSDP row) and prints
their figures beside the prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_COMMON = ["--mock-data", "--bf16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
           "--attention-dropout", "0", "--hidden-dropout", "0", "--no-create-attention-mask-in-dataloader",
           "--eval-iters", "0", "--init-model-with-meta-device", "--normalization", "RMSNorm", "--swiglu",
           "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
           "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]


def _llama(layers: int, hidden: int, ffn: int, heads: int) -> List[str]:
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--ffn-hidden-size", str(ffn),
            "--num-attention-heads", str(heads), "--group-query-attention", "--num-query-groups", "8",
            "--seq-length", "8192", "--max-position-embeddings", "8192", "--vocab-size", "128256"]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    world: int
    flags: List[str]

    def command(self, json_path: str) -> List[str]:
        ranks = sorted({0, self.world // 2, self.world - 1})
        return [sys.executable, "-m", "megatron.fsdp_training.tools.estimate", "--world-size", str(self.world),
                *[a for r in ranks for a in ("--rank", str(r))], "--gpus-per-node", "8", "--hardware", "h100-sxm",
                "--json", json_path, *_COMMON, *self.flags]


HSDP = ["--num-distributed-optimizer-instances", "8"]
TP8 = ["--tensor-model-parallel-size", "8", "--sequence-parallel"]
CASES = [
    Case("llama3-8b zero3", 64, _llama(32, 4096, 14336, 32) + ["--global-batch-size", "128"]),
    Case("llama3-8b hsdp", 64, _llama(32, 4096, 14336, 32) + ["--global-batch-size", "128"] + HSDP),
    Case("llama3-70b zero3", 256, _llama(80, 8192, 28672, 64) + ["--global-batch-size", "128"] + TP8),
    Case("llama3-70b hsdp", 256, _llama(80, 8192, 28672, 64) + ["--global-batch-size", "128"] + TP8 + HSDP),
    Case("llama3.1-405b zero3", 1024, _llama(126, 16384, 53248, 128) + ["--global-batch-size", "256"] + TP8),
    Case("llama3.1-405b hsdp", 1024, _llama(126, 16384, 53248, 128) + ["--global-batch-size", "256"] + TP8 + HSDP),
]


@dataclasses.dataclass(frozen=True)
class Published:
    """A run someone published, and the same configuration estimated."""

    case: Case
    source: str
    tokens_per_second_per_gpu: float
    memory_gib: Optional[float]
    differs: str  # what the published run did that the estimate does not model


LLAMA3_8B, LLAMA3_70B = _llama(32, 4096, 14336, 32), _llama(80, 8192, 28672, 64)
TORCHTITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
PUBLISHED = [
    Published(Case("llama3-8b, 8 ranks", 8, LLAMA3_8B + ["--micro-batch-size", "2", "--global-batch-size", "16",
                                                         "--recompute-granularity", "selective"]),
              f"{TORCHTITAN}, table 1 (FSDP)", 5762, 82.4,
              "H100 at 500 W (below the SXM peak); selective op recompute (here: Megatron's selective, attention)"),
    Published(Case("llama3-8b, 128 ranks", 128, LLAMA3_8B + ["--micro-batch-size", "2", "--global-batch-size", "256",
                                                             "--recompute-granularity", "selective"]),
              f"{TORCHTITAN}, table 3 (FSDP)", 5605, 67.0, "as above"),
    Published(Case("llama3-70b, 256 ranks (TP 8)", 256, LLAMA3_70B + TP8 + [
        "--micro-batch-size", "16", "--global-batch-size", "512", "--recompute-granularity", "full",
        "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
              f"{TORCHTITAN}, table 4 (2D)", 829, 71.9, "torch.compile and Float8 GEMMs (here: bf16)"),
    Published(Case("llama3-8b FP8, 8 ranks", 8, LLAMA3_8B + ["--global-batch-size", "128", "--fp8-format",
                                                             "hybrid"]),
              "Megatron-Bridge docs/performance-summary.md, Megatron-FSDP row", 14451, None,
              "Transformer Engine's fused kernels; FP8 here is the time model's FP8 peak on the same GEMMs"),
]


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def _agreement(case: Case, ranks: Sequence[dict]) -> None:
    """The sampled ranks send the same (calls and bytes per axis and kind) and keep the same but for padding."""
    plans = [[(c["axis"], c["kind"], c["calls"], c["bytes"]) for c in r["collectives"]] for r in ranks]
    if any(plan != plans[0] for plan in plans[1:]):
        raise SystemExit(f"{case.name}: the sampled ranks' collectives differ: {plans}")
    totals = [r["persistent_bytes"]["total"] for r in ranks]
    if max(totals) > 1.25 * min(totals):  # the last rank's shards end in padding (no main weights, no state)
        raise SystemExit(f"{case.name}: the sampled ranks' persistent bytes differ beyond padding: {totals}")


def run(case: Case) -> dict:
    with tempfile.TemporaryDirectory() as where:
        path = os.path.join(where, "estimate.json")
        start = time.perf_counter()
        done = subprocess.run(case.command(path), capture_output=True, text=True, cwd=ROOT,
                              env=dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1"))
        seconds = time.perf_counter() - start
        if done.returncode:
            raise SystemExit(f"{case.name}: the estimate failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        with open(path) as f:
            estimate = json.load(f)
    _agreement(case, estimate["ranks"])
    return dict(estimate, name=case.name, seconds=seconds)


def table(results: Sequence[dict]) -> str:
    lines = ["| configuration | ranks | persistent GiB | peak GiB (fwd / bwd) | sent per step GiB (across nodes) | "
             "checkpoint GiB (per rank) | predicted s/step, tokens/s/GPU, MFU | estimate s, host GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        first = r["ranks"][0]
        sent = sum(c["wire_bytes"] for c in first["collectives"])
        across = sum(c["wire_bytes"] for c in first["collectives"] if c["crosses_nodes"])
        p, peak, ckpt, pred = first["persistent_bytes"], first["peak_bytes"], first["checkpoint"], first["predicted"]
        host = max(rank["host_peak_bytes"] for rank in r["ranks"])
        lines.append(
            f"| {r['name']} | {r['world_size']} | {_gib(p['total'])} | {_gib(peak['forward'])} / "
            f"{_gib(peak['backward'])} | {_gib(sent)} ({100 * across / max(sent, 1):.0f}%) | "
            f"{_gib(ckpt['total_bytes'])} ({_gib(ckpt['rank_bytes'])}) | {pred['step_seconds']:.2f}, "
            f"{pred['tokens_per_second_per_gpu']:.0f}, {100 * pred['mfu']:.0f}% | {r['seconds']:.0f}, "
            f"{host / 2**30:.1f} |")
    return "\n".join(lines)


def published_table(rows: Sequence[Published], results: Sequence[dict]) -> str:
    lines = ["| configuration | published (source) | tokens/s/GPU: published, predicted (ratio) | memory GiB: "
             "published, estimated peak | what differs |", "|---|---|---|---|---|"]
    for row, r in zip(rows, results):
        first = r["ranks"][0]
        predicted = first["predicted"]["tokens_per_second_per_gpu"]
        peak = max(first["peak_bytes"].values()) / 2**30
        memory = f"{row.memory_gib:.1f}, {peak:.1f}" if row.memory_gib is not None else f"-, {peak:.1f}"
        lines.append(f"| {row.case.name} | {row.source} | {row.tokens_per_second_per_gpu:,.0f}, {predicted:,.0f} "
                     f"({predicted / row.tokens_per_second_per_gpu:.2f}) | {memory} | {row.differs} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--published", action="store_true",
                        help="estimate the configurations of published runs instead, beside their figures")
    parser.add_argument("--only", action="append", help="run only the configuration of this name")
    parser.add_argument("--json", default=None, help="also write every estimate here")
    args = parser.parse_args(argv)
    rows = PUBLISHED if args.published else CASES
    chosen = [row for row in rows if not args.only or (row.case if args.published else row).name in args.only]
    results = []
    for row in chosen:
        case = row.case if args.published else row
        print(f" estimating {case.name} at {case.world} ranks ...", file=sys.stderr, flush=True)
        results.append(run(case))
    print(published_table(chosen, results) if args.published else table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

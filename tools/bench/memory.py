"""Steady-state peak resident memory per rank: this engine's ZeRO-3 against PyTorch FSDP2.

    python tools/bench/memory.py                       # 70M model, 2 and 4 ranks, bf16 compute
    python tools/bench/memory.py --ranks 2 --size 5M   # a quick look

Trains the torch workload (``tools/bench/torch_case.py``: the same model, optimizer and
mixed-precision policy as ``run.py``) under FSDP2 ``fully_shard`` and this engine at
``optim_grads_params``, with fp32 optimizer state and again with bf16 state
(``FullyShardedOptimizer(..., precision=OptimizerPrecision(bf16, bf16))``; FSDP2 has no such option), with
the training job's two ZeRO-3 flags as engine options (``+bf16_reduce``: gradients reduced in
bf16, ``--grad-reduce-in-bf16``; ``+double_buffer``: persistent gather buffers,
``--fsdp-double-buffer``), and
prints peak and persistent memory per rank side by side, as ratios to FSDP2, with the
persistent bytes split the same way for both systems (``measure.persistent_breakdown``):
the weights the optimizer updates, their gradients, the optimizer state, and everything
else alive between steps (``other``: buffers, staging, caches).

Each configuration runs twice by default, both systems alike: as launched by the training
job (``default``: the job's fixed glibc mmap threshold, ``megatron/fsdp_training/allocator.py``,
set in every rank before the model is built, as ``initialize`` does for pretrain_gpt.py,
and its heap trim after each unit's backward, on both systems: the engine's post-backward
hook for ours, a block backward hook for FSDP2),
and under glibc's own defaults (``glibc``), whose mmap threshold rises after a large free so
that freed blocks stay resident. ``1`` (``MALLOC_ARENA_MAX=1``: one malloc arena for all
threads), ``threshold`` (the job's threshold without the trim) and ``mmap`` (``MALLOC_MMAP_THRESHOLD_=65536`` in the environment) are diagnoses
on top of glibc's defaults.

On a CPU that emulates bf16 matrix products (no AVX512-BF16 or AMX) a 70M bf16 step takes
most of an hour, so by default (``--upcast-bf16 auto``) the ranks run bf16 linears and
attention through fp32 kernels that save the same bf16 tensors for the backward
(``bf16_support.upcast_bf16_kernels``): weights, activations and gradients stay bf16,
both systems alike, and only transient fp32 copies inside one call are added.

Peak = the resident-set high-water mark over the timed steps minus the resident set before
the model was built (``measure.py``), the largest rank. bf16 matmuls are emulated on CPUs
without native bf16, so steps are slow: the defaults are one warm-up and two timed steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Dict, List, Optional

# Run as a script, the repository root is not on sys.path: this tool imports its own folder as tools.bench.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tools.bench import measure as M  # noqa: E402
from tools.bench.spec import OURS_OPTIONS, PEAK_TARGET, SIZES  # noqa: E402
from tools.bench.torch_case import run as CASE  # noqa: E402


os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


SYSTEMS = ("fsdp2", "ours:optim_grads_params", "ours:optim_grads_params:bf16-state") + OURS_OPTIONS
LABELS = {"fsdp2": "FSDP2", "ours:optim_grads_params": "ours ZeRO-3, fp32 state",
          "ours:optim_grads_params:bf16-state": "ours ZeRO-3, bf16 state",
          **{system: "ours ZeRO-3, " + system.partition("+")[2].replace("_", " ") for system in OURS_OPTIONS}}
# glibc settings of the ranks: as launched by the training job (megatron.fsdp_training.allocator: its
# fixed mmap threshold and the heap trimmed after each unit's backward); the job's threshold
# without the trim; glibc's defaults; one arena (MALLOC_ARENA_MAX=1); a fixed 64 KiB
# mmap threshold from the environment (MALLOC_MMAP_THRESHOLD_, which also stops glibc raising it
# after large frees), so every large block is mapped on allocation and unmapped on free and the
# resident set follows the live tensors rather than heap fragmentation (diagnoses)
ARENAS = ("default", "threshold", "glibc", "1", "mmap")
_MALLOC_ENV = {"1": ("MALLOC_ARENA_MAX", "1"), "mmap": ("MALLOC_MMAP_THRESHOLD_", "65536")}
BREAKDOWN = ("weights", "grads", "state", "other")  # measure.persistent_breakdown, largest rank of each
VERDICT_ARENAS = ("default", "glibc")  # the job's allocator setting and glibc's own: the target holds for both
MIB = 2 ** 20


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    p.add_argument("--size", choices=list(SIZES), default="70M")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--arenas", nargs="+", choices=ARENAS, default=["default", "glibc"],
                   help="glibc settings: 'default' (as the training job launches: its fixed mmap threshold and a "
                        "heap trim after each unit's backward), 'threshold' (the job's threshold, no trim), "
                        "'glibc' (glibc's defaults), '1' (MALLOC_ARENA_MAX=1), 'mmap' (MALLOC_MMAP_THRESHOLD_=65536)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps (the optimizer state appears in the first)")
    p.add_argument("--steps", type=int, default=2, help="timed steps over which the peak is taken")
    p.add_argument("--rounds", type=int, default=1, help="runs of each system (the table shows the median)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    p.add_argument("--upcast-bf16", choices=("auto", "yes", "no"), default="auto",
                   help="bf16 linears and attention through fp32 kernels with bf16 saved tensors "
                        "(bf16_support.upcast_bf16_kernels); auto: where bf16 is emulated")
    p.add_argument("--shared-pool", dest="fresh_pool", action="store_false",
                   help="measure every system in one pool per setting; default: "
                        "fresh ranks for every run, since what a big run leaves in a process moved the next "
                        "run's peak by up to 85 MiB at 70M (docs/performance.md)")
    p.add_argument("--out", default=None, help="JSON of every run")
    return p.parse_args(argv)


def _arena_env(setting: str):
    """The glibc setting for the ranks a pool spawns now (glibc reads it at process start)."""
    return M.spawn_env(*_MALLOC_ENV[setting]) if setting in _MALLOC_ENV else contextlib.nullcontext()


def _median(values: List[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def run_all(args, log=print) -> List[Dict]:
    from megatron.fsdp.testing import WorkerPool

    records = []
    for ranks in args.ranks:
        for arena in args.arenas:
            settings = dict(bf16=True, worker=M.WorkerSetting(
                max(1, (os.cpu_count() or 1) // ranks), upcast_bf16=args.upcast,
                job_allocator=arena in ("default", "threshold"), trim=arena == "default"))

            def spawn(systems):
                """A pool, with one discarded tiny step per system: imports and one-time allocations."""
                with _arena_env(arena):
                    pool = WorkerPool(ranks, start_timeout=900.0)
                for system in systems:
                    pool.run(CASE, timeout=600.0, system=system, size_name="tiny", warmup=1, steps=1, **settings)
                return pool

            pool = None if args.fresh_pool else spawn(args.systems)
            try:
                for rnd in range(args.rounds):
                    for system in args.systems[rnd % len(args.systems):] + args.systems[:rnd % len(args.systems)]:
                        start = time.perf_counter()
                        if args.fresh_pool:
                            pool = spawn([system])
                        try:
                            per_rank = pool.run(CASE, timeout=args.timeout, system=system, size_name=args.size,
                                                warmup=args.warmup, steps=args.steps, **settings)
                        finally:
                            if args.fresh_pool:
                                pool.close()
                        record = {"ranks": ranks, "arena": arena, "system": system, "round": rnd,
                                  "params": per_rank[0]["params"],
                                  "peak_bytes": max(r["peak_bytes"] for r in per_rank),
                                  "persistent_bytes": max(r["persistent_bytes"] for r in per_rank),
                                  "breakdown": {kind: max(r["persistent_breakdown"][kind] for r in per_rank)
                                                for kind in BREAKDOWN},
                                  "step_s": _median([max(ts) for ts in zip(*(r["times"] for r in per_rank))])}
                        records.append(record)
                        log(f"[N={ranks} allocator={arena}] {LABELS[system]}: peak "
                            f"{record['peak_bytes'] / MIB:.1f} MiB ({time.perf_counter() - start:.0f} s)")
            finally:
                if pool is not None and not args.fresh_pool:
                    pool.close()
    return records


def rows(records: List[Dict]) -> List[Dict]:
    """One row per (ranks, arena, system): medians over rounds, ratios against FSDP2 of the same setting."""
    keys = sorted({(r["ranks"], r["arena"], r["system"]) for r in records},
                  key=lambda k: (k[0], ARENAS.index(k[1]), SYSTEMS.index(k[2])))
    out = []
    for ranks, arena, system in keys:
        mine = [r for r in records if (r["ranks"], r["arena"], r["system"]) == (ranks, arena, system)]
        row = {"ranks": ranks, "arena": arena, "system": system, "params": mine[0]["params"],
               "peak_mib": _median([r["peak_bytes"] for r in mine]) / MIB,
               "persistent_mib": _median([r["persistent_bytes"] for r in mine]) / MIB,
               "breakdown_mib": {k: _median([r["breakdown"][k] for r in mine]) / MIB for k in BREAKDOWN},
               "step_s": _median([r["step_s"] for r in mine])}
        out.append(row)
    for row in out:
        peer = next((r for r in out if (r["ranks"], r["arena"], r["system"]) == (row["ranks"], row["arena"], "fsdp2")),
                    None)
        row["peak_x_fsdp2"] = row["peak_mib"] / peer["peak_mib"] if peer and peer["peak_mib"] > 0 else None
        row["persistent_x_fsdp2"] = (row["persistent_mib"] / peer["persistent_mib"]
                                     if peer and peer["persistent_mib"] > 0 else None)
    return out


def format_table(table: List[Dict]) -> str:
    head = (f"{'N':>2} {'allocator':>16} {'system':<26} | {'peak MiB':>9} {'x FSDP2':>8} | "
            f"{'persist MiB':>11} {'x FSDP2':>8} | " + " ".join(f"{k:>7}" for k in BREAKDOWN) + f" | {'step s':>7}")
    lines = [head, "-" * len(head)]
    for r in table:
        ratio = lambda x: "-" if x is None or r["system"] == "fsdp2" else f"{x:.3f}x"  # noqa: E731
        lines.append(f"{r['ranks']:>2} {r['arena']:>16} {LABELS[r['system']]:<26} | {r['peak_mib']:>9.1f} "
                     f"{ratio(r['peak_x_fsdp2']):>8} | {r['persistent_mib']:>11.1f} {ratio(r['persistent_x_fsdp2']):>8} | "
                     + " ".join(f"{r['breakdown_mib'][k]:>7.1f}" for k in BREAKDOWN) + f" | {r['step_s']:>7.2f}")
    return "\n".join(lines)


def verdict(table: List[Dict]) -> str:
    """The issue's target: ours (fp32 state) at most 0.92x FSDP2's peak at every world size, with the
    job's allocator setting (``default``) and with glibc's defaults (``glibc``): one line for each
    setting measured."""
    lines = []
    for arena in VERDICT_ARENAS:
        mine = [r for r in table if r["system"] == "ours:optim_grads_params" and r["arena"] == arena
                and r["peak_x_fsdp2"] is not None]
        if not mine:
            continue
        ok = all(r["peak_x_fsdp2"] <= PEAK_TARGET for r in mine)
        detail = ", ".join(f"N={r['ranks']}: {r['peak_x_fsdp2']:.3f}x" for r in mine)
        lines.append(f"[{'pass' if ok else 'fail'}] ZeRO-3 (bf16 compute, fp32 state) peak <= {PEAK_TARGET}x FSDP2, "
                     f"allocator {arena}: {detail}")
    return "\n".join(lines) or (f"[not measured] ZeRO-3 peak <= {PEAK_TARGET}x FSDP2 (needs fsdp2 and "
                                 f"ours:optim_grads_params, arenas {' or '.join(VERDICT_ARENAS)})")


def main(argv: Optional[List[str]] = None) -> Dict:
    args = parse_args(argv)
    from tools.bench.bf16_support import native_bf16
    native, reason = native_bf16()
    args.upcast = args.upcast_bf16 == "yes" or (args.upcast_bf16 == "auto" and not native)
    print(f"bf16 kernels: {'fp32 kernels, bf16 tensors (--upcast-bf16)' if args.upcast else 'native'} ({reason})",
          flush=True)
    records = run_all(args, log=lambda line: print(line, file=sys.stderr, flush=True))
    table = rows(records)
    print(f"{SIZES[args.size]}, {records[0]['params'] if records else '?'} parameters, bf16 compute, "
          f"{args.warmup} warm-up + {args.steps} timed steps, {args.rounds} round(s)")
    print(format_table(table))
    print(verdict(table))
    results = {"command": " ".join(sys.argv), "records": records, "rows": table}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()

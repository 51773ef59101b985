"""Benchmark this project against PyTorch FSDP2, megatron-fsdp and Megatron-Core's wrappers in one command.

    python tools/bench/run.py --out results.json            # the full matrix (long: run on a quiet machine)
    python tools/bench/run.py --quick --workloads torch --ranks 2   # a tiny smoke run

Trains the same model for a fixed number of steps under each system and prints one table:
step time (median and spread after warm-up), tokens per second, the ratio against each
peer and the fraction of the floor (the unwrapped model on every rank, no collectives),
persistent and peak memory per rank, and bytes per collective kind per step
against the theoretical minimum; then the targets (docs/performance.md) with a verdict each. Systems
run round-robin (the starting system rotates every round) for several rounds, so slow
drift of the machine lands on every system alike. Each (workload, ranks) pair gets one
pool of gloo worker processes (``megatron/fsdp/testing/pool.py``) reused by every size, system
and round: ``import megatron.core`` costs seconds per process.

A system that crashes or hangs is reported as ``crashed (reason)`` in its row, never
dropped; a hang or a dead rank restarts the pool. docs/performance.md describes every
column and how the theory is computed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from typing import List, Optional

# Run as a script, the repository root is not on sys.path: this tool imports its own folder as tools.bench.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from megatron.fsdp.testing import RankError, WorkerTimeout  # noqa: E402
from tools.bench import plot, report  # noqa: E402
from tools.bench import mcore_case, nv_fsdp, torch_case  # noqa: E402
from tools.bench import measure as M  # noqa: E402
from tools.bench.spec import FP8_OPTIONS, NV_FSDP, SIZES, SYSTEMS, option_of, runs_at  # noqa: E402


os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


# What a failed run raises: an exception on a rank, a hang, a dead rank or a pool that did not start.
FAILURES = (RankError, WorkerTimeout, RuntimeError, OSError)
CASES = {"torch": torch_case.run, "mcore": mcore_case.run}
DEFAULT_PLOT = os.path.join(_ROOT, "docs", "performance.png")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    every = sorted({s for systems in SYSTEMS.values() for s in systems})
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", choices=sorted(SYSTEMS), default=["torch", "mcore"])
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4],
                   help="world sizes; 1 is the torch workload's overhead check (ours vs the unwrapped model, fp32)")
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=None,
                   help="default: 5M 50M (--quick: tiny); also root-heavy, deep-narrow, 200M (docs/performance.md)")
    p.add_argument("--systems", nargs="+", choices=every, default=every)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="bf16: bf16 compute, fp32 main weights and gradient reduction (world size 1 runs fp32); "
                        "default: bf16 where this machine computes it natively (AVX512-BF16, AMX, a CUDA GPU), "
                        "else fp32")
    p.add_argument("--rounds", type=int, default=None, help="round-robin rounds (default 3; --quick: 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per run (default 2; --quick: 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 5; --quick: 2)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores // ranks)")
    p.add_argument("--allocator", choices=ALLOCATORS, default="glibc",
                   help="glibc setting of the ranks: 'glibc' (its defaults), 'job' (as the training job sets it up, "
                        "megatron/fsdp_training/allocator.py: a fixed mmap threshold and the heap trimmed after each "
                        "unit's backward), 'threshold' (the job's threshold alone; torch workload)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take before it counts as a hang")
    p.add_argument("--quick", action="store_true", help="tiny model, one round, few steps: a smoke run")
    p.add_argument("--out", default=None, help="write every run, row and target as JSON here (rewritten after "
                                               "every run, so a killed benchmark keeps the runs it finished)")
    p.add_argument("--plot", default=None, help=f"PNG of the table (default {os.path.relpath(DEFAULT_PLOT)}; "
                                                "--quick: none); '' for none")
    p.add_argument("--from-json", default=None, help="re-report a saved --out file instead of running")
    args = p.parse_args(argv)
    if args.allocator == "threshold" and "mcore" in args.workloads:
        p.error("--allocator threshold (the job's threshold without its trim) is for --workloads torch: the mcore "
                "workload wraps as the job does, which trims whenever it sets the threshold")
    quick = args.quick
    args.sizes = args.sizes or (["tiny"] if quick else ["5M", "50M"])
    args.rounds = args.rounds or (1 if quick else 3)
    args.warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
    args.steps = args.steps or (2 if quick else 5)
    if args.plot is None:
        args.plot = "" if quick else DEFAULT_PLOT
    return args


def choose_dtype(args, log=print) -> None:
    """Default --dtype: bf16 only where it is native; say which and why."""
    if args.dtype is not None or args.from_json:
        return
    from tools.bench.bf16_support import native_bf16

    native, reason = native_bf16()
    args.dtype = "bf16" if native else "fp32"
    log(f"dtype: {args.dtype} ({reason}{'' if native else '; pass --dtype bf16 to measure the emulation anyway'})")


def plan(args) -> List[tuple]:
    """(workload, ranks, systems) in run order. World size 1: the torch workload, ours vs unwrapped."""
    out = []
    for workload in args.workloads:
        for ranks in args.ranks:
            if ranks == 1 and workload != "torch":
                continue
            systems = [s for s in SYSTEMS[workload] if s in args.systems and runs_at(s, ranks)]
            if systems:
                out.append((workload, ranks, systems))
    return out


ALLOCATORS = ("glibc", "job", "threshold")
BF16_REDUCE_NEEDS_BF16 = "--grad-reduce-in-bf16 needs bf16 compute (--dtype bf16)"
FP8_GATHER_NEEDS_BF16 = "FP8 parameter gathers replace bf16 gathers: they need bf16 compute (--dtype bf16)"


def not_runnable(system: str, dtype: str = "bf16") -> Optional[str]:
    """Why ``system`` cannot run here before trying (an optional package absent, or the job's
    ``--grad-reduce-in-bf16`` or an FP8 gather without bf16 compute, which they refuse), or None."""
    if system in NV_FSDP and not nv_fsdp.available():
        return nv_fsdp.NOT_INSTALLED
    if option_of(system) == "bf16_reduce" and dtype != "bf16":
        return BF16_REDUCE_NEEDS_BF16
    if option_of(system) in FP8_OPTIONS and dtype != "bf16":
        return FP8_GATHER_NEEDS_BF16
    return None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RankError):
        kind, message, _ = next(e for e in exc.errors if e is not None)
        first = (message.strip().splitlines() or [""])[0]
        return f"{kind}: {first[:160]}" if first else kind
    if isinstance(exc, WorkerTimeout):
        return str(exc)
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


class _Pool:
    """The gloo worker pool of one (workload, ranks) pair: started on first use, again after a crash.

    A fresh pool first runs one discarded tiny step of the system about to be measured, so
    imports and one-time library allocations do not land in the first measured run's time
    and peak memory (a failure there is left to the measured run to report).
    """

    def __init__(self, workload: str, ranks: int, dtype: str, threads: int, timeout: float,
                 allocator: str = "glibc"):
        self.case, self.ranks, self.timeout = CASES[workload], ranks, timeout
        worker = M.WorkerSetting(threads, job_allocator=allocator != "glibc",
                                 trim=False if allocator == "threshold" else None)
        self.settings = dict(bf16=dtype == "bf16", worker=worker)
        self.pool = None

    def _spawn(self):
        from megatron.fsdp.testing import WorkerPool

        return WorkerPool(self.ranks, start_timeout=600.0)

    def run(self, system: str, size: str, warmup: int, steps: int) -> List[dict]:
        from megatron.fsdp.testing import RankError

        if self.pool is None or not self.pool.alive:
            self.pool = self._spawn()
            try:
                self.pool.run(self.case, timeout=min(self.timeout, 300.0), system=system, size_name="tiny",
                              warmup=1, steps=1, **self.settings)
            except FAILURES:
                if not self.pool.alive:  # the warm-up hung: measure in a fresh pool all the same
                    self.pool = self._spawn()
        try:
            return self.pool.run(self.case, timeout=self.timeout, system=system, size_name=size, warmup=warmup,
                                 steps=steps, **self.settings)
        except RankError:
            self.close(kill=True)  # ranks may have collectives in flight: start clean
            raise

    def close(self, kill: bool = False) -> None:
        if self.pool is not None:
            self.pool.close(kill=kill)


def run_matrix(args, log=print, on_run=None) -> List[dict]:
    """Every run of the plan, as records ``report.aggregate`` reads; ``on_run(runs)`` after each one."""
    runs = []
    the_plan = plan(args)
    total = sum(len(systems) for _, _, systems in the_plan) * len(args.sizes) * args.rounds
    for workload, ranks, systems in the_plan:
        dtype = "fp32" if ranks == 1 else args.dtype
        pool = _Pool(workload, ranks, dtype, args.threads or max(1, (os.cpu_count() or 1) // ranks), args.timeout,
                     args.allocator)
        try:
            for size in args.sizes:
                for rnd in range(args.rounds):
                    for system in systems[rnd % len(systems):] + systems[:rnd % len(systems)]:
                        record = {"workload": workload, "ranks": ranks, "size": size, "system": system,
                                  "dtype": dtype, "round": rnd, "status": "ok", "reason": None}
                        where = (f"[{len(runs) + 1}/{total} {workload} {size} N={ranks} {dtype} "
                                 f"round {rnd + 1}/{args.rounds}] {system}")
                        missing = not_runnable(system, dtype)
                        if missing:
                            record.update(status="not runnable", reason=missing)
                            runs.append(record)
                            log(f"{where}: not runnable: {missing}")
                            if on_run is not None:
                                on_run(runs)
                            continue
                        log(f"{where}: running ({args.warmup} warm-up + {args.steps} timed steps)...")
                        start = time.perf_counter()
                        try:
                            record["per_rank"] = pool.run(system, size, args.warmup, args.steps)
                            steps = sorted(max(ts) for ts in zip(*(p["times"] for p in record["per_rank"])))
                            note = f"step {steps[len(steps) // 2] * 1e3:.1f} ms"
                        except FAILURES as exc:
                            record.update(status="crashed", reason=_reason(exc))
                            note = f"crashed ({record['reason']})"
                        runs.append(record)
                        log(f"{where}: {note} ({time.perf_counter() - start:.1f} s)")
                        if on_run is not None:
                            on_run(runs)
        finally:
            pool.close()
    return runs


def write_json(path: str, results: dict) -> None:
    """Write ``results`` whole or not at all (a temporary file renamed over ``path``)."""
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(temporary, path)


def meta(args) -> dict:
    import torch

    try:
        from megatron.fsdp.collectives import comm
        path = os.environ.get(comm.GLOO_REDUCE_SCATTER_ENV) or "ring"
    except (ImportError, AttributeError):
        path = "allreduce (no ring path in this checkout)"
    return {"command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]) if sys.argv else "",
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "python": platform.python_version(), "cpus": os.cpu_count(), "gloo_reduce_scatter": path,
            "quick": args.quick, "rounds": args.rounds, "warmup": args.warmup, "steps": args.steps, "dtype": args.dtype,
            "allocator": args.allocator, "sizes": {name: vars(SIZES[name]) for name in args.sizes}}


def main(argv: Optional[List[str]] = None) -> dict:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
        results["rows"] = report.aggregate(results["runs"])
        results["targets"] = report.targets(results["rows"])
    else:
        log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        choose_dtype(args, log)
        info = meta(args)

        def partial(runs):  # a killed benchmark keeps every run it finished
            if args.out:
                rows = report.aggregate(runs)
                write_json(args.out, {"meta": dict(info, complete=False), "runs": runs, "rows": rows,
                                      "targets": report.targets(rows)})
        runs = run_matrix(args, log=log, on_run=partial)
        rows = report.aggregate(runs)
        results = {"meta": dict(info, complete=True), "runs": runs, "rows": rows, "targets": report.targets(rows)}
    print(report.format_table(results["rows"]))
    print()
    print(report.format_targets(results["targets"]))
    if args.out:
        write_json(args.out, results)
    if args.plot:
        info = results.get("meta", {})
        title = f"{'SMOKE RUN (--quick): ' if info.get('quick') else ''}{info.get('command', '')} ({info.get('date', '')})"
        where = plot.plot(results["rows"], args.plot, title=title)
        print(f"plot: {where}" if where else plot.SKIPPED)
    return results


if __name__ == "__main__":
    main()

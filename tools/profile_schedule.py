"""Profile the FSDP schedule: a Chrome trace per rank and a per-unit timeline of the collectives.

    python tools/profile_schedule.py --ranks 4 --level optim_grads_params --outer optim_grads_params \\
        --size 5M --train-iters 4 --profile-step-start 2 --profile-step-end 3 --out /tmp/fsdp_profile

Trains the benchmark model (``tools/bench``'s ``TinyTransformer``, blocks as units) for
``--train-iters`` steps in a gloo pool of ``--ranks`` CPU processes (or on the GPUs of the
pool's ranks when CUDA is there), and records steps ``[--profile-step-start,
--profile-step-end)`` (Megatron-LM's ``--profile-step-start/--profile-step-end``, steps
counted from 0) twice over:

* ``torch.profiler`` writes ``trace_rank<r>.json`` (open it in chrome://tracing or
  Perfetto): every gather, reduction, install and wait is a range named
  ``fsdp.<kind> <unit>`` (NVTX ranges of the same names on CUDA);
* the engine's timeline (``megatron.fsdp.collectives.profiling``) gives the printed table: for each
  unit and each of its collectives, when it was issued, when it had landed, how long the
  compute thread waited for it, which later stages of a multi-stage collective the schedule
  issued at a later compute boundary, and which were only issued inside the final wait
  (with ``reductions_in_flight=0``; see docs/mesh.md "What overlaps").

"Landed" is what the process can observe without polling: ``<= t`` when the collective
had already completed when its wait began at ``t`` (compute did not wait), else the time
the wait returned.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Dict, List, Optional


if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LEVELS = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="processes (gloo on CPU); 4 or 6 for a 2-axis mesh")
    p.add_argument("--level", choices=LEVELS, default="optim_grads_params", help="inner (dp_shard) level")
    p.add_argument("--outer", choices=LEVELS, default=None,
                   help="outer (dp_outer) level: a mesh of --ranks/--outer-size x --outer-size")
    p.add_argument("--outer-size", type=int, default=2, help="ranks on the outer axis when --outer is given")
    p.add_argument("--size", choices=("tiny", "5M", "50M"), default="tiny", help="benchmark model size")
    p.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 main weights and reduction")
    p.add_argument("--train-iters", type=int, default=4)
    p.add_argument("--profile-step-start", type=int, default=2)
    p.add_argument("--profile-step-end", type=int, default=3)
    p.add_argument("--profile-ranks", type=int, nargs="+", default=[0], help="ranks whose timeline is printed")
    p.add_argument("--forward-prefetch", type=int, default=1)
    p.add_argument("--backward-prefetch", type=int, default=1)
    p.add_argument("--reductions-in-flight", type=int, default=2)
    p.add_argument("--out", default="fsdp_profile", help="directory for the Chrome traces")
    args = p.parse_args(argv)
    if not 0 <= args.profile_step_start < args.profile_step_end <= args.train_iters:
        p.error(f"need 0 <= --profile-step-start < --profile-step-end <= --train-iters, got "
                f"{args.profile_step_start}, {args.profile_step_end}, {args.train_iters}")
    if args.outer is not None and args.ranks % args.outer_size:
        p.error(f"--outer-size {args.outer_size} does not divide --ranks {args.ranks}")
    if args.outer is not None and (args.ranks // args.outer_size, args.outer_size) not in ((2, 2), (3, 2), (2, 3)):
        p.error("two-axis meshes available: 2 x 2 (--ranks 4), 3 x 2 and 2 x 3 (--ranks 6)")
    return args


# ------------------------------------------------------------------ worker side
@dataclasses.dataclass(frozen=True)
class ProfiledSteps:
    """Train ``train_iters`` steps, profile steps [``start``, ``end``), write the traces under ``out``."""

    train_iters: int
    start: int
    end: int
    out: str


def profile_case(ctx, model_size: str, level: str, outer: Optional[str], mesh, bf16: bool, overlap: dict,
                 steps: ProfiledSteps) -> dict:
    """Pool case: train, profile ``steps``, write this rank's trace, return its timeline."""
    train_iters, start, end, out = steps.train_iters, steps.start, steps.end, steps.out
    import torch

    import megatron.fsdp as mfsdp
    from megatron.fsdp.collectives import profiling
    from tools.bench.spec import SIZES
    from tools.bench.torch_case import SEED, build_model

    torch.set_num_threads(1)
    model = build_model(model_size)
    from examples.tiny_transformer import Block

    mp = mfsdp.MixedPrecision(param_dtype=torch.bfloat16, main_dtype=torch.float32,
                              grad_reduce_dtype=torch.float32) if bf16 else None
    where = dict(mesh=ctx.meshes[mesh], outer_strategy=outer) if mesh else dict(mesh=ctx.group)
    fsdp = mfsdp.fully_shard(model, strategy=level, unit_modules=(Block,), mixed_precision=mp, **where,
                             overlap=mfsdp.Overlap(**overlap))
    optimizer = mfsdp.FullyShardedOptimizer(fsdp, torch.optim.AdamW, lr=1e-4, clip_grad=1.0)
    shape = SIZES[model_size]
    gen = torch.Generator().manual_seed(SEED + ctx.rank)
    tokens = torch.randint(0, shape.vocab, (shape.rows, shape.seq + 1), generator=gen)

    def step():
        fsdp(tokens).backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(start):
        step()
    torch.distributed.barrier(ctx.group)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof, profiling.recording() as timeline:
        for k in range(start, end):
            timeline.add("step", "begin", f"step {k}")
            step()
            timeline.add("step", "end", f"step {k}")
    for _ in range(end, train_iters):
        step()
    os.makedirs(out, exist_ok=True)
    trace = os.path.join(out, f"trace_rank{ctx.rank}.json")
    prof.export_chrome_trace(trace)
    events = [(e.t, e.event, e.kind, e.unit, e.axis, e.collective, e.done, e.nbytes) for e in timeline.events]
    return {"trace": trace, "events": events, "units": [u.name for u in fsdp.units], "levels": str(fsdp.levels)}


# ------------------------------------------------------------------ parent side
ISSUE_KINDS = ("all_gather", "reduce", "install")


def per_unit_rows(events: List[tuple]) -> List[Dict[str, object]]:
    """Pair every issue range with the wait that consumed it; one row per (unit, collective)."""
    rows: List[Dict[str, object]] = []
    open_ops: Dict[tuple, Dict[str, object]] = {}  # (unit, kind) -> the row waiting for its wait
    phase = "forward"
    current = None  # the range a collective row belongs to
    stage_begin, stage_done = 0.0, True  # the open "stage." range: when it began, whether its stage had landed
    for t, event, kind, unit, axis, collective, done, nbytes in events:
        if event == "backward" and kind == "begin":
            phase = "backward"
        elif event == "step" and kind == "begin":
            phase = "forward"
        elif event == "begin" and kind in ISSUE_KINDS:
            row = {"unit": unit, "op": kind, "phase": "step" if kind == "install" else phase, "issued": t,
                   "landed": None, "wait_begin": None, "waited": None, "axes": [], "staged": [], "in_wait": [],
                   "done": None}
            rows.append(row)
            open_ops[(unit, "all_gather" if kind == "install" else kind)] = row
            current = (row, "axes")
        elif event == "begin" and kind.startswith("stage."):
            # The schedule advancing a multi-stage collective at a unit's compute end: waits for
            # the stage in flight, then issues the next one (docs/mesh.md "What overlaps").
            row = open_ops.get((unit, "all_gather" if kind == "stage.install" else kind[len("stage."):]))
            current = None if row is None else (row, "staged")
            stage_begin, stage_done = t, done
        elif event == "end" and kind.startswith("stage."):
            if current is not None and not stage_done:
                current[0]["waited"] = (current[0]["waited"] or 0.0) + t - stage_begin
            current = None
        elif event == "begin" and kind.startswith("wait."):
            key = (unit, "all_gather" if kind == "wait.install" else kind[len("wait."):])
            row = open_ops.pop(key, None)
            if row is not None:
                row.update(wait_begin=t, done=done)
                current = (row, "in_wait")
            else:
                current = None
        elif event == "end" and kind.startswith("wait."):
            if current is not None and current[1] == "in_wait":
                row = current[0]
                row["waited"] = (row["waited"] or 0.0) + t - row["wait_begin"]
                row["landed"] = row["wait_begin"] if row["done"] else t
            current = None
        elif event == "end" and kind in ISSUE_KINDS:
            current = None
        elif event == "issue" and current is not None:
            current[0][current[1]].append(f"{collective}/{axis}")
    return rows


def format_timeline(rows: List[Dict[str, object]], rank: int) -> str:
    ms = lambda v: "-" if v is None else f"{1e3 * v:9.2f}"  # noqa: E731
    header = (f"{'unit':<14} {'op':<10} {'phase':<8} {'issued ms':>9} {'landed ms':>11} {'waited ms':>9}  "
              "issued with it | issued at a later compute end | issued only inside the wait")
    lines = [f"per-unit schedule, rank {rank} (times from the start of the profiled steps)", header,
             "-" * len(header)]
    for row in sorted(rows, key=lambda r: (r["unit"] != "<root>", r["unit"], r["issued"])):
        landed = "-" if row["landed"] is None else (("<=" if row["done"] else "  ") + ms(row["landed"]))
        lines.append(f"{row['unit']:<14} {row['op']:<10} {row['phase']:<8} {ms(row['issued'])} {landed:>11} "
                     f"{ms(row['waited'])}  {' '.join(row['axes']) or '-'} | {' '.join(row['staged']) or '-'} | "
                     f"{' '.join(row['in_wait']) or '-'}")
    waited = sum(r["waited"] or 0.0 for r in rows)
    lines.append(f"compute waited {1e3 * waited:.2f} ms in total for {sum(1 for r in rows if r['waited'])} "
                 f"collectives; {sum(1 for r in rows if r['done'])} had landed before they were needed")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> List[str]:
    args = parse_args(argv)
    from megatron.fsdp.testing import WorkerPool

    mesh = (args.ranks // args.outer_size, args.outer_size) if args.outer else None
    overlap = dict(forward_prefetch=args.forward_prefetch, backward_prefetch=args.backward_prefetch,
                   reductions_in_flight=args.reductions_in_flight)
    # The value travels to the workers pickled by its class's module name: the importable one, also when
    # this file runs as a script (``__main__``).
    from tools import profile_schedule as importable

    pool = WorkerPool(args.ranks, start_timeout=600.0)
    try:
        results = pool.run(profile_case, timeout=1800, model_size=args.size, level=args.level,
                           outer=args.outer, mesh=mesh, bf16=args.bf16, overlap=overlap,
                           steps=importable.ProfiledSteps(args.train_iters, args.profile_step_start, args.profile_step_end,
                                               os.path.abspath(args.out)))
    finally:
        pool.close()
    print(f"levels {results[0]['levels']} on {args.ranks} ranks, model {args.size}, steps "
          f"[{args.profile_step_start}, {args.profile_step_end}) profiled; Chrome traces: "
          + ", ".join(r["trace"] for r in results))
    tables = []
    for rank in args.profile_ranks:
        tables.append(format_timeline(per_unit_rows(results[rank]["events"]), rank))
        print(tables[-1])
    return tables


if __name__ == "__main__":
    main()

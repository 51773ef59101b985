"""Where in a step the resident peak is: RSS high-water marks between unit boundaries, per system.

    python tools/bench/memory_phases.py --ranks 2 --size 70M            # FSDP2 and ours, side by side
    python tools/bench/memory_phases.py --ranks 2 --size 5M --systems ours:optim_grads_params

``tools/bench/memory.py`` says how high a step's peak is; this says when it happens. The
same torch workload (``torch_case``), instrumented alike for every system without touching
either's hooks: the begin and end of each block's forward (module hooks), the begin of its
backward (a hook on the gradient of its output) and the end (a hook on the gradient of its
input), and the step's own phases (loss, backward, optimizer step, zero grad). At each
boundary a rank reads its resident set's high-water mark since the previous boundary
(``VmHWM``, then reset through ``/proc/self/clear_refs``), so every interval's peak is
attributed to the interval it happened in. Figures are above the resident set before the
model was built, largest rank.

The ranks set glibc up as the training job does (``--allocator default``:
``megatron/fsdp_training/allocator.py``: a fixed mmap threshold, and the heap trimmed after each
unit's backward), so the resident set follows the live tensors and the profile shows what
the step needs rather than what glibc kept (``--allocator threshold``: the threshold alone;
``--allocator glibc``: glibc's own defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from tools.bench.spec import FLOOR, PEAK_TARGET  # noqa: E402

MIB = 2 ** 20


class _Phases:
    """Boundary marks: (name, high-water mark since the previous mark, resident set now), in bytes."""

    def __init__(self, base_rss: int):
        from tools.bench import measure as M
        self._m = M
        self.base = base_rss
        self.rows: List[tuple] = []
        M.reset_peak_rss()

    def mark(self, name: str) -> None:
        hwm, rss = self._m.peak_rss_bytes(), self._m.rss_bytes()
        self.rows.append((name, hwm - self.base, rss - self.base))
        self._m.reset_peak_rss()


def _instrument(model, phases: _Phases) -> None:
    import torch

    def grad_hook(name):
        def hook(grad):
            phases.mark(name)
        return hook

    for k, block in enumerate(model.blocks):
        def pre(module, args, k=k):
            phases.mark(f"fwd> {k}")
            x = args[0]
            if torch.is_grad_enabled() and x.requires_grad:
                x.register_hook(grad_hook(f"bwd< {k}"))

        def post(module, args, output, k=k):
            phases.mark(f"fwd< {k}")
            if torch.is_grad_enabled() and output.requires_grad:
                output.register_hook(grad_hook(f"bwd> {k}"))
        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)


def case(ctx, system: str, size_name: str, warmup: int, worker) -> dict:
    """Worker-pool case: ``warmup`` steps, then one step with a mark at every boundary (``worker``: a
    ``measure.WorkerSetting``)."""
    import torch
    import torch.distributed as dist

    from tools.bench import measure as M
    from tools.bench import torch_case as T
    from tools.bench.spec import SIZES

    worker.apply()
    shape = SIZES[size_name]
    gen = torch.Generator().manual_seed(T.SEED + dist.get_rank())
    tokens = torch.randint(0, shape.vocab, (shape.rows, shape.seq + 1), generator=gen)
    _, base_rss = M.baselines()
    model = T.build_model(size_name)
    root, *blocks = T.unit_params(model)
    sizes = {"params": sum(p.numel() for p in model.parameters()), "root_params": root, "largest_unit": max(blocks)}
    built = T.build_system(system, model, tokens, bf16=True, trim=worker.trims)
    for _ in range(warmup):
        built.step()
    M.trim_heap()
    dist.barrier()
    phases = _Phases(base_rss)
    _instrument(model, phases)
    optimizer = built.optimizer
    step_fn, zero_fn = optimizer.step, optimizer.zero_grad

    def step(*a, **kw):
        phases.mark("backward end / clip")
        out = step_fn(*a, **kw)
        phases.mark("optimizer step")
        return out

    def zero(*a, **kw):
        out = zero_fn(*a, **kw)
        phases.mark("zero grad")
        return out
    optimizer.step, optimizer.zero_grad = step, zero
    phases.mark("start")
    built.step()
    phases.mark("end")
    optimizer.step, optimizer.zero_grad = step_fn, zero_fn
    del built, model
    M.trim_heap()
    return {"rows": phases.rows, **sizes}


def merge(per_rank: List[dict]) -> List[tuple]:
    """One row per boundary: the largest rank's high-water mark and resident set."""
    rows = []
    for marks in zip(*(r["rows"] for r in per_rank)):
        rows.append((marks[0][0], max(m[1] for m in marks), max(m[2] for m in marks)))
    return rows


def activation_peak(rows: List[tuple]) -> int:
    """Bytes a step adds above its start until the backward reaches the last block: the forward's
    activations, the loss and the head's backward (the first ``bwd>`` mark), whatever the system."""
    start = next(row[2] for row in rows if row[0] == "start")
    first_backward = next(i for i, row in enumerate(rows) if row[0].startswith("bwd>"))
    return max(row[1] for row in rows[:first_backward + 1]) - start


def zero3_bound(floor_rows: List[tuple], sizes: dict, world: int) -> Dict[str, float]:
    """The least any ZeRO-3 must hold at the start of this model's backward, in bytes.

    Its persistent state (``spec.theory_persistent``: 12 bytes per parameter over the ranks,
    bf16 compute, fp32 main weights and Adam), what the model itself adds to reach the start
    of the backward (measured on the floor, the unwrapped model with no communication: its
    activations, the loss and the head's backward), and the weights the backward starts
    with gathered in bf16: the root unit (embeddings and tied head, gathered from the
    forward through the backward in FSDP2 and here) and the last block. Prefetching, staging
    and allocator slack come on top. A peak target below this bound cannot be met by the
    sharding; only a smaller model footprint (activation recomputation, a chunked loss) or
    smaller state (bf16 moments, ``OptimizerPrecision``) gets under it.
    """
    from tools.bench.spec import theory_persistent

    persistent = theory_persistent("ours:optim_grads_params", sizes["params"], world, 2)
    model = activation_peak(floor_rows)
    gathered = 2.0 * (sizes["root_params"] + sizes["largest_unit"])
    return {"persistent": persistent, "model": float(model), "gathered": gathered,
            "bound": persistent + model + gathered}


def format_bound(bound: Dict[str, float], peaks: Dict[str, float]) -> str:
    lines = [f"ZeRO-3 lower bound at the start of the backward: persistent {bound['persistent'] / MIB:.1f} + "
             f"the model's activations and loss (floor) {bound['model'] / MIB:.1f} + gathered root and last block "
             f"{bound['gathered'] / MIB:.1f} = {bound['bound'] / MIB:.1f} MiB"]
    fsdp2 = peaks.get("fsdp2")
    for name, peak in peaks.items():
        if name != FLOOR:
            lines.append(f"  {name}: peak {peak / MIB:.1f} MiB, {peak / bound['bound']:.3f}x the bound")
    if fsdp2:
        target = PEAK_TARGET * fsdp2
        lines.append(f"  {PEAK_TARGET}x FSDP2 = {target / MIB:.1f} MiB: {target / bound['bound']:.3f}x the bound")
    return "\n".join(lines)


def format_profile(profiles: Dict[str, List[tuple]]) -> str:
    """Boundaries in the order of the first system; a boundary another system lacks shows '-'."""
    names = list(profiles)
    head = f"{'boundary':<22}" + "".join(f" | {n[:22]:>22} hwm    rss" for n in names)
    lines = [head, "-" * len(head)]
    order = [row[0] for row in profiles[names[0]]]
    order += [row[0] for n in names[1:] for row in profiles[n] if row[0] not in order]
    by_name = {n: {row[0]: row for row in profiles[n]} for n in names}
    for boundary in order:
        cells = []
        for n in names:
            row = by_name[n].get(boundary)
            cells.append(f" | {'-':>29}" if row is None else f" | {row[1] / MIB:>22.1f} {row[2] / MIB:>6.1f}")
        lines.append(f"{boundary:<22}" + "".join(cells))
    lines.append(f"{'step peak':<22}" + "".join(f" | {max(r[1] for r in profiles[n]) / MIB:>22.1f} {'':>6}"
                                                  for n in names))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--size", default="70M")
    p.add_argument("--systems", nargs="+", default=["fsdp2", "ours:optim_grads_params"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default=None, help="JSON of the profiles")
    p.add_argument("--allocator", choices=("default", "threshold", "glibc"), default="default",
                   help="'default': as the training job sets glibc up (its fixed mmap threshold, and the heap "
                        "trimmed after each unit's backward); 'threshold': the threshold without the trim; "
                        "'glibc': glibc's defaults")
    p.add_argument("--upcast-bf16", choices=("auto", "yes", "no"), default="auto",
                   help="bf16 linears and attention through fp32 kernels (bf16_support.upcast_bf16_kernels); "
                        "auto: where bf16 is emulated (as memory.py)")
    args = p.parse_args(argv)
    from megatron.fsdp.testing import WorkerPool
    from tools.bench.bf16_support import native_bf16

    upcast = args.upcast_bf16 == "yes" or (args.upcast_bf16 == "auto" and not native_bf16()[0])

    from tools.bench.measure import WorkerSetting

    worker = WorkerSetting(max(1, (os.cpu_count() or 1) // args.ranks), upcast_bf16=upcast,
                           job_allocator=args.allocator in ("default", "threshold"), trim=args.allocator == "default")
    pool = WorkerPool(args.ranks, start_timeout=900.0)
    profiles = {}
    target = case
    try:
        for system in args.systems:  # one discarded tiny run each: imports and one-time allocations
            pool.run(target, timeout=600.0, system=system, size_name="tiny", warmup=1, worker=worker)
        for system in args.systems:
            per_rank = pool.run(target, timeout=3600.0, system=system, size_name=args.size, warmup=args.warmup,
                                worker=worker)
            profiles[system] = merge(per_rank)
            sizes = {k: per_rank[0][k] for k in ("params", "root_params", "largest_unit")}
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(profiles, f)
            print(f"{system}: step peak {max(r[1] for r in profiles[system]) / MIB:.1f} MiB", file=sys.stderr,
                  flush=True)
    finally:
        pool.close()
    print(f"{args.size}, {args.ranks} ranks, allocator {args.allocator}, bf16 kernels "
          f"{'fp32 (--upcast-bf16)' if upcast else 'native'}, MiB above the resident set before the model was built "
          f"(hwm: peak since the previous boundary; rss: at the boundary)")
    print(format_profile(profiles))
    if FLOOR in profiles:
        bound = zero3_bound(profiles[FLOOR], sizes, args.ranks)
        print(format_bound(bound, {n: max(r[1] for r in rows) for n, rows in profiles.items()}))
    return profiles


if __name__ == "__main__":
    main()

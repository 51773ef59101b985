"""Pool cases for the schedule's overlap: prefetch depth, reductions in flight, the timeline, profiler ranges.

A stack of plain layers (no nesting, every parameter gets a gradient) makes the order
of forward and backward ends unambiguous: unit k's backward ends before unit k-1's
begins, so "issued before unit k-1's backward ends" is a statement about the schedule,
not about autograd's order of independent nodes.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

import megatron.fsdp as mfsdp
from megatron.fsdp.collectives import profiling
from megatron.fsdp.testing.engine_training import GLOBAL_MICRO_BATCH, RunConfig, train_step, wrap
from megatron.fsdp.testing.models import make_batches


HIDDEN = 24


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + F.gelu(self.linear(x))


class Stack(torch.nn.Module):
    """Root: an input projection and a head; units: ``layers.0`` .. ``layers.{n-1}``."""

    def __init__(self, layers: int = 4):
        super().__init__()
        self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(layers))
        self.head = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


def _stack(ctx, mesh, inner: str, outer: Optional[str], **overlap):
    torch.manual_seed(0)
    where = dict(mesh=ctx.meshes[mesh], outer_strategy=outer) if mesh else dict(process_group=ctx.group)
    fsdp = mfsdp.fully_shard(Stack(), strategy=inner, unit_modules=(Layer,), **where, **overlap)
    return fsdp, mfsdp.FullyShardedOptimizer(fsdp, torch.optim.AdamW, lr=1e-3)


def _train(ctx, fsdp, opt, steps: int, record_last: bool = True):
    """``steps`` steps of one micro-batch; the last one recorded into a timeline."""
    gen = torch.Generator().manual_seed(1)
    timeline = None
    for step in range(steps):
        x = torch.randn(4 * ctx.size, HIDDEN, generator=gen)
        x = x[ctx.rank * 4:(ctx.rank + 1) * 4]
        if record_last and step == steps - 1:
            with profiling.recording() as timeline:
                fsdp(x).backward()
                opt.step()
        else:
            fsdp(x).backward()
            opt.step()
        opt.zero_grad()
    return timeline


def _rows(timeline) -> List[Tuple[str, str, str, str, str, bool]]:
    return [(e.event, e.kind, e.unit, e.axis, e.collective, e.done) for e in timeline.events]


def prefetch_stats(ctx, configs: List[Tuple[int, dict]]) -> List[Dict[str, object]]:
    """TinyLM at ZeRO-3, per (steps, fully_shard overlap arguments): how each gather of the last step
    was satisfied, and the most units holding full weights at any forward hook."""
    out = []
    for steps, overlap in configs:
        cfg = RunConfig(strategy="optim_grads_params", micro_batches=1, steps=steps)
        fsdp, opt = wrap(ctx, cfg, **overlap)
        peak = [0]

        def observe(*_args, fsdp=fsdp):
            peak[0] = max(peak[0], sum(u.storage.resident for u in fsdp.units))

        for m in fsdp.module.modules():
            m.register_forward_pre_hook(lambda *a: observe())
            m.register_forward_hook(lambda *a: observe())
        batches = make_batches(cfg.steps, 1, GLOBAL_MICRO_BATCH)
        for i, step in enumerate(batches):
            if i == len(batches) - 1:
                for phase in fsdp.gather_stats.values():
                    phase.update(dict.fromkeys(phase, 0))
            train_step(ctx, fsdp, opt, step, cfg)
        out.append({"gather_stats": fsdp.gather_stats, "units": [u.name for u in fsdp.units],
                    "peak": peak[0], "overlap": fsdp.overlap})
    return out


def schedule_timelines(ctx, configs: List[Tuple[str, Optional[str], int]]):
    """The timeline of the second step of ``Stack`` on the 2 x 2 mesh, per (inner, outer, reductions in flight)."""
    out = []
    for inner, outer, in_flight in configs:
        fsdp, opt = _stack(ctx, (2, 2), inner, outer, overlap=mfsdp.Overlap(reductions_in_flight=in_flight))
        out.append({"rows": _rows(_train(ctx, fsdp, opt, steps=2)), "units": [u.name for u in fsdp.units]})
    return out


def profiler_ranges(ctx) -> Dict[str, object]:
    """A ZeRO-3 step under ``torch.profiler``: the names of the ranges it recorded; a step without one."""
    fsdp, opt = _stack(ctx, None, "optim_grads_params", None)
    _train(ctx, fsdp, opt, steps=1, record_last=False)
    idle = type(profiling.span("all_gather", "x")).__name__  # nothing active: the shared no-op
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _train(ctx, fsdp, opt, steps=1, record_last=False)
    names = sorted({e.name for e in prof.events() if e.name.startswith("fsdp.")})
    return {"names": names, "idle_range": idle}


def held_without_backward(ctx, extra_forwards: bool) -> Dict[str, object]:
    """TinyLM at ZeRO-3, two steps; with ``extra_forwards``, between them a forward with autograd on and
    no backward, then one under ``no_grad``: which units hold full weights after each, and the weights
    after the second step (the extra forwards must change nothing)."""
    from megatron.fsdp.testing.engine_training import local_slice

    cfg = RunConfig(strategy="optim_grads_params", micro_batches=1, steps=2)
    fsdp, opt = wrap(ctx, cfg)
    batches = make_batches(cfg.steps, 1, GLOBAL_MICRO_BATCH)

    def resident():
        return [u.name for u in fsdp.units if u.storage.resident]

    train_step(ctx, fsdp, opt, batches[0], cfg)
    out: Dict[str, object] = {}
    if extra_forwards:
        tokens, targets = (local_slice(ctx, t) for t in batches[1][0])
        fsdp(tokens, targets)  # its graph is dropped: the backward it prepared for never comes
        out["after_forward"] = resident()
        with torch.no_grad():
            fsdp(tokens, targets)
        out["after_no_grad_forward"] = resident()
        for phase in fsdp.gather_stats.values():
            phase.update(dict.fromkeys(phase, 0))
    train_step(ctx, fsdp, opt, batches[1], cfg)
    out["after_step"] = resident()
    out["gather_stats"] = fsdp.gather_stats
    out["params"] = fsdp.full_state_dict()
    return out

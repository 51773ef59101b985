"""What overlaps what, proven from the schedule's timeline (ledger issues + runtime events), not timing.

* prefetch: the first forward prefetches from the registration order, the first backward from
  the order in which the forward's units ended; ``forward_prefetch`` / ``backward_prefetch``
  set how many units ahead, and memory grows with them;
* reductions in flight: never more than ``reductions_in_flight`` reductions issued and not waited;
* on a 2 x 2 mesh, every stage of a two-stage collective runs ahead of the wait for it: the
  second stage of unit k+1's gather is issued before unit k's forward ends, the outer reduction
  of unit k before unit k-1's backward ends (``comm.StagedHandle``, advanced at each unit's
  compute end, see docs/mesh.md "What overlaps"), in the same order on every rank;
* no stage is issued inside a wait, the first unit of each pass and the last reductions
  included: the forward's first stages advance at the root's pre-forward (so they land during
  the root's compute), the backward's first unit is still gathered from its forward (its
  forward ended last) and the next one's second stage is issued at the end of its backward
  compute, and the last reductions' second stages are all issued at the end of the backward
  before the first of them is waited;
* every collective a unit issues runs inside a profiler range named by kind and unit.

The cases train a stack of plain layers (no nesting, every parameter gets a gradient), which makes
the order of forward and backward ends unambiguous: unit k's backward ends before unit k-1's
begins, so "issued before unit k-1's backward ends" is a statement about the schedule, not about
autograd's order of independent nodes.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import pytest
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
    where = dict(mesh=ctx.meshes[mesh], outer_strategy=outer) if mesh else dict(mesh=ctx.group)
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


ZERO3 = "optim_grads_params"


def test_prefetch_depths_first_pass_and_memory(pool):
    configs = [(1, {}), (1, dict(overlap=mfsdp.Overlap(forward_prefetch=0, backward_prefetch=0))),
               (2, dict(overlap=mfsdp.Overlap(forward_prefetch=2, backward_prefetch=2)))]
    default, none, deep = pool.run(prefetch_stats, size=2, configs=configs)[0]
    non_root = len(default["units"]) - 1
    assert default["overlap"] == mfsdp.Overlap(forward_prefetch=1, backward_prefetch=1, reductions_in_flight=None)
    for phase in ("forward", "backward"):
        # First pass: the forward plan is the registration order, the backward plan the reversed forward
        # ends, and no unit is held from its forward into its backward (no pass has shown the order yet).
        assert default["gather_stats"][phase] == {"prefetched": non_root, "on_demand": 0, "held": 0}, (phase, default)
        assert none["gather_stats"][phase] == {"prefetched": 0, "on_demand": non_root, "held": 0}, (phase, none)
        # Second pass: the unit whose forward ended last in the first stays gathered for the backward.
        held = 1 if phase == "backward" else 0
        assert deep["gather_stats"][phase] == {"prefetched": non_root - held, "on_demand": 0, "held": held}, (phase, deep)
    # Root + a block + its nested MLP + one prefetched unit; one fewer without prefetch, one more at depth 2.
    assert (none["peak"], default["peak"], deep["peak"]) == (3, 4, 5), (none, default, deep)


def test_unit_held_for_a_backward_that_never_comes_is_released(pool):
    """The unit the backward starts with stays gathered after its forward; if no backward follows, the
    next forward releases it first and gathers it as usual, a ``no_grad`` forward holds nothing, and
    the training that follows is bitwise the one without those forwards."""
    plain, extra = pool.run(held_without_backward, size=2, extra_forwards=False)[0], \
        pool.run(held_without_backward, size=2, extra_forwards=True)[0]
    assert extra["after_forward"] == ["<root>", "blocks.1"], extra
    assert extra["after_no_grad_forward"] == [], extra
    assert plain["after_step"] == extra["after_step"] == [], (plain, extra)
    held = {"forward": 0, "backward": 1}
    for phase in ("forward", "backward"):
        assert extra["gather_stats"][phase]["held"] == held[phase], extra["gather_stats"]
        assert extra["gather_stats"][phase]["on_demand"] == 0, extra["gather_stats"]
    assert plain["params"].keys() == extra["params"].keys()
    for name, tensor in plain["params"].items():
        assert torch.equal(tensor, extra["params"][name]), name


def _pos(rows, event, kind, unit, axis=None, collective=None, nth=0):
    hits = [i for i, r in enumerate(rows) if r[:3] == (event, kind, unit)
            and axis in (None, r[3]) and collective in (None, r[4])]
    assert len(hits) > nth, (event, kind, unit, axis, collective, nth)
    return hits[nth]


def _issue(rows, unit, axis, collective, nth=0):
    """Position of the ``nth`` collective ``unit`` issued on ``axis``, and the range it was issued in."""
    hits = [i for i, r in enumerate(rows) if r[0] == "issue" and r[2] == unit and r[3] == axis and r[4] == collective]
    assert len(hits) > nth, (unit, axis, collective, nth)
    return hits[nth], rows[hits[nth]][1]


def _order(rows, event):
    return [r[2] for r in rows if r[0] == event and r[1] == "begin" and r[2] != "<root>"]


def _in_flight_at_backward_ends(rows):
    issued = waited = 0
    seen = []
    for event, kind, *_ in rows:
        if event == "end" and kind == "reduce":
            issued += 1
        elif event == "begin" and kind == "wait.reduce":
            waited += 1
        elif event == "backward" and kind == "end":
            seen.append(issued - waited)
    return seen


def _issues(rows):
    return [(r[2], r[3], r[4]) for r in rows if r[0] == "issue"]


def test_two_stage_collectives_on_a_2x2_mesh(pool):
    configs = [(ZERO3, ZERO3, 2), (ZERO3, ZERO3, 0), (ZERO3, "no_shard", 2), (ZERO3, "optim", 2)]
    ranks = pool.run(schedule_timelines, size=4, configs=configs)
    full, eager, hsdp, hfsdp = ranks[0]
    for k, run in enumerate(ranks[0]):
        # The same collectives in the same order on every rank (so on every group): stages are
        # advanced at hook points, never on timing.
        for other in ranks[1:]:
            assert _issues(other[k]["rows"]) == _issues(run["rows"]), (configs[k], "issue order differs")

    for run, in_flight in ((full, 2), (eager, 0), (hsdp, 2), (hfsdp, 2)):
        rows = run["rows"]
        # Every collective of a unit is issued inside a named range (the grad norm is the optimizer's).
        assert all(r[1] for r in rows if r[0] == "issue" and r[2] != "grad_norm"), [r for r in rows if not r[1]]
        assert max(_in_flight_at_backward_ends(rows)) == in_flight
        if in_flight:
            # With reductions in flight, no collective at all is issued inside a wait: every stage
            # after the first is issued at a compute boundary (a stage.* range), the first unit of
            # each pass and the last reductions of the backward included.
            inside_waits = [r for r in rows if r[0] == "issue" and r[1].startswith("wait.")]
            assert not inside_waits, inside_waits

    rows = full["rows"]
    forward, backward = _order(rows, "forward"), _order(rows, "backward")
    assert forward == ["layers.0", "layers.1", "layers.2", "layers.3"] and backward == forward[::-1]
    for u, v in zip(forward, forward[1:]):
        # First stage (outer all-gather) of unit k+1: issued by unit k's pre-forward (prefetch).
        first, where = _issue(rows, v, "dp_outer", "all_gather")
        assert where == "all_gather" and first < _pos(rows, "forward", "end", u)
        # Second stage (inner all-gather): issued at the end of unit k's compute, before its forward ends.
        second, where = _issue(rows, v, "dp_shard", "all_gather")
        assert where == "stage.all_gather" and first < second < _pos(rows, "forward", "end", u), (u, v)
    for k, j in zip(backward, backward[1:]):
        # First stage (inner reduce-scatter) of unit k: issued before unit k-1's backward begins.
        first, where = _issue(rows, k, "dp_shard", "reduce_scatter")
        assert where == "reduce" and first < _pos(rows, "backward", "begin", j)
        # Second stage (outer reduce-scatter): issued before unit k-1's backward ends, while its wait
        # (two reductions in flight) comes only at the end of unit k-2's.
        second, where = _issue(rows, k, "dp_outer", "reduce_scatter")
        assert where == "stage.reduce" and _pos(rows, "backward", "begin", j) < second < _pos(
            rows, "backward", "end", j), (k, j)

    # The first unit of the forward: the root waits for its own two-stage gather in its pre-forward,
    # so both its second stage and that of the first prefetched unit are issued there, before the
    # root's compute begins; layers.0's inner all-gather lands during the root's compute.
    root_compute = _pos(rows, "forward", "begin", "<root>")
    for unit in ("<root>", forward[0]):
        first, _ = _issue(rows, unit, "dp_outer", "all_gather")
        second, where = _issue(rows, unit, "dp_shard", "all_gather")
        assert where == "stage.all_gather" and first < second < root_compute, (unit, where)
    assert _pos(rows, "begin", "wait.all_gather", forward[0]) > root_compute
    # The first unit of the backward is the one whose forward ended last: it stays gathered from its
    # forward into its backward (one gather per axis in the step). The next unit's first stage is
    # issued by that unit's pre-backward (the prefetch), its second at the end of that unit's backward
    # compute (nth=1: each unit's second gather of the step is its backward's).
    last, before_last = backward[0], backward[1]
    for axis in ("dp_outer", "dp_shard"):
        gathers = [r for r in rows if r[0] == "issue" and r[2] == last and r[3] == axis and r[4] == "all_gather"]
        assert len(gathers) == 1, (last, axis, gathers)
    prefetch, where = _issue(rows, before_last, "dp_outer", "all_gather", nth=1)
    assert where == "all_gather"
    second, where = _issue(rows, before_last, "dp_shard", "all_gather", nth=1)
    assert where == "stage.all_gather"
    assert _pos(rows, "backward", "begin", "<root>") < prefetch < _pos(rows, "backward", "begin", last) < second < _pos(
        rows, "backward", "end", last), (prefetch, second)
    # The last reductions: the root's (its parameters' gradients arrive last) and layers.0's outer
    # reduce-scatters are issued before the end of the backward waits for either of them; the
    # root's, with no compute left, at the end of the backward itself.
    root_outer, where = _issue(rows, "<root>", "dp_outer", "reduce_scatter")
    assert where == "stage.reduce" and _pos(rows, "backward", "end", "<root>") < root_outer
    first_wait = min(_pos(rows, "begin", "wait.reduce", u) for u in ("<root>", backward[-1]))
    assert root_outer < first_wait and _issue(rows, backward[-1], "dp_outer", "reduce_scatter")[0] < first_wait

    # No reduction in flight: the outer stage of unit k runs before unit k-1's backward begins,
    # at the price of waiting for the inner stage right there.
    rows = eager["rows"]
    for k, j in zip(backward, backward[1:]):
        second, where = _issue(rows, k, "dp_outer", "reduce_scatter")
        assert where == "wait.reduce" and second < _pos(rows, "backward", "begin", j)

    # HSDP and HFSDP: one-stage gathers run fully ahead; the outer all-reduce (HSDP) or
    # reduce-scatter (HFSDP) of unit k is issued before unit k-1's backward ends.
    for run, outer in ((hsdp, "all_reduce"), (hfsdp, "reduce_scatter")):
        rows = run["rows"]
        for u, v in zip(forward, forward[1:]):
            gather, where = _issue(rows, v, "dp_shard", "all_gather")
            assert where == "all_gather" and gather < _pos(rows, "forward", "end", u)
        for k, j in zip(backward, backward[1:]):
            second, where = _issue(rows, k, "dp_outer", outer)
            assert where == "stage.reduce" and _pos(rows, "backward", "begin", j) < second < _pos(
                rows, "backward", "end", j), (outer, k, j)


def test_profiler_ranges_name_every_kind_and_unit(pool):
    result = pool.run(profiler_ranges, size=2)[0]
    units = ["<root>"] + [f"layers.{k}" for k in range(4)]
    kinds = ["all_gather", "wait.all_gather", "reduce", "wait.reduce", "install", "wait.install"]
    assert set(result["names"]) == {f"fsdp.{kind} {unit}" for kind in kinds for unit in units}
    assert result["idle_range"] == "_Null"  # no profiler, no timeline: the shared no-op range


@pytest.mark.parametrize("kwargs", [dict(forward_prefetch=-1), dict(reductions_in_flight=1.5),
                                    dict(backward_prefetch=True)])
def test_overlap_arguments_are_checked(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"{name} must be an integer >= 0"):
        mfsdp.fully_shard(torch.nn.Linear(2, 2), overlap=mfsdp.Overlap(**kwargs))


def test_megatron_communication_unit_size_maps_to_units():
    """Megatron-FSDP: ``S`` elements of reduce-scatter queue, ``S // 2`` of all-gather prefetch (default: 2 units)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.fsdp.mcore.overlap import overlap_arguments

    model = torch.nn.Sequential(*[torch.nn.Linear(10, 10) for _ in range(3)])  # 110 elements per unit

    def mapped(size):
        return overlap_arguments(DistributedDataParallelConfig(suggested_communication_unit_size=size), model,
                                 (torch.nn.Linear,))

    assert mapped(None) == {}  # the engine's defaults
    assert mapped(220) == dict(forward_prefetch=1, backward_prefetch=1, reductions_in_flight=2)
    assert mapped(1000) == dict(forward_prefetch=4, backward_prefetch=4, reductions_in_flight=9)
    assert mapped(100) == dict(forward_prefetch=0, backward_prefetch=0, reductions_in_flight=0)  # under a unit
    assert mfsdp.Overlap(**mapped(1000)).forward_prefetch == 4

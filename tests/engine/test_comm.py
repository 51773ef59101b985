"""The gloo ring reduce-scatter: exact sums, the bytes it sends, and no hangs with other collectives in flight.

``CommAxis`` reduce-scatters on gloo with a ring of point-to-point messages; the
native call (an all-reduce inside gloo) stays reachable with
``gloo_reduce_scatter="allreduce"``. Each case builds both on the same group and
compares them, and compares both with the float64 sum each rank can compute by
regenerating every rank's input.
"""

import random
import time

import pytest
import torch

from megatron.fsdp.collectives.comm import Ledger
from megatron.fsdp.collectives import gloo_ring
from megatron.fsdp.collectives.comm import GLOO_REDUCE_SCATTER_ENV, CommAxis


TIMEOUT = 120
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8}


# ------------------------------------------------------------------ cases (run inside the pool)
def _group(ctx, where):
    """``"first"``: ranks 0..size-1; ``"inner:2x3"``/``"outer:3x2"``: that axis of a pool mesh."""
    if where == "first":
        return ctx.group
    axis, shape = where.split(":")
    n, m = (int(v) for v in shape.split("x"))
    return getattr(ctx.meshes[(n, m)], f"{axis}_group")


def _full(rank, size, numel, dtype, integer, seed):
    """Rank ``rank``'s input; any rank can rebuild it, so each rank knows the exact sum."""
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    if integer:  # small integers: every partial sum is exact in fp32 and bf16, in any order
        return torch.randint(-16, 17, (numel * size,), generator=gen).to(dtype)
    return torch.randn(numel * size, generator=gen).to(dtype)


def _exact(rank, size, numel, dtype, integer, seed):
    """Float64 sum over ranks of this rank's slice, and the sum of absolute values (the error scale)."""
    parts = [_full(r, size, numel, dtype, integer, seed)[rank * numel:(rank + 1) * numel].double()
             for r in range(size)]
    return sum(parts), sum(p.abs() for p in parts)


def exactness(ctx, where, numels, dtype, integer, seed=0):
    """Ring and native reduce-scatter of the same inputs; errors against float64, and the ledger."""
    group = _group(ctx, where)
    dtype = getattr(torch, dtype)
    ledger = Ledger()
    ring = CommAxis("ring", group, ledger, gloo_reduce_scatter="ring")
    native = CommAxis("native", group, ledger, gloo_reduce_scatter="allreduce")
    out = {"size": ring.size, "path": ring.gloo_reduce_scatter, "cases": []}
    for numel in numels:
        full = _full(ring.rank, ring.size, numel, dtype, integer, seed + numel)
        before = full.clone()
        got_ring = torch.full((numel,), float("nan"), dtype=dtype)
        got_native = torch.full((numel,), float("nan"), dtype=dtype)
        ring.reduce_scatter(got_ring, full).wait()
        native.reduce_scatter(got_native, full).wait()
        exact, scale = _exact(ring.rank, ring.size, numel, dtype, integer, seed + numel)
        out["cases"].append({
            "numel": numel,
            "input_untouched": torch.equal(full, before),
            "ring_excess": _excess(got_ring, exact, scale, ring.size, dtype),
            "native_excess": _excess(got_native, exact, scale, ring.size, dtype),
            "ring_vs_native_excess": _excess(got_ring, got_native.double(), scale, 2 * ring.size, dtype),
            "ring_equals_native": torch.equal(got_ring, got_native),
            "ring_equals_exact": torch.equal(got_ring.double(), exact),
            "nbytes": full.numel() * full.element_size(),
        })
    out["ledger"] = {name: (ledger.calls("reduce_scatter", name), ledger.bytes("reduce_scatter", name),
                            ledger.wire_bytes("reduce_scatter", name)) for name in ("ring", "native")}
    return out


def _excess(got, exact, scale, terms, dtype):
    """How far ``got`` is past the rounding bound ``terms * u * sum|x|`` (<= 0: within it)."""
    if got.numel() == 0:
        return 0.0
    bound = terms * UNIT_ROUNDOFF[str(dtype).split(".")[1]] * scale
    return (got.double() - exact).abs().sub(bound).max().item()


def in_flight(ctx, wheres, seed):
    """Reduce-scatters (ring and native) and all-gathers in flight on several axes, waited in a per-rank order.

    Two ring axes share one group (two models over one mesh share its tags). Every
    rank issues the same sequence; each rank waits in its own random order, so a
    ring that needed the others' waits, or tags that cross-matched, would hang or
    sum the wrong chunks.
    """
    ledger = Ledger()
    axes = []
    for where in wheres:
        group = _group(ctx, where)
        axes += [CommAxis(where, group, ledger), CommAxis(where + "/b", group, ledger),
                 CommAxis(where + "/native", group, ledger, gloo_reduce_scatter="allreduce")]
    pending, checks = [], []
    for i in range(4):
        for j, axis in enumerate(axes):
            k = seed * 100 + i * 10 + j
            numel = 1000 + 37 * k % 500
            full = _full(axis.rank, axis.size, numel, torch.float32, True, k)
            out = torch.empty(numel)
            pending.append(axis.reduce_scatter(out, full))
            exact, _ = _exact(axis.rank, axis.size, numel, torch.float32, True, k)
            checks.append((out, exact.float()))
            shard = torch.full((numel,), float(axis.rank + i))
            gathered = torch.empty(numel * axis.size)
            pending.append(axis.all_gather(gathered, shard))
            checks.append((gathered, torch.arange(axis.size, dtype=torch.float32).add(i).repeat_interleave(numel)))
    order = list(range(len(pending)))
    random.Random(seed * 31 + ctx.rank).shuffle(order)
    for index in order:
        pending[index].wait()
    return [torch.equal(got, want) for got, want in checks]


def returns_before_peers_arrive(ctx, delay):
    """The last rank starts its reduce-scatter ``delay`` seconds late; the others must not block in the call."""
    import torch.distributed as dist

    axis = CommAxis("ring", ctx.group, Ledger())
    out = torch.empty(1 << 16)
    full = torch.ones(out.numel() * axis.size)
    dist.barrier(group=ctx.group)
    if axis.rank == axis.size - 1:
        time.sleep(delay)
    start = time.perf_counter()
    handle = axis.reduce_scatter(out, full)
    issued = time.perf_counter() - start
    handle.wait()
    return {"issue_s": issued, "total_ok": bool((out == axis.size).all())}


def widening(ctx, numels):
    """bf16 inputs reduced into fp32 outputs: the ring widens as it goes, the native path first.

    Both must give, bit for bit, the reduction of the fp32-widened input; the ledger counts
    fp32 bytes; and the ring drops its input when it has landed, before anyone waits.
    """
    import gc
    import weakref

    ledger = Ledger()
    ring = CommAxis("ring", ctx.group, ledger, gloo_reduce_scatter="ring")
    native = CommAxis("native", ctx.group, ledger, gloo_reduce_scatter="allreduce")
    out = {"equal": [], "released_before_wait": []}
    for numel in numels:
        full = _full(ring.rank, ring.size, numel, torch.bfloat16, False, numel)
        widened = full.float()
        want, want_native = torch.empty(numel), torch.empty(numel)  # each path's own order of additions
        ring.reduce_scatter(want, widened).wait()
        native.reduce_scatter(want_native, widened).wait()
        got_ring, got_native = torch.empty(numel), torch.empty(numel)
        src = full.clone()
        src_ref = weakref.ref(src)
        handle = ring.reduce_scatter(got_ring, src)
        del src  # the ring now holds the only reference
        native.reduce_scatter(got_native, full).wait()
        while not handle.is_completed():  # it lands without being waited
            time.sleep(0.01)
        gc.collect()
        out["released_before_wait"].append(src_ref() is None)
        handle.wait()
        out["equal"].append(torch.equal(got_ring, want) and torch.equal(got_native, want_native))
    out["ledger"] = {name: ledger.bytes("reduce_scatter", name) for name in ("ring", "native")}
    return out


def env_selects_path(ctx, value):
    import os

    os.environ[GLOO_REDUCE_SCATTER_ENV] = value
    try:
        return CommAxis("x", ctx.group, Ledger()).gloo_reduce_scatter
    finally:
        del os.environ[GLOO_REDUCE_SCATTER_ENV]


def bad_sizes(ctx):
    """A reduce-scatter whose sizes do not match raises on every rank, before anything is sent."""
    axis = CommAxis("ring", ctx.group, Ledger())
    try:
        axis.reduce_scatter(torch.empty(3), torch.empty(3 * axis.size + 1))
    except ValueError as exc:
        return str(exc)
    return None


def engine_both_paths(ctx, cfg):
    """Train the same model with the ring and with the native path; count the rings the engine started."""
    import os

    from megatron.fsdp.collectives import comm
    from megatron.fsdp.testing.engine_training import sharded_run

    started = []
    ring = comm.ring_reduce_scatter

    def counted(*args):
        started.append(args[0].numel())
        return ring(*args)

    out = {}
    comm.ring_reduce_scatter = counted
    try:
        for path in ("ring", "allreduce"):
            os.environ[GLOO_REDUCE_SCATTER_ENV] = path
            result = sharded_run(ctx, cfg)
            out[path] = {**result, "rings": len(started)}
            started.clear()
    finally:
        comm.ring_reduce_scatter = ring
        del os.environ[GLOO_REDUCE_SCATTER_ENV]
    return out


# ------------------------------------------------------------------ tests
SIZES = [2, 3, 4, 5, 6]
NUMELS = [0, 1, 7, 4096, 100_003]


@pytest.mark.parametrize("size", SIZES)
def test_fp32_ring_within_rounding_of_the_exact_sum(pool, size):
    for rank, result in enumerate(pool.run(exactness, size=size, timeout=TIMEOUT, where="first",
                                           numels=NUMELS, dtype="float32", integer=False)):
        assert result["path"] == "ring" and result["size"] == size
        for case in result["cases"]:
            assert case["input_untouched"], (rank, case)
            assert case["ring_excess"] <= 0 and case["native_excess"] <= 0, (rank, case)
            assert case["ring_vs_native_excess"] <= 0, (rank, case)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("size", [2, 3, 4, 6])
def test_integer_valued_sums_are_bitwise_exact(pool, size, dtype):
    for rank, result in enumerate(pool.run(exactness, size=size, timeout=TIMEOUT, where="first",
                                           numels=NUMELS, dtype=dtype, integer=True)):
        for case in result["cases"]:
            assert case["ring_equals_exact"] and case["ring_equals_native"], (rank, case)


@pytest.mark.parametrize("size", [2, 4, 6])
def test_bf16_ring_within_rounding(pool, size):
    for rank, result in enumerate(pool.run(exactness, size=size, timeout=TIMEOUT, where="first",
                                           numels=NUMELS, dtype="bfloat16", integer=False)):
        for case in result["cases"]:
            assert case["ring_excess"] <= 0 and case["native_excess"] <= 0, (rank, case)


@pytest.mark.parametrize("where", ["inner:2x3", "outer:2x3", "inner:3x2", "outer:3x2"])
def test_subgroups_of_a_mesh(pool, where):
    """Disjoint groups run their rings at the same time; ring ranks are group ranks, not global ranks."""
    for rank, result in enumerate(pool.run(exactness, size=6, timeout=TIMEOUT, where=where,
                                           numels=[0, 5, 3001], dtype="float32", integer=True)):
        for case in result["cases"]:
            assert case["ring_equals_exact"] and case["ring_equals_native"], (rank, where, case)


@pytest.mark.parametrize("size", [2, 4, 6])
def test_ledger_wire_bytes_ring_half_of_native(pool, size):
    result = pool.run(exactness, size=size, timeout=TIMEOUT, where="first", numels=NUMELS,
                      dtype="float32", integer=True)[0]
    total = sum(case["nbytes"] for case in result["cases"])
    ring_wire = sum(case["nbytes"] // size * (size - 1) for case in result["cases"])
    assert result["ledger"]["ring"] == (len(NUMELS), total, ring_wire)
    assert result["ledger"]["native"] == (len(NUMELS), total, 2 * ring_wire)


@pytest.mark.parametrize("wheres, size", [
    (["first"], 2), (["first"], 3), (["first"], 4), (["first"], 6),
    (["inner:2x3", "outer:2x3", "first"], 6),
    (["outer:3x2", "inner:3x2"], 6),
])
def test_concurrent_collectives_waited_in_per_rank_orders(pool, wheres, size):
    for seed in range(2):
        for rank, ok in enumerate(pool.run(in_flight, size=size, timeout=TIMEOUT, wheres=wheres,
                                           seed=seed)):
            assert all(ok), (rank, seed, [i for i, v in enumerate(ok) if not v])


def test_call_returns_before_peers_arrive(pool):
    results = pool.run(returns_before_peers_arrive, size=3, timeout=TIMEOUT, delay=2.0)
    assert all(r["total_ok"] for r in results)
    assert max(r["issue_s"] for r in results[:-1]) < 1.0, results


@pytest.mark.parametrize("size", [2, 3, 4])
def test_narrower_input_widened_bitwise_and_released_when_the_ring_lands(pool, size):
    numels = [0, 1, 7, 100_003]
    for rank, result in enumerate(pool.run(widening, size=size, timeout=TIMEOUT, numels=numels)):
        assert all(result["equal"]), (rank, result)
        assert all(result["released_before_wait"]), (rank, result)
        fp32_bytes = 4 * size * sum(numels)
        assert result["ledger"] == {"ring": 2 * fp32_bytes, "native": 2 * fp32_bytes}, (rank, result)


@pytest.mark.parametrize("value", ["ring", "allreduce"])
def test_environment_selects_the_path(pool, value):
    assert pool.run(env_selects_path, size=2, timeout=TIMEOUT, value=value) == [value, value]


def test_mismatched_sizes_raise_on_every_rank(pool):
    for message in pool.run(bad_sizes, size=3, timeout=TIMEOUT):
        assert message is not None and "full.numel() == 3 * output.numel()" in message


def test_unknown_path_is_rejected(monkeypatch):
    monkeypatch.setenv(GLOO_REDUCE_SCATTER_ENV, "tree")
    with pytest.raises(ValueError, match="expected one of"):
        CommAxis("x", None, Ledger())


def test_ring_error_reaches_the_waiter():
    def fail():
        raise RuntimeError("peer gone")

    class Group:  # any weak-referenceable key stands for a process group here
        pass

    group = Group()
    work = gloo_ring.submit(group, fail)
    with pytest.raises(RuntimeError, match="peer gone"):
        work.wait()
    assert work.is_completed() and work.wait()  # raised once, then done


def _ring_threads() -> int:
    """Ring worker threads still alive in this process (they are named ``mfsdp-gloo-ring-<k>``)."""
    import threading
    return sum(1 for t in threading.enumerate() if t.name.startswith("mfsdp-gloo-ring-"))


def test_one_long_lived_worker_per_group_not_a_thread_per_call():
    """Many rings on one group run on one thread (no new thread, so no new malloc arena, per call)."""
    import threading

    class Group:
        pass

    group, names = Group(), []
    before = threading.active_count()
    works = [gloo_ring.submit(group, lambda: names.append(threading.current_thread().name)) for _ in range(50)]
    for work in works:
        work.wait()
    assert len(set(names)) == 1 and threading.active_count() <= before + 1
    assert gloo_ring.shutdown_workers(timeout=10) and _ring_threads() == 0
    # a ring issued after shutdown gets a fresh worker, and shutdown finishes issued rings first
    slow = gloo_ring.submit(group, lambda: time.sleep(0.2))
    assert gloo_ring.shutdown_workers(timeout=10) and slow.is_completed()


@pytest.mark.parametrize("size, overrides", [
    (3, dict(strategy="optim_grads_params", micro_batches=2)),
    (4, dict(strategy="optim_grads_params", outer_strategy="optim_grads_params", mesh=(2, 2), micro_batches=2)),
    (6, dict(strategy="optim_grads", outer_strategy="optim", mesh=(3, 2), bf16=True)),
], ids=["zero3-flat", "zero3-2x2", "zero2-hfsdp-3x2-bf16"])
def test_engine_trains_the_same_on_both_paths(pool, size, overrides):
    from megatron.fsdp.testing.engine_training import RunConfig

    cfg = RunConfig(steps=3, **overrides)
    result = pool.run(engine_both_paths, size=size, timeout=TIMEOUT, cfg=cfg)[0]
    ring, native = result["ring"], result["allreduce"]
    assert ring["rings"] > 0 and native["rings"] == 0
    rtol = 1e-2 if cfg.bf16 else 1e-5
    for a, b in zip(ring["losses"] + ring["grad_norms"], native["losses"] + native["grad_norms"]):
        assert abs(a - b) <= rtol * abs(b), (ring["losses"], native["losses"])
    for name, value in native["params"].items():
        assert torch.allclose(ring["params"][name].float(), value.float(), rtol=rtol, atol=rtol), name

"""Meta-device initialisation: the sharded weights equal an eager build's, bitwise, with less memory.

The matrix (every level x world sizes 1-4 x flat and 2 x 2 meshes x dense and expert
sections) is sampled: each pool call checks several configurations on one world size,
and every level appears on every topology somewhere.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

import megatron.fsdp as mfsdp
from megatron.fsdp.sharding.strategy import STRATEGIES
from megatron.fsdp.testing.engine_training import GLOBAL_MICRO_BATCH, OPTIMIZERS, RunConfig, train_step
from megatron.fsdp.testing.models import MLP, ResetBlock, make_batches
from megatron.fsdp_training.testing.pools import pool_of
from tests.cases.engine_shared import ResetLM


SEED = 5
Config = Tuple[str, Optional[str], bool]  # (inner level, outer level or None for a flat mesh, experts)


def _is_expert(name: str, _param) -> bool:
    return ".mlp.up." in name


def _build(ctx, cfg: Config, meta: bool, model_kwargs: Optional[dict] = None, **extra):
    level, outer, experts = cfg
    torch.manual_seed(SEED)
    if meta:
        with torch.device("meta"):
            module = ResetLM(**(model_kwargs or {}))
    else:
        module = ResetLM(**(model_kwargs or {}))
    where = dict(mesh=ctx.meshes[(2, 2)], outer_strategy=outer) if outer else dict(mesh=ctx.group)
    if experts:  # experts at ZeRO-3, on the dense mesh (their outer axis replicated)
        mesh = ctx.meshes[(2, 2)] if outer else mfsdp.DataParallelMesh(ctx.group)
        where["experts"] = mfsdp.ExpertSharding(_is_expert, mesh, "optim_grads_params", "no_shard" if outer else None)
    return mfsdp.fully_shard(module, strategy=level, unit_modules=(ResetBlock, MLP), **where, **extra)


def _storage_tensors(fsdp) -> Dict[str, torch.Tensor]:
    """Every tensor of this rank's persistent state, by a readable name."""
    out = {}
    for unit in fsdp.units:
        s = unit.storage
        out[f"{unit.name}.main"] = s.main
        if s.shard is not None:
            out[f"{unit.name}.shard"] = s.shard
        if s.resident:
            out[f"{unit.name}.full"] = s.full
    for name, buf in fsdp.module.named_buffers():
        out[f"buffer {name}"] = buf
    return out


def _differences(eager, meta) -> List[str]:
    for fsdp in (eager, meta):
        fsdp.wait_weights()  # the gathers that install the last step's weights
    a, b = _storage_tensors(eager), _storage_tensors(meta)
    if list(a) != list(b):
        return [f"different state: {list(a)} vs {list(b)}"]
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    bad += [f"requires_grad of {n}" for (n, p), (_, q) in zip(eager.module.named_parameters(),
                                                                 meta.module.named_parameters())
            if p.requires_grad != q.requires_grad]
    return bad


def _train(ctx, fsdp, steps: int = 2) -> List[float]:
    cls, kwargs = OPTIMIZERS["adamw"]
    opt = mfsdp.FullyShardedOptimizer(fsdp, cls, clip_grad=1.0, **kwargs)
    return [train_step(ctx, fsdp, opt, step, RunConfig())[0] for step in make_batches(steps, 1, GLOBAL_MICRO_BATCH)]


def meta_matches_eager(ctx, configs: List[Config], train: Optional[Config] = None) -> Dict[str, object]:
    """Bitwise comparison of every rank's shards for each config; optionally train both builds."""
    result: Dict[str, object] = {"differences": {}, "checked": 0, "tied": None}
    for cfg in configs:
        eager, meta = _build(ctx, cfg, meta=False), _build(ctx, cfg, meta=True)
        result["differences"][str(cfg)] = _differences(eager, meta)
        result["checked"] += len(_storage_tensors(meta))
        result["tied"] = meta.module.head.weight is meta.module.embed.weight
        if cfg == train:
            result["losses"] = (_train(ctx, eager), _train(ctx, meta))
            result["after_training"] = _differences(eager, meta)
    return result


def _persistent_bytes(fsdp) -> int:
    """This rank's persistent state after the build: its storages (``memory_report``) and the buffers."""
    return fsdp.memory_report().total + sum(b.untyped_storage().nbytes() for b in fsdp.module.buffers())


def build_peak(ctx, configs: List[Config], layers: int = 8, hidden: int = 512, vocab: int = 4096) -> Dict[str, object]:
    """Resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) above the start of
    each meta build, and the resident set right after it, with glibc's defaults; one eager build last
    (the instrument must see the whole model there). Before each build the heap is trimmed: what earlier
    builds freed would otherwise be resident already, and a build reusing it would look free."""
    from tools.bench.measure import peak_rss_bytes, reset_peak_rss, rss_bytes, trim_heap

    kwargs = dict(vocab=vocab, hidden=hidden, layers=layers, heads=4)
    for meta in (False, True):  # warm-up: the first meta build loads torch's meta kernels (~30 MiB of code)
        _build(ctx, configs[0], meta=meta)
    out: Dict[str, object] = {}
    for cfg, meta in [(c, True) for c in configs] + [(configs[0], False)]:
        trim_heap()  # gc.collect(), then glibc's malloc_trim(0)
        dist.barrier(group=ctx.group)
        start = rss_bytes()
        assert reset_peak_rss(), "/proc/self/clear_refs is not writable: VmHWM cannot be reset"
        fsdp = _build(ctx, cfg, meta=meta, model_kwargs=kwargs)
        peak, after = peak_rss_bytes() - start, rss_bytes() - start
        units = [4 * u.storage.layout.padded_size for u in fsdp.units]
        out[str(cfg) + ("" if meta else " eager")] = dict(
            peak=peak, after=after, persistent=_persistent_bytes(fsdp), largest_unit=max(units), model=sum(units))
        report = fsdp.memory_report()  # without the optimizer: its state is not counted, and it says so
        out["report_repr"] = repr(report)
        del fsdp
    return out


class _NoInit(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("table", torch.zeros(3))


class _ForgetsBuffer(_NoInit):
    def reset_parameters(self):
        pass


def meta_error(ctx, case: str) -> Optional[str]:
    """The message a bad meta build raises on this rank (None if nothing was raised)."""
    with torch.device("meta"):
        module = _ForgetsBuffer() if case == "buffer_not_set" else _NoInit()
    extra = {}
    if case == "init_raises":
        def init_weights(m):
            if isinstance(m, torch.nn.Linear):
                raise KeyError("no rule for Linear")
            if isinstance(m, _NoInit):
                m.table.zero_()
        extra["meta_init"] = mfsdp.MetaInit(init_weights=init_weights)
    try:
        mfsdp.fully_shard(module, mesh=ctx.group, **extra)
    except (ValueError, RuntimeError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


LEVELS = list(STRATEGIES)

# world size -> configurations (inner level, outer level on the 2 x 2 mesh or None, experts)
MATRIX = {
    1: [(lvl, None, False) for lvl in LEVELS],
    2: [(lvl, None, lvl in ("optim", "optim_grads_params")) for lvl in LEVELS],
    3: [(lvl, None, lvl in ("no_shard", "optim_grads")) for lvl in LEVELS],
    4: [(lvl, None, True) for lvl in LEVELS]
       + [("optim_grads_params", "no_shard", False), ("optim_grads_params", "optim", True),
          ("optim_grads_params", "optim_grads_params", False), ("optim_grads", "optim", False),
          ("optim", "optim", True), ("no_shard", "no_shard", True)],
}


@pytest.mark.parametrize("world_size", sorted(MATRIX))
def test_meta_build_equals_eager_bitwise(pool, world_size):
    train = MATRIX[world_size][-1 if world_size == 4 else world_size - 1]
    results = pool.run(meta_matches_eager, size=world_size, timeout=180,
                       configs=MATRIX[world_size], train=train)
    for rank, result in enumerate(results):
        assert result["checked"] > 0 and result["tied"], result
        bad = {cfg: diff for cfg, diff in result["differences"].items() if diff}
        assert not bad, f"rank {rank}: meta build differs from eager: {bad}"
        eager_losses, meta_losses = result["losses"]
        assert eager_losses == meta_losses, f"rank {rank}: training after a meta build diverged"
        assert not result["after_training"], result["after_training"]


# every level, flat and on the 2 x 2 mesh, with and without an expert section
PEAK_CONFIGS = [("optim_grads_params", None, False), ("no_shard", None, False), ("optim", None, True),
                ("optim_grads", None, False), ("optim_grads_params", "optim_grads_params", False),
                ("optim_grads_params", "no_shard", True)]


def test_meta_build_peak_memory_is_bounded():
    """With glibc's defaults (no allocator setting, no environment variable), on 4 ranks: a meta build's
    resident peak is at most this rank's persistent state after the build plus the largest unit in fp32
    (+5%), and what stays resident is the persistent state (+5%); the eager build holds the whole model.

    On fresh workers of its own: the heap that hundreds of earlier cases fragmented is not the build's."""
    for rank, r in enumerate(pool_of(4, "build-peak").run(build_peak, size=4, timeout=180, configs=PEAK_CONFIGS)):
        eager = r.pop(str(PEAK_CONFIGS[0]) + " eager")
        assert eager["peak"] >= eager["model"], eager  # the instrument sees the full model in the eager build
        assert r.pop("report_repr").endswith("optimizer_state=0) (optimizer_state is 0: no optimizer was passed; "
                                             "memory_report(optimizer) counts its state)")
        for cfg, m in r.items():
            bound = 1.05 * (m["persistent"] + m["largest_unit"])
            assert m["peak"] <= bound, f"rank {rank} {cfg}: meta build peak {m['peak'] / 2**20:.1f} MiB > " \
                                       f"{bound / 2**20:.1f} MiB (persistent + largest unit, +5%): {m}"
            assert m["after"] <= 1.05 * m["persistent"], \
                f"rank {rank} {cfg}: {m['after'] / 2**20:.1f} MiB resident after the build, persistent " \
                f"{m['persistent'] / 2**20:.1f} MiB: {m}"


@pytest.mark.parametrize("case, pattern", [
    ("buffer_without_init", r"ValueError: buffer 'table' is on the meta device and _NoInit has no "
                            r"reset_parameters\(\).*init_weights=fn"),
    ("buffer_not_set", r"ValueError: buffer 'table' of <root> \(_ForgetsBuffer\) was on the meta device and "
                       r"_ForgetsBuffer.reset_parameters\(\) did not set it"),
    ("init_raises", r"RuntimeError: meta-device initialisation of linear \(Linear\) failed in init_weights: "
                    r"KeyError: 'no rule for Linear'"),
])
def test_meta_errors_before_any_collective(pool, case, pattern):
    messages = pool.run(meta_error, size=3, timeout=60, case=case)
    for message in messages:
        assert message is not None, f"{case}: nothing was raised"
        assert __import__("re").search(pattern, message), message

"""What several engine test modules share: the unsharded reference and the parity and memory checks
(pytest side); the worker-side cases more than one of them runs (``gather_schedule``,
``forgotten_no_sync``); ``ResetLM``, the model test_meta_init and test_fp8_gather build on the meta
device. A case only one test module runs lives in that module."""

import collections
import functools

import torch
import torch.nn.functional as F
from torch import nn

from megatron.fsdp.testing.common import rel
from megatron.fsdp.testing.engine_training import (GLOBAL_MICRO_BATCH, RunConfig, local_slice, reference_run, sharded_run,
                                                   train_step, wrap)
from megatron.fsdp.testing.models import ResetBlock, make_batches


FP32_RTOL = 1e-5


@functools.lru_cache(maxsize=None)
def reference(cfg: RunConfig):
    return reference_run(cfg)


def assert_parity(result, ref, rtol, param_atol):
    for name in ("losses", "grad_norms"):
        errs = [rel(a, b) for a, b in zip(result[name], ref[name])]
        assert len(result[name]) == len(ref[name])
        assert max(errs) <= rtol, f"{name}: {result[name]} vs reference {ref[name]} (max rel err {max(errs):.2e})"
    assert_params_close(result["params"], ref["params"], param_atol)


def assert_params_close(params, ref_params, param_atol):
    """Every reference parameter, within ``param_atol`` of the largest of its magnitude and 1."""
    assert set(ref_params) <= set(params)
    for name, expected in ref_params.items():
        got = params[name].to(expected.dtype)
        assert got.shape == expected.shape, name
        err = (got - expected).abs().max().item()
        assert err <= param_atol * max(1.0, expected.abs().max().item()), f"{name}: max abs err {err:.2e}"


def run(pool, cfg: RunConfig, world_size: int):
    results = pool.run(sharded_run, size=world_size, cfg=cfg)
    for r in results[1:]:  # every rank saw the same losses and norms
        assert r["losses"] == results[0]["losses"] and r["grad_norms"] == results[0]["grad_norms"]
    return results[0]


def assert_memory_matches_theory(results) -> None:
    """Every kind within 1% of the formula, in the step and between steps (gradients released
    by ``zero_grad``); no gradient memory from the build until the first backward."""
    for rank, result in enumerate(results):
        assert result["grads_at_build"] == 0, (rank, result["grads_at_build"])
        for when in ("", "_in_step"):
            report, theory = result["report" + when], result["theory" + when]
            for kind, expected in theory.items():
                got = report[kind]
                if expected == 0:
                    assert got == 0, (rank, when, kind, report)
                else:
                    assert abs(got / expected - 1) < 0.01, \
                        f"rank {rank}{when} {kind}: {got} bytes vs theory {expected:.0f}"


# Worker-side cases (run in the pool, which imports this module by name).

def gather_schedule(ctx, micro_batches: int, recompute: bool, steps: int = 2):
    """ZeRO-3: all-gathers per unit tag, per micro-batch of the last step; prefetch statistics."""
    cfg = RunConfig(strategy="optim_grads_params", micro_batches=micro_batches, recompute=recompute, steps=steps)
    fsdp, opt = wrap(ctx, cfg)
    fsdp.ledger.trace = True
    per_micro_batch = []

    def snapshot(_k):
        counts = collections.Counter(e.tag for e in fsdp.ledger.events if e.kind == "all_gather")
        per_micro_batch.append(dict(counts))
        fsdp.ledger.reset()

    batches = make_batches(cfg.steps, cfg.micro_batches, GLOBAL_MICRO_BATCH)
    for i, step in enumerate(batches):
        if i == len(batches) - 1:
            fsdp.ledger.reset()
            for phase in fsdp.gather_stats.values():
                phase.update(dict.fromkeys(phase, 0))
            train_step(ctx, fsdp, opt, step, cfg, after_micro_batch=snapshot)
        else:
            train_step(ctx, fsdp, opt, step, cfg)
    resident = [u.name for u in fsdp.units if u.storage.resident or u.storage.full.untyped_storage().nbytes()]
    transient_grads = [u.name for u in fsdp.units if u.storage.grad_full is not None]
    return {
        "per_micro_batch": per_micro_batch,
        "units": [u.name for u in fsdp.units],
        "gather_stats": fsdp.gather_stats,
        "resident_after_step": resident,
        "transient_grads_after_step": transient_grads,
    }


def forgotten_no_sync(ctx, strategy: str, mesh=None, outer_strategy=None):
    """Every micro-batch inside no_sync: optimizer.step() still reduces the gradients."""
    cfg = RunConfig(strategy=strategy, micro_batches=2, steps=3, mesh=mesh, outer_strategy=outer_strategy)
    fsdp, opt = wrap(ctx, cfg)
    losses, norms = [], []
    for step in make_batches(cfg.steps, cfg.micro_batches, GLOBAL_MICRO_BATCH):
        total = torch.zeros(1, dtype=torch.float64)
        with fsdp.no_sync():
            for tokens, targets in step:
                loss = fsdp(local_slice(ctx, tokens), local_slice(ctx, targets)) / cfg.micro_batches
                loss.backward()
                total += loss.item()
        torch.distributed.all_reduce(total, group=ctx.group)
        losses.append(total.item() / ctx.size)
        norms.append(opt.step())
        opt.zero_grad()
    params = fsdp.full_state_dict()  # a collective: every rank calls it
    return {"losses": losses, "grad_norms": norms, "params": params if ctx.rank == 0 else None}


class Positions(nn.Module):
    """Learned positions initialised by ``reset_parameters`` (TinyLM's ``pos`` is drawn in its constructor)."""

    def __init__(self, seq: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(seq, hidden))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.weight, std=0.02)


class Scale(nn.Module):
    """A frozen parameter and a buffer, both set by ``reset_parameters``."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden), requires_grad=False)
        self.register_buffer("offset", torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.uniform_(self.weight, 0.5, 1.5)
        nn.init.normal_(self.offset, std=0.01)


class ResetLM(nn.Module):
    """A model whose eager build and meta-device build draw the same random numbers.

    Tied head (tied after construction, as most models do it: the head still draws
    its own weight first), a frozen parameter, a buffer, nested units
    (``ResetBlock`` holds an ``MLP``).
    """

    def __init__(self, vocab: int = 67, hidden: int = 32, heads: int = 4, layers: int = 2, seq: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = Positions(seq, hidden)
        self.blocks = nn.ModuleList(ResetBlock(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.scale = Scale(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens, targets):
        x = self.embed(tokens) + self.pos.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        x = self.norm(x) * self.scale.weight + self.scale.offset
        logits = self.head(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

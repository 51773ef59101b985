"""Worker side of the Muon checkpoint and error tests."""

from __future__ import annotations

import dataclasses
from typing import Dict

import torch
import torch.distributed.checkpoint as dcp

import megatron.fsdp as mfsdp
from megatron.fsdp.testing.engine_training import GLOBAL_MICRO_BATCH, OPTIMIZERS, RunConfig, train_step, wrap
from megatron.fsdp.testing.models import make_batches
from tests.cases.muon_training import MUON, muon_wrap


BATCHES = 4


def _train(ctx, fsdp, opt, cfg, first, last):
    batches = make_batches(BATCHES, 1, GLOBAL_MICRO_BATCH)
    return [train_step(ctx, fsdp, opt, step, cfg)[0] for step in batches[first:last]]


def _save(ctx, fsdp, opt, path):
    dcp.save({"model": fsdp.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path, process_group=ctx.group)


def _load(ctx, fsdp, opt, path):
    state = {"model": fsdp.state_dict(), "optim": opt.state_dict()}
    mfsdp.check_checkpoint_keys(state, path)
    dcp.load(state, checkpoint_id=path, process_group=ctx.group)
    fsdp.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])


def _momentum(opt) -> Dict[str, torch.Tensor]:
    return {k: v.to_local().clone() for k, v in opt.state_dict().items() if k.endswith(".momentum_buffer")}


def resume(ctx, path: str, **config) -> Dict[str, object]:
    """Four steps straight against two, save, a fresh model from another seed, load, two more."""
    cfg = dataclasses.replace(RunConfig(), steps=BATCHES, **config)
    fsdp, opt = muon_wrap(ctx, cfg)
    straight = _train(ctx, fsdp, opt, cfg, 0, BATCHES)
    straight_momentum = _momentum(opt)
    fsdp, opt = muon_wrap(ctx, cfg)
    _train(ctx, fsdp, opt, cfg, 0, 2)
    _save(ctx, fsdp, opt, path)
    saved = _momentum(opt)
    fsdp, opt = muon_wrap(ctx, dataclasses.replace(cfg, seed=7))
    _load(ctx, fsdp, opt, path)
    loaded = _momentum(opt)
    resumed = _train(ctx, fsdp, opt, cfg, 2, BATCHES)
    after = _momentum(opt)
    return {"straight": straight[2:], "resumed": resumed,
            "momentum_loaded_bitwise": all(torch.equal(saved[k], loaded[k]) for k in saved),
            "momentum_after_bitwise": all(torch.equal(straight_momentum[k], after[k]) for k in after),
            "momentum_keys": len(saved)}


def save_then_continue(ctx, path: str, matrix: str = "muon", **config) -> Dict[str, object]:
    cfg = dataclasses.replace(RunConfig(), steps=BATCHES, **config)
    fsdp, opt = muon_wrap(ctx, cfg, matrix=matrix)
    _train(ctx, fsdp, opt, cfg, 0, 2)
    _save(ctx, fsdp, opt, path)
    return {"after": _train(ctx, fsdp, opt, cfg, 2, BATCHES)}


def load_and_continue(ctx, path: str, matrix: str = "muon", **config) -> Dict[str, object]:
    cfg = dataclasses.replace(RunConfig(), steps=BATCHES, seed=7, **config)
    fsdp, opt = muon_wrap(ctx, cfg, matrix=matrix)
    _load(ctx, fsdp, opt, path)
    return {"after": _train(ctx, fsdp, opt, cfg, 2, BATCHES)}


def _error(fn):
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


def selector_errors(ctx) -> Dict[str, object]:
    """A selector that picks a 1-D or frozen parameter, and a class that is not Muon: one clear error each."""
    cfg = RunConfig(strategy="optim_grads_params")
    fsdp, _ = wrap(ctx, cfg)
    cls, kwargs = OPTIMIZERS["adamw"]

    def build(select, matrix=torch.optim.Muon):
        mfsdp.FullyShardedOptimizer(fsdp, cls, matrix_optimizer=matrix, matrix_kwargs=MUON,
                                    matrix_params=select, **kwargs)
    return {
        "one_d": _error(lambda: build(lambda n, p: n.startswith("blocks.") and n.endswith("norm1.weight"))),
        "frozen": _error(lambda: build(lambda n, p: n == "frozen_scale")),
        "not_an_optimizer": _error(lambda: build(None, matrix=torch.nn.Linear)),
        "root_matrix_ok": _error(lambda: build(lambda n, p: p.dim() == 2 and p.requires_grad)),
    }

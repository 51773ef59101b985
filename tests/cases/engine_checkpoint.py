"""Worker side of the checkpoint tests: train, save with DCP, rebuild from another seed, load, train on.

Every case gets a directory shared by its ranks from the test. The same global
batches feed every run, so a resumed run can be compared with one that never
stopped.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp

import megatron.fsdp as mfsdp
from megatron.fsdp.testing.engine_training import GLOBAL_MICRO_BATCH, RunConfig, train_step, wrap
from megatron.fsdp.testing.models import make_batches


BATCHES = 4


def _config(**overrides) -> RunConfig:
    """A training configuration: any ``RunConfig`` field (level, mesh, bf16, expert section, seed)."""
    return dataclasses.replace(RunConfig(), steps=BATCHES, micro_batches=1, **overrides)


def _train(ctx, fsdp, opt, cfg, first: int, last: int) -> List[Tuple[float, float]]:
    batches = make_batches(BATCHES, 1, GLOBAL_MICRO_BATCH)
    return [train_step(ctx, fsdp, opt, step, cfg) for step in batches[first:last]]


def _save(ctx, fsdp, opt, path: str, stateful: bool = False) -> None:
    state = {"model": fsdp, "optim": opt} if stateful else {"model": fsdp.state_dict(), "optim": opt.state_dict()}
    dcp.save(state, checkpoint_id=path, process_group=ctx.group)


def _load(ctx, fsdp, opt, path: str, stateful: bool = False) -> None:
    """Validate against the checkpoint's metadata, let DCP fill the state dicts, install them."""
    state = {"model": fsdp.state_dict(), "optim": opt.state_dict()}
    mfsdp.check_checkpoint_keys(state, path)
    if stateful:  # DCP calls state_dict() and load_state_dict() of Stateful objects itself
        dcp.load({"model": fsdp, "optim": opt}, checkpoint_id=path, process_group=ctx.group)
        return
    dcp.load(state, checkpoint_id=path, process_group=ctx.group)
    fsdp.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])


def _compute_matches_main(fsdp) -> bool:
    """Compute weights equal the main weights cast to the compute dtype, wherever this rank keeps both."""
    ok = True
    for unit in fsdp.units:
        s = unit.storage
        a, b = s.regions.main
        if a < b and not s.casts_main:  # casts_main keeps no compute copy: every gather casts main
            ok &= torch.equal(s.compute_slice(a, b), s.main.to(s.compute_dtype))
    return bool(ok)


def resume_exact(ctx, path: str, stateful: bool = False, **config) -> Dict[str, object]:
    """Four steps straight against two steps, save, a fresh model from another seed, load, two steps."""
    cfg = _config(**config)
    fsdp, opt = wrap(ctx, cfg)
    straight = _train(ctx, fsdp, opt, cfg, 0, BATCHES)
    fsdp, opt = wrap(ctx, cfg)
    _train(ctx, fsdp, opt, cfg, 0, 2)
    _save(ctx, fsdp, opt, path, stateful)
    saved = fsdp.full_state_dict()
    fsdp, opt = wrap(ctx, dataclasses.replace(cfg, seed=7))
    _load(ctx, fsdp, opt, path, stateful)
    loaded = fsdp.full_state_dict()
    compute_ok = _compute_matches_main(fsdp)
    resumed = _train(ctx, fsdp, opt, cfg, 2, BATCHES)
    return {"straight": straight[2:], "resumed": resumed, "compute_matches_main": compute_ok,
            "params_equal": all(torch.equal(saved[k], loaded[k]) for k in saved),
            "main_dtypes": sorted({str(v.dtype) for v in loaded.values()})}


def save_then_continue(ctx, path: str) -> Dict[str, object]:
    """Save after two ZeRO-3 steps (the resharding source), then keep training: the run that never stopped."""
    cfg = _config(strategy="optim_grads_params")
    fsdp, opt = wrap(ctx, cfg)
    _train(ctx, fsdp, opt, cfg, 0, 2)
    _save(ctx, fsdp, opt, path)
    saved = fsdp.full_state_dict()
    after = _train(ctx, fsdp, opt, cfg, 2, BATCHES)
    return {"params": saved if ctx.rank == 0 else None, "after": after}


def load_and_continue(ctx, path: str, **config) -> Dict[str, object]:
    cfg = _config(seed=7, **config)
    fsdp, opt = wrap(ctx, cfg)
    _load(ctx, fsdp, opt, path)
    loaded = fsdp.full_state_dict()
    after = _train(ctx, fsdp, opt, cfg, 2, BATCHES)
    return {"params": loaded if ctx.rank == 0 else None, "after": after}


def _error_of(fn) -> Optional[str]:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def load_errors(ctx, path: str) -> Dict[str, object]:
    """Mismatched state dicts and checkpoints raise one error naming the keys, before anything changes."""
    cfg = _config(strategy="optim_grads_params")
    fsdp, opt = wrap(ctx, cfg)
    _train(ctx, fsdp, opt, cfg, 0, 1)
    _save(ctx, fsdp, opt, path)
    before, opt_before = fsdp.full_state_dict(), opt.state_dict()
    out = {}
    # Against the model: a key taken away, a key added, a parameter of the wrong shape.
    sd = fsdp.state_dict()
    del sd["norm.bias"]
    out["model_missing"] = _error_of(lambda: fsdp.load_state_dict(sd))
    sd = fsdp.state_dict()
    sd["bogus.weight"] = torch.zeros(3)
    out["model_unexpected"] = _error_of(lambda: fsdp.load_state_dict(sd))
    sd = fsdp.state_dict()
    sd["pos"] = torch.zeros(3, 3)
    out["model_shape"] = _error_of(lambda: fsdp.load_state_dict(sd))
    sd = fsdp.state_dict()
    if ctx.rank == 1:  # a mismatch on one rank only: every rank raises (none waits in the install gathers)
        del sd["norm.bias"]
    out["one_rank_only"] = _error_of(lambda: fsdp.load_state_dict(sd))
    osd = opt.state_dict()
    del osd["state.pos.exp_avg"]
    out["optim_missing"] = _error_of(lambda: opt.load_state_dict(osd))
    after, opt_after = fsdp.full_state_dict(), opt.state_dict()
    out["model_unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    out["optim_unchanged"] = all(torch.equal(opt_before[k].to_local(), opt_after[k].to_local())
                                 for k in opt_before if k.startswith(("main.", "state.")))
    # Against the checkpoint: a model with one more parameter, one fewer, and a wider one.
    wider, wider_opt = wrap(ctx, dataclasses.replace(cfg, hidden=48))
    out["ckpt_shape"] = _error_of(lambda: mfsdp.check_checkpoint_keys(
        {"model": wider.state_dict(), "optim": wider_opt.state_dict()}, path))
    state = {"model": fsdp.state_dict(), "optim": opt.state_dict()}
    state["model"]["extra.weight"] = mfsdp.model_state_dict(fsdp)["pos"]
    del state["model"]["norm.bias"]
    out["ckpt_missing_unexpected"] = _error_of(lambda: mfsdp.check_checkpoint_keys(state, path))
    model_only = {"model": fsdp.state_dict()}
    out["ckpt_model_only"] = _error_of(lambda: mfsdp.check_checkpoint_keys(model_only, path))
    out["ckpt_model_only_allowed"] = _error_of(lambda: mfsdp.check_checkpoint_keys(model_only, path, allow_unexpected=True))
    return out


def fresh_optimizer_round_trip(ctx, path: str) -> Dict[str, object]:
    """A checkpoint taken before the first step loads as a fresh optimizer (no warm-up step, step 0)."""
    cfg = _config(strategy="optim")
    fsdp, opt = wrap(ctx, cfg)
    _save(ctx, fsdp, opt, path)
    straight = _train(ctx, fsdp, opt, cfg, 0, 2)
    fsdp, opt = wrap(ctx, dataclasses.replace(cfg, seed=7))
    _load(ctx, fsdp, opt, path)
    return {"straight": straight, "resumed": _train(ctx, fsdp, opt, cfg, 0, 2)}


def assert_exact_resume(result):
    """A case's result, checked in the test: weights, compute weights and the continued run as saved."""
    assert result["params_equal"], "full parameters after load differ from the saved ones"
    assert result["compute_matches_main"], "compute weights were not rebuilt from the loaded main weights"
    assert result["resumed"] == result["straight"], (result["resumed"], result["straight"])

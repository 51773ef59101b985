"""Worker side of the lower-precision tests: bf16 optimizer state and main grads, lean ZeRO-3 gathers."""

from __future__ import annotations

import dataclasses
from typing import Dict

import torch

from tests.cases.engine_checkpoint import BATCHES, _config, _load, _save, _train
from megatron.fsdp.testing.engine_training import GLOBAL_MICRO_BATCH, local_slice, wrap
from megatron.fsdp.testing.models import make_batches


def _moments(opt):
    """Every optimizer tensor's moments, in param-group order (the same order for equal layouts)."""
    return [{k: v.clone() for k, v in opt.state[t].items() if k != "step"}
            for group in opt.optimizer.param_groups for t in group["params"]]


def _report_in_step(ctx, fsdp, opt):
    """Bytes per rank while gradients are held: after one more backward (no step), then released."""
    tokens, targets = make_batches(1, 1, GLOBAL_MICRO_BATCH)[0][0]
    fsdp(local_slice(ctx, tokens), local_slice(ctx, targets)).backward()
    opt.finish_grad_sync()
    report = fsdp.memory_report(opt)
    opt.zero_grad()
    return report


def bf16_state(ctx, path: str, **config) -> Dict[str, object]:
    """fp32 state against bf16 state (and bf16 main grads) on the same batches; an fp32-state
    checkpoint loaded into bf16 state; what each keeps per rank."""
    cfg = _config(**config)
    low = dataclasses.replace(cfg, state_dtype="bf16", main_grads_dtype="bf16")
    fsdp, opt = wrap(ctx, cfg)
    fp32_losses = _train(ctx, fsdp, opt, cfg, 0, 2)
    _save(ctx, fsdp, opt, path)
    saved = _moments(opt)
    fp32_losses += _train(ctx, fsdp, opt, cfg, 2, BATCHES)
    fp32_report = _report_in_step(ctx, fsdp, opt)

    fsdp, opt = wrap(ctx, low)
    bf16_losses = _train(ctx, fsdp, opt, low, 0, BATCHES)
    bf16_report = _report_in_step(ctx, fsdp, opt)
    state_dtypes = sorted({str(v.dtype) for st in _moments(opt) for v in st.values()})
    grad_dtypes = sorted({str(u.storage.grad_accum.dtype) for u in fsdp.units})

    fsdp, opt = wrap(ctx, dataclasses.replace(low, seed=7))
    _load(ctx, fsdp, opt, path)
    loaded = _moments(opt)
    rounded = all(torch.equal(new[k], old[k].to(new[k].dtype)) for new, old in zip(loaded, saved) for k in new)
    continued = _train(ctx, fsdp, opt, low, 2, BATCHES)
    return {"fp32": fp32_losses, "bf16": bf16_losses, "loaded_fp32_into_bf16": continued,
            "loaded_state_is_rounded_fp32": bool(rounded and len(loaded) == len(saved)),
            "state_dtypes": state_dtypes, "grad_dtypes": grad_dtypes,
            "fp32_report": dataclasses.asdict(fp32_report), "bf16_report": dataclasses.asdict(bf16_report)}


def zero3_vs_zero2(ctx, **config) -> Dict[str, object]:
    """The same bf16 training at ZeRO-3 (gathers cast main weights) and ZeRO-2 (persistent compute weights)."""
    out = {}
    for level in ("optim_grads", "optim_grads_params"):
        cfg = _config(**{k: (level if v == "LEVEL" else v) for k, v in config.items()})
        fsdp, opt = wrap(ctx, cfg)
        out[level] = {"losses": _train(ctx, fsdp, opt, cfg, 0, BATCHES), "params": fsdp.full_state_dict(),
                      "casts_main": sorted({u.storage.casts_main for u in fsdp.units})}
    return out

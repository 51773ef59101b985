"""Lower precision without a persistent compute copy: lean ZeRO-3 gathers, bf16 optimizer state, bf16 main grads."""

from __future__ import annotations

import dataclasses
from typing import Dict

import pytest
import torch

from megatron.fsdp.precision.optimizer_state import OptimizerPrecision, converts_on_load, precision_aware_adam
from megatron.fsdp.testing.common import rel
from megatron.fsdp.testing.engine_training import GLOBAL_MICRO_BATCH, local_slice, wrap
from megatron.fsdp.testing.models import make_batches
from tests.cases.engine_checkpoint import BATCHES, _config, _load, _save, _train, assert_exact_resume, resume_exact


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


def test_precision_aware_adam_is_torch_adam_at_fp32_and_close_at_bf16(monkeypatch):
    """fp32 moments: bitwise torch.optim.Adam / AdamW (same ops, chunked); bf16 moments: within bf16 rounding."""
    import megatron.fsdp.precision.optimizer_state as po

    monkeypatch.setattr(po, "CHUNK_ELEMENTS", 4096)
    torch.manual_seed(0)
    n = 3 * 4096 + 5  # whole chunks and a partial one
    for cls, decoupled in ((torch.optim.AdamW, True), (torch.optim.Adam, False)):
        ref, same, low = (torch.randn(n) for _ in range(3))
        same.copy_(ref)
        low.copy_(ref)
        opts = [cls([ref], lr=1e-2, weight_decay=0.1),
                precision_aware_adam(torch.float32, torch.float32)([same], lr=1e-2, weight_decay=0.1,
                                                                    decoupled_weight_decay=decoupled),
                precision_aware_adam(torch.bfloat16, torch.bfloat16)([low], lr=1e-2, weight_decay=0.1,
                                                                      decoupled_weight_decay=decoupled)]
        for _ in range(3):
            grad = torch.randn(n)
            for w, opt in zip((ref, same, low), opts):
                w.grad = grad.clone()
                opt.step()
        assert torch.equal(ref, same), cls.__name__
        assert opts[1].state[same]["step"].item() == 3.0
        assert opts[0].param_groups[0].keys() == opts[2].param_groups[0].keys()  # same checkpoint keys
        assert opts[2].state[low]["exp_avg"].dtype == torch.bfloat16
        assert (low - ref).abs().max().item() < 1e-3  # three steps of lr 1e-2, moments rounded to bf16
    with pytest.raises(ValueError, match="torch.optim.Adam and torch.optim.AdamW, not SGD"):
        OptimizerPrecision.of(torch.bfloat16).optimizer_class(torch.optim.SGD, torch.float32)
    with pytest.raises(ValueError, match="supported are torch.float32 and torch.bfloat16"):
        OptimizerPrecision.of(torch.float16)
    assert converts_on_load("optimizer.state.layer.weight.exp_avg", "torch.float32", "torch.bfloat16")
    assert not converts_on_load("model.layer.exp_avg", "torch.float32", "torch.bfloat16")


@pytest.mark.parametrize("config", [
    dict(strategy="optim_grads_params", bf16=True),
    dict(strategy="optim", bf16=True, mesh=(2, 2), outer_strategy="optim"),
], ids=["zero3-flat-bf16", "zero1-2x2"])
def test_bf16_state_trains_like_fp32_state_and_loads_fp32_checkpoints(pool, tmp_path, config):
    size = 4 if "mesh" in config else 2
    for r in pool.run(bf16_state, size=size, timeout=300, path=str(tmp_path), **config):
        assert r["state_dtypes"] == ["torch.bfloat16"] and r["grad_dtypes"] == ["torch.bfloat16"]
        for label in ("bf16", "loaded_fp32_into_bf16"):
            got = r[label]
            ref = r["fp32"][-len(got):]
            for (loss, norm), (ref_loss, ref_norm) in zip(got, ref):
                assert rel(loss, ref_loss) < 2e-2 and rel(norm, ref_norm) < 5e-2, (label, got, ref)
        assert r["loaded_state_is_rounded_fp32"], "fp32 moments were not loaded (rounded) into the bf16 state"
        fp32, bf16 = r["fp32_report"], r["bf16_report"]
        assert bf16["optimizer_state"] == fp32["optimizer_state"] // 2
        assert bf16["main_grads"] == fp32["main_grads"] // 2
        assert bf16["main_weights"] == fp32["main_weights"]


def test_bf16_state_resumes_exactly(pool, tmp_path):

    for r in pool.run(resume_exact, size=4, timeout=300, path=str(tmp_path),
                      strategy="optim_grads_params", bf16=True, mesh=(2, 2), outer_strategy="no_shard",
                      state_dtype="bf16", main_grads_dtype="bf16"):
        assert_exact_resume(r)


def test_zero3_gathers_cast_main_weights_bitwise_like_zero2(pool):
    """ZeRO-3 keeps no compute copy of trainable weights under bf16 (each gather casts the main shard);
    it trains bitwise like ZeRO-2, whose persistent compute weights are the same cast. Two-axis mesh
    and an expert section on its own 2 x 2 mesh."""
    config = dict(strategy="LEVEL", bf16=True, mesh=(2, 2), outer_strategy="LEVEL",
                  expert_strategy="LEVEL", expert_mesh=(2, 2), expert_outer_strategy="no_shard")
    for r in pool.run(zero3_vs_zero2, size=4, timeout=300, **config):
        z2, z3 = r["optim_grads"], r["optim_grads_params"]
        assert z3["casts_main"] == [True] and z2["casts_main"] == [False]
        assert z3["losses"] == z2["losses"]
        assert all(torch.equal(z3["params"][k], v) for k, v in z2["params"].items())

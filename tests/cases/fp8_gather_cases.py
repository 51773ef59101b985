"""FP8 parameter gathers against the unsharded model under the same recipe (engine tests, GPU smoke).

The unsharded model's FP8 weights are ``fp8.py`` applied to each full fp32 weight
(``ReferenceQuantizer``, one delayed-scaling history per weight). The worker cases train under
``fully_shard(..., param_gather=...)`` and compare, at every step, what each rank computes with
(``mfsdp.quantized_weight`` and the dequantized compute weight, captured when each ``Linear``
runs) with that reference quantization of the full main weights (``full_state_dict``) bitwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp

import megatron.fsdp as mfsdp
from megatron.fsdp.precision import fp8
from megatron.fsdp.testing.engine_training import (GLOBAL_MICRO_BATCH, RunConfig, build_model, is_expert,
                                                   reference_run, train_step, wrap)
from megatron.fsdp.testing.models import make_batches

HISTORY = 3  # a short amax history: ten steps roll its window


def gather_of(recipe: str, **overrides) -> mfsdp.QuantizedParamGather:
    return mfsdp.QuantizedParamGather(recipe=recipe, amax_history_len=HISTORY, **overrides)


def linear_weights(model: torch.nn.Module) -> List[str]:
    """What the default ``quantize`` selects in the test models: every ``nn.Linear``'s weight."""
    return [f"{name}.weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


class ReferenceQuantizer:
    """The unsharded model's quantization: ``fp8.py`` on full weights, a history per weight, advanced per step."""

    def __init__(self, gather: mfsdp.QuantizedParamGather, names):
        self.gather = gather
        self.histories = {n: fp8.AmaxHistory.new(gather.amax_history_len, gather.amax_compute_algo) for n in names}
        # per step of ``computing_with_fp8``: ``fp8_codes`` of each weight it computed with
        self.computed: List[Dict[str, Tuple[torch.Tensor, torch.Tensor]]] = []

    def quantize(self, name: str, weight: torch.Tensor) -> fp8.QuantizedWeight:
        g = self.gather
        if g.recipe == "tensorwise":
            return fp8.quantize_tensorwise(weight, g.fmt, g.margin)
        if g.recipe == "mxfp8":
            return fp8.quantize_mxfp8(weight, g.fmt)
        q, self.histories[name] = fp8.quantize_delayed(weight, self.histories[name], g.fmt)
        return q

    def end_step(self) -> None:
        self.histories = {n: h.advance(self.gather.fmt, self.gather.margin) for n, h in self.histories.items()}

    @contextlib.contextmanager
    def computing_with_fp8(self, model: torch.nn.Module):
        """A step of the reference: the quantized weights compute, the fp32 ones stay the optimizer's."""
        params = dict(model.named_parameters())
        kept, codes = {}, {}
        for name in self.histories:
            p = params[name]
            kept[name] = p.data
            q = self.quantize(name, p.data)
            codes[name] = fp8_codes(q)
            p.data = q.dequantize(p.dtype)
        self.computed.append(codes)
        try:
            yield
        finally:
            for name, data in kept.items():
                params[name].data = data
            self.end_step()


def fp8_codes(q: fp8.QuantizedWeight) -> Tuple[torch.Tensor, torch.Tensor]:
    """What a quantized weight computes with: its FP8 bytes and its scales (one per tensor, or per MXFP8 block)."""
    return q.data.reshape(-1).view(torch.uint8).clone(), q.scale_inv.float().reshape(-1).clone()


def reference_fp8_run(cfg: RunConfig, recipe: str) -> Dict[str, object]:
    """The unsharded run under ``recipe``: fp32 weights stepped, their FP8 quantization computing
    (``"fp8"``: per step, ``fp8_codes`` of each weight it computed with)."""
    quantizer = ReferenceQuantizer(gather_of(recipe), linear_weights(build_model(cfg)))
    return dict(reference_run(cfg, quantizer.computing_with_fp8), fp8=quantizer.computed)


def _capture(fsdp, names) -> Dict[str, tuple]:
    """Hooks on every quantized ``Linear``: its FP8 weight and compute weight the first time it runs in a step."""
    captured: Dict[str, tuple] = {}
    modules = dict(fsdp.module.named_modules())

    def hook(name, module, _args):
        if name not in captured:
            q = mfsdp.quantized_weight(module.weight)
            captured[name] = (None if q is None else
                              dataclasses.replace(q, data=q.data.clone(), scale_inv=q.scale_inv.clone()),
                              module.weight.detach().clone())
    for name in names:
        modules[name[:-len(".weight")]].register_forward_pre_hook(lambda m, a, n=name: hook(n, m, a))
    return captured


def _mismatches(captured, expected: Dict[str, fp8.QuantizedWeight]) -> List[str]:
    bad = []
    for name, ref in expected.items():
        got, compute = captured.get(name, (None, None))
        if got is None:
            bad.append(f"{name}: no quantized weight")
            continue
        same = (torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8))
                and torch.equal(got.scale_inv.float(), ref.scale_inv.float())
                and torch.equal(compute, ref.dequantize(compute.dtype)))
        if not same:
            bad.append(name)
    return bad


def ep2_experts(ctx) -> mfsdp.ExpertSharding:
    """Experts (the MLPs' up-projections) on a two-rank expert-data-parallel mesh: expert parallelism 2 on four
    ranks, each expert group its own replicas (the sum over its two ranks, scaled by 1 / ranks)."""
    mesh = mfsdp.DataParallelMesh(ctx.meshes[(2, 2)].inner_group, None)
    return mfsdp.ExpertSharding(is_expert, mesh, "optim_grads_params", average_grads=False, grad_scale=1.0 / ctx.size)


def quantized_names(fsdp) -> List[str]:
    """The parameters the engine gathers in FP8 (the tests hold them to ``linear_weights``)."""
    return sorted(n for u in fsdp.units if u.storage.fp8 is not None for n in u.storage.fp8.names)


def fp8_training(ctx, recipe: str, steps: int = 10, ep2: bool = False, compare_bf16: bool = False,
                 shard_kwargs: Optional[dict] = None, **config) -> Dict[str, object]:
    """Train under ``recipe``; at every step the FP8 weights against the reference quantization, bitwise.

    ``shard_kwargs``: more ``fully_shard`` arguments (double buffer, prefetch depths).
    """
    cfg = dataclasses.replace(RunConfig(), steps=steps, **config)
    extra = dict(shard_kwargs or {}, **(dict(experts=ep2_experts(ctx)) if ep2 else {}))
    fsdp, opt = wrap(ctx, cfg, param_gather=gather_of(recipe), **extra)
    names = quantized_names(fsdp)
    reference = ReferenceQuantizer(gather_of(recipe), names)
    captured = _capture(fsdp, names)
    fsdp.ledger.trace = True
    losses, norms, bad, computed = [], [], [], []
    for step in make_batches(cfg.steps, cfg.micro_batches, GLOBAL_MICRO_BATCH):
        full = fsdp.full_state_dict()
        expected = {n: reference.quantize(n, full[n]) for n in names}
        captured.clear()
        fsdp.ledger.reset()
        loss, norm = train_step(ctx, fsdp, opt, step, cfg)
        bad.append(_mismatches(captured, expected))
        computed.append({n: fp8_codes(q) for n, q in expected.items()} if ctx.rank == 0 else None)
        reference.end_step()
        losses.append(loss)
        norms.append(norm)
    params = fsdp.full_state_dict()  # a collective: every rank calls it
    out = {"losses": losses, "grad_norms": norms, "mismatches": bad, "quantized": names, "fp8": computed,
           "linear_weights": sorted(linear_weights(fsdp.module)),
           "gather_bytes": _gather_bytes(fsdp), "params": params if ctx.rank == 0 else None}
    if compare_bf16:
        plain, plain_opt = wrap(ctx, cfg, **extra)  # the same model gathering in the compute dtype
        plain.ledger.trace = True
        train_step(ctx, plain, plain_opt, make_batches(1, cfg.micro_batches, GLOBAL_MICRO_BATCH)[0], cfg)
        out["plain_gather_bytes"] = _gather_bytes(plain)
        out["wire"] = {u.name: (u.storage.fp8.plan.nbytes, u.storage.layout.padded_size)
                       for u in fsdp.units if u.storage.fp8 is not None}
    return out


def _gather_bytes(fsdp) -> Dict[str, tuple]:
    """``{unit: (all-gather bytes, all-gathers)}`` of the last step (every axis)."""
    out: Dict[str, tuple] = {}
    for e in fsdp.ledger.events:
        if e.kind == "all_gather":
            nbytes, calls = out.get(e.tag, (0, 0))
            out[e.tag] = (nbytes + e.nbytes, calls + 1)
    return out


def fp8_save(ctx, path: str, recipe: str, steps: int = 4, save_at: int = 2, **config) -> Dict[str, object]:
    """Train ``steps``, saving (DCP) after ``save_at``: the run that never stopped, and its FP8 weights."""
    cfg = dataclasses.replace(RunConfig(), steps=steps, **config)
    fsdp, opt = wrap(ctx, cfg, param_gather=gather_of(recipe))
    names = linear_weights(fsdp.module)
    captured = _capture(fsdp, names)
    after, weights = [], []
    for i, step in enumerate(make_batches(cfg.steps, cfg.micro_batches, GLOBAL_MICRO_BATCH)):
        if i == save_at:
            dcp.save({"model": fsdp.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path, process_group=ctx.group)
        captured.clear()
        loss = train_step(ctx, fsdp, opt, step, cfg)
        if i >= save_at:
            after.append(loss)
            weights.append({n: (q.data.view(torch.uint8), q.scale_inv.float()) for n, (q, _) in captured.items()})
    return {"after": after, "weights": weights if ctx.rank == 0 else None,
            "fp8_keys": sorted(k for k in fsdp.state_dict() if "._fp8_" in k)}


def fp8_load(ctx, path: str, recipe: str, steps: int = 4, save_at: int = 2, **config) -> Dict[str, object]:
    """A fresh model (another seed) at another DP size or level: load, train on, the same FP8 weights."""
    cfg = dataclasses.replace(RunConfig(), steps=steps, seed=7, **config)
    fsdp, opt = wrap(ctx, cfg, param_gather=gather_of(recipe))
    state = {"model": fsdp.state_dict(), "optim": opt.state_dict()}
    mfsdp.check_checkpoint_keys(state, path)
    dcp.load(state, checkpoint_id=path, process_group=ctx.group)
    fsdp.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    captured = _capture(fsdp, linear_weights(fsdp.module))
    after, weights = [], []
    for step in make_batches(cfg.steps, cfg.micro_batches, GLOBAL_MICRO_BATCH)[save_at:]:
        captured.clear()
        after.append(train_step(ctx, fsdp, opt, step, cfg))
        weights.append({n: (q.data.view(torch.uint8), q.scale_inv.float()) for n, (q, _) in captured.items()})
    return {"after": after, "weights": weights if ctx.rank == 0 else None}


def fp8_errors(ctx) -> Dict[str, Optional[str]]:
    """Configurations the engine refuses before any collective: each message, on every rank."""
    from megatron.fsdp.testing.models import Block, MLP, TinyLM

    out = {}

    def attempt(key, model, gather, strategy="optim_grads_params"):
        try:
            mfsdp.fully_shard(model, strategy=strategy, unit_modules=(Block, MLP), process_group=ctx.group,
                              param_gather=gather)
        except (ValueError, TypeError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
            return
        out[key] = None
    attempt("mx_reduction_dim", TinyLM(hidden=40, heads=4), gather_of("mxfp8"))
    attempt("frozen", TinyLM(), gather_of("tensorwise", quantize=lambda n, p: n == "frozen_scale"))
    attempt("nothing", TinyLM(), gather_of("tensorwise", quantize=lambda n, p: False))
    attempt("not_a_gather", TinyLM(), "fp8")
    for key, kwargs in (("recipe", dict(recipe="nvfp4")), ("blockwise", dict(recipe="blockwise")),
                        ("history", dict(amax_history_len=0)), ("algo", dict(amax_compute_algo="mean"))):
        try:
            mfsdp.QuantizedParamGather(**kwargs)
            out[key] = None
        except ValueError as exc:
            out[key] = str(exc)
    return out


def fp8_meta_init(ctx, recipe: str, steps: int = 2) -> Dict[str, object]:
    """The same model built eagerly and on the meta device: the same FP8 weights and losses, bitwise."""
    from megatron.fsdp.testing.engine_training import OPTIMIZERS
    from megatron.fsdp.testing.models import MLP, ResetBlock, ResetLM

    runs = {}
    for meta in (False, True):
        torch.manual_seed(5)
        with (torch.device("meta") if meta else contextlib.nullcontext()):
            module = ResetLM()
        fsdp = mfsdp.fully_shard(module, strategy="optim_grads_params", unit_modules=(ResetBlock, MLP),
                                 process_group=ctx.group, param_gather=gather_of(recipe))
        cls, kwargs = OPTIMIZERS["adamw"]
        opt = mfsdp.FullyShardedOptimizer(fsdp, cls, clip_grad=1.0, **kwargs)
        captured = _capture(fsdp, quantized_names(fsdp))
        losses, weights = [], []
        for step in make_batches(steps, 1, GLOBAL_MICRO_BATCH):
            captured.clear()
            losses.append(train_step(ctx, fsdp, opt, step, RunConfig())[0])
            weights.append({n: (q.data.view(torch.uint8), q.scale_inv.float()) for n, (q, _) in captured.items()})
        runs[meta] = (losses, weights, quantized_names(fsdp))
    (eager_losses, eager_w, names), (meta_losses, meta_w, meta_names) = runs[False], runs[True]
    same = all(torch.equal(a[n][k], b[n][k]) for a, b in zip(eager_w, meta_w) for n in a for k in (0, 1))
    return {"losses_equal": eager_losses == meta_losses, "weights_equal": same and names == meta_names,
            "names": names}

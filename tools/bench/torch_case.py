"""The torch-only workload: one GPT-like decoder trained by this engine, by FSDP2, or unwrapped.

The model is the project's own example (``examples/tiny_transformer.py``: token and
position embeddings, pre-norm blocks, tied output head) at the sizes of ``spec.SIZES``,
so the benchmark measures the model users are shown. Every system trains it with AdamW
(Megatron's no-decay rule for biases and norms), gradient clipping at 1.0 and, for bf16,
the same mixed-precision policy: bf16 compute, fp32 main weights, fp32 gradient
reduction. ``run`` is a worker-pool case (``megatron/fsdp/testing/pool.py``).
"""

from __future__ import annotations

import contextlib
from typing import List

import torch
import torch.distributed as dist

from examples.tiny_transformer import Block, TinyTransformer
from tools.bench import measure as M
from tools.bench import nv_fsdp
from tools.bench.spec import (BETAS, CLIP_GRAD, EPS, FLOOR, FP8_OPTIONS, GATHER_RECIPES, LR, NV_FSDP, OPTIONS, SIZES,
                             WEIGHT_DECAY, gather_buffer_elements, option_of)

SEED = 1234


def build_model(size_name: str) -> torch.nn.Module:
    """The same initial weights on every rank and for every system."""
    size = SIZES[size_name]
    torch.manual_seed(SEED)
    return TinyTransformer(size.vocab, size.hidden, size.layers, size.heads, size.seq)


def root_params(model: torch.nn.Module) -> int:
    """Parameters outside the blocks (embeddings, final norm): the root unit."""
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)


def unit_params(model: torch.nn.Module) -> List[int]:
    """Parameters per unit as ours and FSDP2 wrap the model: the root first, then each block."""
    return [root_params(model)] + [sum(p.numel() for p in block.parameters()) for block in model.blocks]


def linear_weights(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The trainable ``nn.Linear`` weights of ``module``: what ``QuantizedParamGather``'s default selection
    gathers in FP8 (the engine also leaves out a weight another kind of module shares, which the blocks have
    none of: the tied head is the root's embedding, outside the blocks)."""
    return [m.weight for m in module.modules() if isinstance(m, torch.nn.Linear) and m.weight.requires_grad]


def quantized_counts(model: torch.nn.Module) -> dict:
    """The FP8 gather rows' theory inputs: the blocks' quantized weight elements, the last block's, and the
    number of quantized tensors (one fp32 amax each in the per-tensor recipes' all-reduce)."""
    per_block = [linear_weights(block) for block in model.blocks]
    return dict(quantized_params=sum(p.numel() for ws in per_block for p in ws),
                last_unit_quantized=sum(p.numel() for p in per_block[-1]),
                quantized_tensors=sum(len(ws) for ws in per_block))


def param_groups(named):
    """AdamW groups with Megatron's rule: no weight decay on biases and 1-D parameters."""
    from megatron.fsdp import megatron_no_weight_decay

    named = list(named)
    decay = [p for n, p in named if not megatron_no_weight_decay(n, p)]
    no_decay = [p for n, p in named if megatron_no_weight_decay(n, p)]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]


def _plain_step(model, optimizer, tokens, clip=torch.nn.utils.clip_grad_norm_) -> M.Built:
    """Forward, backward, clip, AdamW, zero grad (the system's own hooks do the rest)."""
    def step():
        model(tokens).backward()
        clip(model.parameters(), CLIP_GRAD)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return M.Built(step, optimizer=optimizer)


def wrap_ours(model: torch.nn.Module, level: str, bf16: bool, state_dtype=None, option: str = ""):
    """This engine at ``level``: blocks are units; bf16 compute with fp32 main weights and reduction.

    ``state_dtype=torch.bfloat16``: AdamW's moments in bf16 (system ``ours:<level>:bf16-state``).
    ``option`` (``spec.OPTIONS``, system ``ours:<level>+<option>``): ``bf16_reduce`` reduces the
    gradients in bf16 (the job's ``--grad-reduce-in-bf16``), ``double_buffer`` gathers into
    persistent buffers (the job's ``--fsdp-double-buffer``); ``spec.FP8_OPTIONS``: ``fp8_gather``
    and ``mxfp8_gather`` gather the blocks' linear weights in FP8 (the job's ``--fp8-param-gather``,
    recipe ``spec.GATHER_RECIPES``; delayed scaling with Megatron-LM's history 1, most_recent).
    """
    import megatron.fsdp as mfsdp

    if option not in ("",) + OPTIONS + FP8_OPTIONS:
        raise ValueError(f"unknown engine option {option!r}; known: {', '.join(OPTIONS + FP8_OPTIONS)}")
    if option == "bf16_reduce" and not bf16:
        raise ValueError("bf16_reduce (--grad-reduce-in-bf16) needs bf16 compute, as the training job requires")
    if option in FP8_OPTIONS and not bf16:
        raise ValueError(f"{option} (--fp8-param-gather) needs bf16 compute: FP8 gathers replace bf16 gathers "
                         "(run with --dtype bf16)")
    recipe = GATHER_RECIPES.get(option)
    gather = None if recipe is None else mfsdp.QuantizedParamGather(
        recipe=recipe, amax_history_len=1, amax_compute_algo="most_recent")
    mp = mfsdp.MixedPrecision(param_dtype=torch.bfloat16, main_dtype=torch.float32, grad_reduce_dtype=(
        torch.bfloat16 if option == "bf16_reduce" else torch.float32), param_gather=gather) if bf16 else None
    wrapped = mfsdp.fully_shard(model, strategy=level, unit_modules=(Block,), mixed_precision=mp,
                                overlap=mfsdp.Overlap(double_buffer=option == "double_buffer"))
    optimizer = mfsdp.FullyShardedOptimizer(wrapped, torch.optim.AdamW, lr=LR, betas=BETAS, eps=EPS,
                                            weight_decay=WEIGHT_DECAY, clip_grad=CLIP_GRAD,
                                            precision=mfsdp.OptimizerPrecision.of(state_dtype))
    return wrapped, optimizer


class FloorOptimizer:
    """The no-communication limit's optimizer: Megatron's mixed-precision recipe without its collectives.

    bf16 is ``Float16Module`` + ``Float16OptimizerWithFloat16Params``: the model itself computes
    in bf16 and fp32 main weights receive its gradients, are clipped and stepped, and are copied
    back. Build it on the fp32 model, then cast the model to bf16 in place (``model.to`` or
    ``Float16Module``, which keep the parameter objects): the main weights are cloned here,
    before the cast. fp32: AdamW on the model's own parameters. Both workloads' floors use it.
    """

    def __init__(self, named_params, bf16: bool):
        named = list(named_params)
        self._bf16 = bf16
        self._params = [p for _, p in named]
        self._mains = [torch.nn.Parameter(p.detach().clone()) for p in self._params] if bf16 else self._params
        self.optimizer = adamw(param_groups([(n, m) for (n, _), m in zip(named, self._mains)]))

    def step(self) -> torch.Tensor:
        """Gradients to the main weights, clip, AdamW, clear every gradient, copy back; the norm before clipping."""
        if self._bf16:
            for m, p in zip(self._mains, self._params):
                m.grad = p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(self._mains, CLIP_GRAD)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self._bf16:
            with torch.no_grad():
                for m, p in zip(self._mains, self._params):
                    p.grad = None
                    p.copy_(m)
        return norm


def _floor_step(model, tokens, bf16: bool) -> M.Built:
    """The no-communication limit: every rank its own unwrapped model, nothing exchanged.

    bf16: the model itself in bf16 (``FloorOptimizer``), so every op runs in the dtype the
    sharded systems compute in. (CPU autocast with fp32 weights, the first floor, ran norms,
    softmax and the loss in fp32 and cast every weight per use: 10-20% slower than the same
    model in bf16, a floor the systems could beat.)
    """
    optimizer = FloorOptimizer(model.named_parameters(), bf16)
    if bf16:
        model.to(torch.bfloat16)

    def step():
        model(tokens).backward()
        optimizer.step()
    return M.Built(step, optimizer=optimizer.optimizer)


def adamw(groups):
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=True)


def _trim_after_block_backward(model: torch.nn.Module) -> None:
    """The job's trim (``allocator.trim_after_unit_backward``) for a system without the engine's
    post-backward hook (FSDP2, the floor): after each block's backward, through a module hook."""
    from megatron.fsdp_training.allocator import trim_after_unit_backward

    hook = trim_after_unit_backward()
    for block in model.blocks:
        block.register_full_backward_hook(lambda _m, _gi, _go: hook(""))


def build_system(system: str, model: torch.nn.Module, tokens: torch.Tensor, bf16: bool,
                 trim: bool = False) -> M.Built:
    """``trim``: the job's allocator policy after each unit's (block's) backward, on any system."""
    if trim and not system.startswith("ours:"):
        _trim_after_block_backward(model)
    if system == "unwrapped":
        if bf16:
            raise ValueError("the unwrapped model has no mixed-precision policy: it runs in fp32 only")
        return _plain_step(model, adamw(param_groups(model.named_parameters())), tokens)
    if system == FLOOR:
        return _floor_step(model, tokens, bf16)
    if system in NV_FSDP:
        wrapped, optimizer = nv_fsdp.wrap(model, system.partition(":")[2], bf16, Block,
                                          adamw(param_groups(model.named_parameters())))
        return _plain_step(wrapped, optimizer, tokens, clip=nv_fsdp.clip_grad_norm_)
    if system == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if bf16 else MixedPrecisionPolicy())
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")  # the world group: no new group per run
        for k, block in enumerate(model.blocks):  # torchtitan's recipe: the last block, which the
            # backward starts with, stays gathered after its forward
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=k < len(model.blocks) - 1)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return _plain_step(model, adamw(param_groups(model.named_parameters())), tokens)
    if system.startswith("ours:"):
        level, _, variant = system.partition(":")[2].partition("+")[0].partition(":")
        if variant not in ("", "bf16-state"):
            raise ValueError(f"unknown variant {variant!r} of {system!r}; known: bf16-state")
        wrapped, optimizer = wrap_ours(model, level, bf16, torch.bfloat16 if variant == "bf16-state" else None,
                                       option_of(system))
        if trim:
            from megatron.fsdp_training.allocator import trim_after_unit_backward
            wrapped.register_post_backward_hook(trim_after_unit_backward())

        def step():
            wrapped(tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
        return M.Built(step, ledgers=[wrapped.ledger], own_report=lambda: wrapped.memory_report(optimizer).total,
                       optimizer=optimizer.optimizer)
    raise ValueError(f"unknown torch-workload system {system!r}")


def run(ctx, system: str, size_name: str, bf16: bool, warmup: int, steps: int, worker: M.WorkerSetting) -> dict:
    """Build ``system`` on ``size_name``, train ``warmup + steps`` steps, return this rank's figures.

    ``worker``: the process's threads, bf16 kernels and allocator setting (the job's, whatever the
    system, when ``worker.job_allocator``).
    """
    worker.apply()
    M.COUNTER.install()
    shape = SIZES[size_name]
    gen = torch.Generator().manual_seed(SEED + dist.get_rank())
    tokens = torch.randint(0, shape.vocab, (shape.rows, shape.seq + 1), generator=gen)
    base_tensors, base_rss = M.baselines()
    model = build_model(size_name)
    params, units, quantized = sum(p.numel() for p in model.parameters()), unit_params(model), quantized_counts(model)
    root = units[0]
    with nv_fsdp.cpu_peer() if system in NV_FSDP else contextlib.nullcontext():
        built = build_system(system, model, tokens, bf16, trim=worker.trims)
        result = M.measure(built, warmup, steps, base_tensors, base_rss)
        del built, model
    M.trim_heap()
    result.update(params=params, root_params=root, last_unit_params=units[-1],
                  tokens_per_step=shape.rows * shape.seq * dist.get_world_size(),
                  gather_buffer_params=gather_buffer_elements(units), **quantized)
    return result

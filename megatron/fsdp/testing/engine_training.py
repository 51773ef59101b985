"""The same training loop twice: unsharded in one process (the reference) and under fully_shard.

Both see the same global batch. A sharded rank takes its contiguous slice of
every micro-batch, divides its loss by the number of micro-batches (as
Megatron does) and lets the engine average gradients over ranks; the reported
loss is the mean over ranks, which equals the global mean because every rank's
slice has the same size.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import megatron.fsdp as mfsdp
from megatron.fsdp.testing.models import MLP, Block, TinyLM, make_batches


GLOBAL_MICRO_BATCH = 12  # divisible by 1, 2, 3, 4 and 6 ranks

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.0)),
    "sgd": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9, weight_decay=0.01)),
}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    strategy: str = "optim_grads_params"
    steps: int = 5
    micro_batches: int = 1
    recompute: bool = False
    bf16: bool = False
    optimizer: str = "adamw"
    clip_grad: float = 1.0
    hidden: int = 32
    layers: int = 2
    seed: int = 0
    mesh: Optional[Tuple[int, int]] = None  # (inner N, outer M): a two-axis mesh from the pool
    outer_strategy: Optional[str] = None
    # An expert section (the MLPs' up-projections): own level, own mesh (a pool mesh, or the
    # flat group when None); ``expert_sum_scaled``: sum over the expert mesh, then scale by
    # 1 / ranks, the rule for experts under expert parallelism.
    expert_strategy: Optional[str] = None
    expert_outer_strategy: Optional[str] = None
    expert_mesh: Optional[Tuple[int, int]] = None
    expert_sum_scaled: bool = False
    # Lower-precision optimizer state / main gradients ("bf16"; None: fp32), precision/optimizer_state.py.
    state_dtype: Optional[str] = None
    main_grads_dtype: Optional[str] = None
    # The embedding in a labelled parameter group of its own at this learning rate (None: one group),
    # as Megatron-LM's --decoupled-lr puts the embedding and output layer.
    labelled_lr: Optional[float] = None


LABEL = "embedding"


def labelled(name: str, _param) -> str:
    return LABEL if name.startswith("embed.") else ""


def is_expert(name: str, param) -> bool:
    return ".mlp.up." in name


def build_model(cfg: RunConfig) -> TinyLM:
    torch.manual_seed(cfg.seed)
    return TinyLM(hidden=cfg.hidden, layers=cfg.layers, recompute=cfg.recompute)


def _optimizer_groups(model: torch.nn.Module, weight_decay: float, labelled_lr: Optional[float] = None):
    """Decay / no decay, then the labelled group's decay / no decay with its own lr (the engine's order)."""
    groups = {(label, nwd): [] for label in ("", LABEL) for nwd in (False, True)}
    for name, p in model.named_parameters():
        if p.requires_grad:
            label = labelled(name, p) if labelled_lr is not None else ""
            groups[label, mfsdp.megatron_no_weight_decay(name, p)].append(p)
    out = [{"params": groups["", nwd], "weight_decay": 0.0 if nwd else weight_decay} for nwd in (False, True)]
    if labelled_lr is not None:
        out += [{"params": groups[LABEL, nwd], "weight_decay": 0.0 if nwd else weight_decay, "lr": labelled_lr}
                for nwd in (False, True)]
    return [g for g in out if g["params"]]


def reference_run(cfg: RunConfig, step_weights=None) -> Dict[str, object]:
    """Plain single-process training on the whole global batch (``step_weights``: see ``reference_training``)."""
    model = build_model(cfg)
    cls, kwargs = OPTIMIZERS[cfg.optimizer]
    groups = _optimizer_groups(model, kwargs.get("weight_decay", 0.0), cfg.labelled_lr)
    return reference_training(model, cfg, [cls(groups, **kwargs)], step_weights)


def reference_training(model: torch.nn.Module, cfg: RunConfig, optimizers, step_weights=None) -> Dict[str, object]:
    """The reference loop: ``optimizers`` step in order after one global clip.

    ``step_weights(model)``, a context manager, is entered around each step's forward and backward
    passes (the FP8 reference computes with quantized weights there and steps the fp32 ones).
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    losses, norms = [], []
    for step in make_batches(cfg.steps, cfg.micro_batches, GLOBAL_MICRO_BATCH):
        total = 0.0
        with (step_weights(model) if step_weights is not None else contextlib.nullcontext()):
            for tokens, targets in step:
                loss = model(tokens, targets) / cfg.micro_batches
                loss.backward()
                total += loss.item()
        for p in trainable:  # the engine's rule: a parameter without a gradient has a zero gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.clip_grad if cfg.clip_grad > 0 else float("inf"))
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad()
        losses.append(total)
        norms.append(norm.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "params": params}


def wrap(ctx, cfg: RunConfig, param_gather: Optional[mfsdp.QuantizedParamGather] = None, **fully_shard_kwargs):
    """``param_gather`` goes into the run's ``MixedPrecision``; the other keywords to ``fully_shard``."""
    model = build_model(cfg)
    mp = mfsdp.MixedPrecision(param_dtype=torch.bfloat16 if cfg.bf16 else None, param_gather=param_gather)
    if cfg.mesh is not None:
        assert ctx.size == cfg.mesh[0] * cfg.mesh[1], "run a mesh case on exactly N * M ranks"
        where = dict(mesh=ctx.meshes[cfg.mesh], outer_strategy=cfg.outer_strategy)
    else:
        where = dict(mesh=ctx.group)
    if cfg.expert_strategy is not None:
        mesh = ctx.meshes[cfg.expert_mesh] if cfg.expert_mesh else mfsdp.DataParallelMesh(ctx.group)
        where["experts"] = mfsdp.ExpertSharding(
            is_expert, mesh, cfg.expert_strategy, cfg.expert_outer_strategy,
            average_grads=False if cfg.expert_sum_scaled else None,
            grad_scale=1.0 / ctx.size if cfg.expert_sum_scaled else 1.0)
    fsdp = mfsdp.fully_shard(model, strategy=cfg.strategy, unit_modules=(Block, MLP), mixed_precision=mp, **where,
                             **fully_shard_kwargs)
    cls, kwargs = OPTIMIZERS[cfg.optimizer]
    dtypes = mfsdp.precision.optimizer_state.DTYPE_NAMES
    precision = mfsdp.OptimizerPrecision.of(dtypes[cfg.state_dtype] if cfg.state_dtype else None,
                                            dtypes[cfg.main_grads_dtype] if cfg.main_grads_dtype else None)
    if cfg.labelled_lr is not None:
        kwargs = dict(kwargs, labelled_groups=mfsdp.LabelledGroups(labelled, {LABEL: {"lr": cfg.labelled_lr}}))
    opt = mfsdp.FullyShardedOptimizer(fsdp, cls, clip_grad=cfg.clip_grad, precision=precision, **kwargs)
    return fsdp, opt


def local_slice(ctx, tensor: torch.Tensor) -> torch.Tensor:
    per = tensor.shape[0] // ctx.size
    return tensor[ctx.rank * per:(ctx.rank + 1) * per]


def train_step(ctx, fsdp, opt, step, cfg: RunConfig, after_micro_batch=None) -> (float, float):
    total = 0.0
    for k, (tokens, targets) in enumerate(step):
        last = k == len(step) - 1
        with (contextlib.nullcontext() if last else fsdp.no_sync()):
            loss = fsdp(local_slice(ctx, tokens), local_slice(ctx, targets)) / cfg.micro_batches
            loss.backward()
        total += loss.item()
        if after_micro_batch is not None:
            after_micro_batch(k)
    if ctx.size > 1:
        mean = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(mean, group=ctx.group)
        total = mean.item() / ctx.size
    norm = opt.step()
    opt.zero_grad()
    return total, norm


def sharded_run(ctx, cfg: Optional[RunConfig] = None, **overrides) -> Dict[str, object]:
    """Worker side: train under fully_shard; rank 0 also returns the full parameters."""
    cfg = dataclasses.replace(cfg or RunConfig(), **overrides)
    fsdp, opt = wrap(ctx, cfg)
    losses: List[float] = []
    norms: List[float] = []
    for step in make_batches(cfg.steps, cfg.micro_batches, GLOBAL_MICRO_BATCH):
        loss, norm = train_step(ctx, fsdp, opt, step, cfg)
        losses.append(loss)
        norms.append(norm)
    params = fsdp.full_state_dict()
    return {"losses": losses, "grad_norms": norms, "params": params if ctx.rank == 0 else None}

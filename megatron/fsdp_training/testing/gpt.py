"""Megatron-Core side of the adapter's parity tests: a tiny GPT trained as Megatron-LM trains it.

Every function here runs inside a pool worker (``megatron/fsdp/testing/pool.py``) on *all* ranks
of a pool whose world size is ``tp * pp * cp * dp``: ``initialize_model_parallel``
creates groups over the whole world. ``megatron.core`` is imported lazily so that
collecting tests in the pytest process stays cheap.

The pieces mirror Megatron-LM: ``parallel`` ~ ``initialize_megatron`` (with
``_set_random_seed``), ``build_model_chunks`` ~ ``get_model`` without the DDP wrap,
``forward_step``/``loss_func`` ~ ``pretrain_gpt.py``, ``train`` ~ ``train``/``train_step``.
An adapter test swaps only the wrapper and the optimizer and reuses the rest::

    with parallel(ctx, topology):
        config = tiny_gpt_config(topology)
        chunks = build_model_chunks(config, topology)
        model = [MyDataParallel(config, ddp_config, c) for c in chunks]
        return train(model, my_optimizer, config, STEPS, MICRO_BATCHES)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
from typing import Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist


SEED = 1234
DATA_SEED = 4321
VOCAB = 128
SEQ_LENGTH = 16
ROWS_PER_DP_RANK = 4  # micro_batch_size: every DP rank gets the same number of rows
LR = 2e-3
WEIGHT_DECAY = 0.1
CLIP_GRAD = 1.0
# Every parity run trains this long: three steps show the first update and one built on it,
# two micro-batches show gradient accumulation (a doubled or missed micro-batch changes the
# first grad norm). Longer runs found nothing more and cost the suite minutes (docs/testing.md).
STEPS, MICRO_BATCHES = 3, 2


@dataclasses.dataclass(frozen=True)
class Topology:
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    cp: int = 1
    sp: bool = False
    instances: int = 1  # distributed-optimizer instances: the outer data-parallel axis
    moe: Optional[str] = None  # token dispatcher ("alltoall" / "allgather"): 4 experts in every layer
    ep: int = 1  # expert model parallel (inside data parallel: it does not change dp)

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    def dp(self, world_size: int) -> int:
        if world_size % self.model_parallel:
            raise ValueError(f"{self} does not divide a world of {world_size} ranks")
        return world_size // self.model_parallel

    def __str__(self) -> str:
        parts = [f"tp{self.tp}" + ("sp" if self.sp else ""), f"pp{self.pp}", f"cp{self.cp}"]
        if self.vpp:
            parts.insert(2, f"vpp{self.vpp}")
        if self.moe:
            parts.append(f"ep{self.ep}-{self.moe}")
        return "-".join(parts)


TOPOLOGIES = {
    "dp4": Topology(),
    "tp2-dp2": Topology(tp=2),
    "tp2sp-dp2": Topology(tp=2, sp=True),
    "pp2-dp2": Topology(pp=2),
    "pp2-vpp2-dp2": Topology(pp=2, vpp=2),
    "cp2-dp2": Topology(cp=2),
}  # the 4-rank topologies every Megatron-side test covers


# ---------------------------------------------------------------- process setup

def set_random_seed(seed: int = SEED) -> None:
    """Megatron-LM's ``_set_random_seed``: one seed per pipeline stage, equal across DP and TP.

    The TP/EP offsets of the model-parallel RNG streams come from the (CPU)
    model-parallel seed, as ``model_parallel_cuda_manual_seed`` does on GPUs.
    """
    import numpy as np

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.fsdp.mcore_cpu.cuda_standins import enable_cpu_mode

    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        enable_cpu_mode(seed)  # installs CPU mode on first use, re-seeds after


@contextlib.contextmanager
def parallel(ctx, topology: Topology, seed: int = SEED):
    """Megatron parallel state for ``topology`` on the whole pool, CPU mode and seeds.

    On exit CPU mode is disabled, the parallel state destroyed and its process groups
    released, so the next case in the same worker starts clean.
    """
    from megatron.core import parallel_state as ps
    from megatron.fsdp_training.initialize import gloo_twin_groups
    from megatron.fsdp_training.testing.megatron_case import megatron_case

    world = dist.get_world_size()
    if ctx.size != world:
        raise ValueError(f"Megatron cases must run on the whole pool ({world} ranks), not {ctx.size}")
    topology.dp(world)
    with megatron_case():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=topology.tp,
            pipeline_model_parallel_size=topology.pp,
            virtual_pipeline_model_parallel_size=topology.vpp,
            context_parallel_size=topology.cp,
            expert_model_parallel_size=topology.ep,
            num_distributed_optimizer_instances=topology.instances,
            create_gloo_process_groups=gloo_twin_groups(),
        )
        set_random_seed(seed)
        yield


# ---------------------------------------------------------------- model

def tiny_gpt_config(topology: Topology, **overrides):
    """fp32 4-layer GPT config: no dropout, no CUDA fusions, CPU initialisation.

    ``use_cpu_initialization`` draws each full weight from the CPU generator and
    keeps this TP rank's slice, so TP-partitioned models equal the TP=1 model.
    P2P settings follow Megatron-LM (``overlap_p2p_comm`` on with interleaving,
    ``batch_p2p_comm = not overlap_p2p_comm``). It matters at PP=2 with VPP: both
    directions go to the one peer, and batched ops are matched in issue order, so
    activations and gradients swap silently (Megatron-LM issue #750); the unbatched
    path separates the two directions by group.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    interleaved = topology.vpp is not None

    settings = dict(
        num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        tensor_model_parallel_size=topology.tp,
        pipeline_model_parallel_size=topology.pp,
        virtual_pipeline_model_parallel_size=topology.vpp,
        context_parallel_size=topology.cp,
        sequence_parallel=topology.sp and topology.tp > 1,
        params_dtype=torch.float32, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, use_cpu_initialization=True,
        add_bias_linear=True, normalization="LayerNorm",
        gradient_accumulation_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, cross_entropy_loss_fusion=False,
        deallocate_pipeline_outputs=True,
        overlap_p2p_comm=interleaved, batch_p2p_comm=not interleaved,
    )
    if topology.moe:  # bias-free linears: Megatron-Core 0.16.1's MoE layers reject add_bias_linear
        settings.update(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type=topology.moe,
                        expert_model_parallel_size=topology.ep, add_bias_linear=False,
                        moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="aux_loss",
                        moe_grouped_gemm=False, moe_ffn_hidden_size=settings["ffn_hidden_size"])
    settings.update(overrides)
    return TransformerConfig(**settings)


def build_model_chunks(config, topology: Topology, seed: int = SEED) -> list:
    """One GPTModel per virtual pipeline stage, as Megatron-LM's ``get_model`` builds them.

    Re-seeds first, so every data-parallel replica starts from identical weights.
    Embeddings and output layer are tied (the last stage's copy is synchronised
    with the first stage's at construction, over the embedding group).
    """
    from megatron.fsdp.mcore_cpu.cuda_standins import cpu_layer_spec
    from megatron.fsdp_training.model import gpt_chunks

    set_random_seed(seed)
    return gpt_chunks(config, lambda vp_stage: cpu_layer_spec(config, vp_stage=vp_stage), VOCAB, SEQ_LENGTH)


# ---------------------------------------------------------------- data

def make_batches(steps: int, micro_batches: int, global_micro_batch_size: int,
                 seq_length: int = SEQ_LENGTH, vocab: int = VOCAB,
                 seed: int = DATA_SEED) -> List[List[Dict[str, torch.Tensor]]]:
    """``[step][micro_batch]`` -> dict of full global micro-batches, the same on every rank.

    Sequences count up from a random start by a random stride (1-3) modulo ``vocab``,
    so the next token is learnable and the loss falls within a few steps. About one
    label in eight is masked out of the loss. ``attention_mask`` is Megatron's
    (``[b, 1, s, s]``, True = masked out).
    """
    gen = torch.Generator().manual_seed(seed)
    causal = torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1)
    positions = torch.arange(seq_length)
    batches = []
    for _ in range(steps):
        step = []
        for _ in range(micro_batches):
            b = global_micro_batch_size
            start = torch.randint(0, vocab, (b, 1), generator=gen)
            stride = torch.randint(1, 4, (b, 1), generator=gen)
            seq = (start + stride * torch.arange(seq_length + 1)) % vocab
            step.append({
                "tokens": seq[:, :-1].contiguous(),
                "labels": seq[:, 1:].contiguous(),
                "loss_mask": (torch.rand(b, seq_length, generator=gen) >= 0.125).float(),
                "position_ids": positions.expand(b, seq_length).contiguous(),
                "attention_mask": causal.expand(b, 1, seq_length, seq_length).contiguous(),
            })
        batches.append(step)
    return batches


def data_iterator(batches: List[Dict[str, torch.Tensor]]) -> Iterator[Dict[str, torch.Tensor]]:
    """This DP rank's rows of each global micro-batch (what a distributed sampler yields)."""
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    for batch in batches:
        rows = batch["tokens"].size(0) // dp
        yield {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}


def get_batch(iterator):
    """pretrain_gpt's ``get_batch``: next micro-batch, then this CP rank's sequence chunks."""
    from megatron.core import parallel_state as ps

    from megatron.fsdp.mcore_releases import batch_on_this_cp_rank

    return batch_on_this_cp_rank(dict(next(iterator)), ps.get_context_parallel_group())


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """The training job's own masked token loss (``megatron.fsdp_training.forward_step.loss_func``),
    so both sides of every parity test compute the loss the way pretrain_gpt.py does."""
    from megatron.fsdp_training.forward_step import loss_func as pretrain_loss_func

    return pretrain_loss_func(loss_mask, output_tensor)


def forward_step(data_iterator, model):
    """pretrain_gpt's ``forward_step`` with an explicit attention mask on every stage."""
    batch = get_batch(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


# ---------------------------------------------------------------- training loop

def wire_schedule_hooks(model_chunks: list, config, optimizer) -> None:
    """The ``config`` hooks Megatron-LM's ``train`` sets from the wrapped model chunks.

    ``no_sync``/``start_grad_sync`` only with ``overlap_grad_reduce`` (Megatron-LM's
    ``align_grad_reduce`` defaults on), ``start_param_sync`` only with
    ``overlap_param_gather`` and ``align_param_gather``; ``finalize_model_grads`` always.
    """
    from megatron.core.distributed import finalize_model_grads

    def per_chunk(name):
        funcs = [getattr(m, name) for m in model_chunks]
        return funcs[0] if len(funcs) == 1 else funcs

    ddp_config = getattr(model_chunks[0], "ddp_config", None)
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = config.grad_sync_func = config.param_sync_func = None
    if ddp_config is not None and ddp_config.overlap_grad_reduce:
        config.no_sync_func = per_chunk("no_sync")
        config.grad_sync_func = per_chunk("start_grad_sync")
    if ddp_config is not None and ddp_config.overlap_param_gather and ddp_config.align_param_gather:
        config.param_sync_func = per_chunk("start_param_sync")
    config.finalize_model_grads_func = finalize_model_grads


def _iteration_loss(losses_reduced: list) -> float:
    """Mean of the micro-batch mean losses, averaged over DP, the same on every rank."""
    from megatron.core import parallel_state as ps

    value = torch.zeros(1, dtype=torch.float64)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        reports = torch.stack([r["lm loss"] for r in losses_reduced]).double()
        value[0] = (reports[:, 0] / reports[:, 1].clamp(min=1)).mean()
        dist.all_reduce(value, group=ps.get_data_parallel_group())
        value /= ps.get_data_parallel_world_size()
    dist.broadcast(value, src=ps.get_pipeline_model_parallel_last_rank(),
                   group=ps.get_pipeline_model_parallel_group())
    return float(value)


def train(model_chunks: list, optimizer, config, steps: int, micro_batches: int, scheduler=None,
          data_seed: int = DATA_SEED, wire: Optional[Callable[[list, object, object], None]] = None) -> dict:
    """Megatron-LM's training loop over ``steps`` iterations of ``micro_batches`` micro-batches.

    Each iteration: zero the grad buffers, ``forward_backward_func`` (which calls
    ``config.finalize_model_grads_func``), ``optimizer.step()``, then the scheduler.
    ``wire(model_chunks, config, optimizer)`` sets the schedule hooks on ``config``
    (default ``wire_schedule_hooks``: what Megatron-LM sets for its own DDP).
    Returns ``{"losses": [...], "grad_norms": [...]}``, one float per iteration, equal
    on all ranks.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp = ps.get_data_parallel_world_size()
    batches = make_batches(steps, micro_batches, ROWS_PER_DP_RANK * dp, SEQ_LENGTH, VOCAB, data_seed)
    (wire or wire_schedule_hooks)(model_chunks, config, optimizer)
    forward_backward = get_forward_backward_func()
    for model in model_chunks:
        model.train()
    losses, grad_norms = [], []
    for step in range(steps):
        for model in model_chunks:
            model.zero_grad_buffer()
        optimizer.zero_grad()
        iterators = [data_iterator(batches[step]) for _ in model_chunks]
        losses_reduced = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
            num_microbatches=micro_batches, seq_length=SEQ_LENGTH,
            micro_batch_size=ROWS_PER_DP_RANK, decoder_seq_length=SEQ_LENGTH, forward_only=False)
        ok, grad_norm, _num_zeros = optimizer.step()
        if not ok:
            raise RuntimeError(f"optimizer step {step} was skipped (non-finite gradients?)")
        if scheduler is not None:
            scheduler.step(increment=micro_batches * ROWS_PER_DP_RANK * dp)
        losses.append(_iteration_loss(losses_reduced))
        grad_norms.append(float(grad_norm))
    return {"losses": losses, "grad_norms": grad_norms}


# ---------------------------------------------------------------- the baseline

def optimizer_config(use_distributed_optimizer: bool = False, **overrides):
    """Adam, fp32, constant LR, weight decay 0.1, gradient clipping at 1.0."""
    from megatron.core.optimizer import OptimizerConfig

    settings = dict(optimizer="adam", lr=LR, min_lr=LR, weight_decay=WEIGHT_DECAY,
                    adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=CLIP_GRAD,
                    params_dtype=torch.float32, use_distributed_optimizer=use_distributed_optimizer)
    settings.update(overrides)
    return OptimizerConfig(**settings)


def make_scheduler(optimizer, steps: int = 1000):
    """Constant LR and weight decay; it applies each group's ``wd_mult`` as Megatron-LM's does
    (biases and 1-D parameters are not decayed under ``get_standard_config_overrides``)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0, lr_decay_steps=steps,
        lr_decay_style="constant", start_wd=WEIGHT_DECAY, end_wd=WEIGHT_DECAY,
        wd_incr_steps=steps, wd_incr_style="constant")


def megatron_ddp_run(ctx, topology: Topology, steps: int = STEPS, micro_batches: int = MICRO_BATCHES,
                     use_distributed_optimizer: bool = False, **ddp_overrides) -> dict:
    """Megatron-Core's own DistributedDataParallel + ``get_megatron_optimizer`` on the tiny GPT.

    ``ddp_overrides`` change the DistributedDataParallelConfig (e.g. ``overlap_grad_reduce``).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer, get_standard_config_overrides
    from megatron.fsdp_training.initialize import gloo_twin_groups

    with parallel(ctx, topology):
        config = tiny_gpt_config(topology)
        chunks = build_model_chunks(config, topology)
        settings = dict(grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
                        use_distributed_optimizer=use_distributed_optimizer, check_for_nan_in_grad=True)
        ddp_config = DistributedDataParallelConfig(**{**settings, **ddp_overrides})
        model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                         disable_bucketing=index > 0)
                 for index, chunk in enumerate(chunks)]
        opt_config = optimizer_config(use_distributed_optimizer)
        optimizer = get_megatron_optimizer(opt_config, model, use_gloo_process_groups=gloo_twin_groups(),
                                           config_overrides=get_standard_config_overrides(opt_config))
        result = train(model, optimizer, config, steps, micro_batches,
                       scheduler=make_scheduler(optimizer))
    return result

"""``finalize_model_grads`` for model chunks wrapped by ``FullyShardedDataParallel``.

Plays the role of ``megatron.core.distributed.finalize_model_grads`` (set it as
``config.finalize_model_grads_func``). After the data-parallel reduction the
gradients live in sharded flat buffers; the cross-model-parallel reductions work
on this rank's pieces of them. Tensor-parallel peers and the first/last pipeline
stages lay those parameters out identically, so the pieces line up element by
element and a collective over them is exact.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core.distributed.finalize_model_grads import finalize_model_grads as megatron_core_finalize
from megatron.core.utils import get_attr_wrapped_model

# Set on the trainers' dispatchers (``trainer_backend.finalize_factory``), which wrap Megatron-Core's function and
# call this module's for this backend's chunks: the walk in ``refuse_megatron_core_finalize`` stops there.
DISPATCHES_TO_THIS_BACKEND = "_megatron_fsdp_finalize"


def refuse_megatron_core_finalize(config) -> None:
    """Stop, in one line, a step whose ``config.finalize_model_grads_func`` is Megatron-Core's own function.

    That function reads tied-embedding, sequence-parallel and TP-averaged gradients from ``main_grad`` /
    ``grad``, which this backend's parameters do not carry (their gradients are pieces of sharded flat
    buffers), and skips each one it does not find: the step would train on unsummed gradients without a word.
    Wrappers (``functools.partial``, ``functools.wraps``) are seen through."""
    hook, seen = getattr(config, "finalize_model_grads_func", None), 0
    while hook is not None and seen < 16 and not getattr(hook, DISPATCHES_TO_THIS_BACKEND, False):
        if hook is megatron_core_finalize:
            raise ValueError("config.finalize_model_grads_func is Megatron-Core's finalize_model_grads, which skips "
                             "the cross-stage and tensor-parallel gradient sums of megatron.fsdp's sharded "
                             "gradients; set it to megatron.fsdp.mcore.finalize_model_grads (the runners "
                             "megatron.fsdp.mcore.megatron_lm and bridge.install() do)")
        hook = hook.func if isinstance(hook, functools.partial) else getattr(hook, "__wrapped__", None)
        seen += 1


def _all_reduce_pieces(pieces: List[torch.Tensor], group, op=dist.ReduceOp.SUM) -> None:
    pieces = [p for p in pieces if p.numel()]
    if not pieces:
        # Peers with the same layout own pieces of the same sizes: all empty or none.
        return
    flat = _flatten_dense_tensors(pieces)
    dist.all_reduce(flat, op=op, group=group)
    for piece, synced in zip(pieces, _unflatten_dense_tensors(flat, pieces)):
        piece.copy_(synced)


def _tensor_parallel_grads(model, config, tp_group) -> None:
    """Sequence-parallel norms (summed) and TP-averaged parameters, reduced over tensor parallel ranks."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    summed, averaged = [], []
    for chunk in model:
        for name, param in chunk.fsdp.module.named_parameters():
            if not param.requires_grad:
                continue
            if getattr(param, "average_gradients_across_tp_domain", False):
                averaged.append(chunk.fsdp.main_grad_piece(name))
            elif (config.sequence_parallel and getattr(param, "sequence_parallel", False)) or (
                    getattr(config, "qk_layernorm", False) and ("q_layernorm" in name or "k_layernorm" in name)):
                summed.append(chunk.fsdp.main_grad_piece(name))
    _all_reduce_pieces(summed, tp_group)
    if averaged:
        _all_reduce_pieces(averaged, tp_group)
        size = dist.get_world_size(tp_group)
        for piece in averaged:
            piece.div_(size)


def _embedding_stage_chunk(model, group):
    """``(chunk, module)`` holding this rank's copy of an embedding summed over ``group`` (the first stage's first
    chunk, the last stage's last), or None where the group is trivial or this rank is outside it."""
    if group is None or dist.get_world_size(group) == 1 or dist.get_rank() not in dist.get_process_group_ranks(group):
        return None
    from megatron.core import parallel_state as ps

    chunk = model[0] if ps.is_pipeline_first_stage(ignore_virtual=True) else model[-1]
    return chunk, get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True)


def _tied_embedding_grads(model, config, embd_group) -> None:
    """Sum the shared word-embedding / output-layer gradient over the first and last stage.

    With multi-token prediction the last stage holds a copy of the word embedding (its MTP layers
    embed the shifted tokens) even when the output layer is untied: Megatron-Core sums that copy's
    gradient with the first stage's as well (``_get_shared_word_embedding_weight``)."""
    held = _embedding_stage_chunk(model, embd_group)
    if held is None:
        return
    chunk, module = held
    if not (getattr(module, "share_embeddings_and_output_weights", False) or getattr(config, "mtp_num_layers", None)):
        return
    weight = module.shared_embedding_or_output_weight()
    if weight is None or not weight.requires_grad:
        return
    _all_reduce_pieces([chunk.fsdp.main_grad_piece(chunk.fsdp.param_name(weight))], embd_group)


def _position_embedding_grads(model, pos_embd_group) -> None:
    """Learned absolute position embeddings, summed over Megatron-Core's position-embedding group (the stages
    that hold a copy; only the first stage in Megatron-Core's default layout, where this is a no-op)."""
    held = _embedding_stage_chunk(model, pos_embd_group)
    if held is None:
        return
    chunk, module = held
    embedding = getattr(getattr(module, "embedding", None), "position_embeddings", None)
    if embedding is None or not embedding.weight.requires_grad:
        return
    _all_reduce_pieces([chunk.fsdp.main_grad_piece(chunk.fsdp.param_name(embedding.weight))], pos_embd_group)


def _routers_with_expert_bias(model):
    for chunk in model:
        for module in chunk.fsdp.module.modules():
            if getattr(module, "expert_bias", None) is not None:
                yield module


def _update_router_expert_bias(model, config) -> None:
    """Aux-loss-free balancing: move each router's expert bias against its load, once per step.

    The bias is a buffer, outside the optimizer and outside the flat buffers: every rank holds it
    whole. The tokens each expert received this step are summed over the tensor x data (x context)
    parallel group of this stage, which saw the whole global batch, so every replica computes the
    same update from the same counts and the bias stays identical everywhere, at any level and on
    any mesh (Megatron-Core's ``_update_router_expert_bias``, its ``get_updated_expert_bias``).
    The counts are cleared for the next step with the other per-step tensors (``finalize_model_grads``).
    """
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    routers = list(_routers_with_expert_bias(model))
    if not routers:  # a stage of dense layers only
        return
    counts = torch.stack([router.local_tokens_per_expert for router in routers])
    biases = torch.stack([router.expert_bias for router in routers])
    updated = get_updated_expert_bias(counts, biases, config.moe_router_bias_update_rate)
    for router, bias in zip(routers, updated):
        router.expert_bias.copy_(bias)


def finalize_model_grads(model: List[torch.nn.Module], num_tokens: Optional[torch.Tensor] = None,
                         pg_collection=None, force_all_reduce: Optional[bool] = False) -> None:
    """Finish data-parallel reductions, then the tensor- and pipeline-parallel ones, then token scaling.

    The same reductions, in the same order, as Megatron-Core's ``finalize_model_grads`` for DDP (the trainers'
    runners put this function in its place, ``trainer_backend.finalize_factory``), over this rank's pieces of
    the sharded gradients; the per-step tensors (expert token counts, the global aux-loss tracker) are reset
    by Megatron-Core's own ``reset_model_temporary_tensors``."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    for chunk in model:
        chunk.finish_grad_sync()
    index = model[0].index
    _tensor_parallel_grads(model, config, index.tp)
    _tied_embedding_grads(model, config, index.embd)
    _position_embedding_grads(model, index.pos_embd)
    if getattr(config, "moe_router_enable_expert_bias", False):
        _update_router_expert_bias(model, config)
    reset_model_temporary_tensors(config, model)
    if num_tokens is not None:
        pp_group = index.pp if index.pp is not None else ps.get_pipeline_model_parallel_group()
        last = dist.get_process_group_ranks(pp_group)[-1]
        dist.broadcast(num_tokens, src=last, group=pp_group)
        dist.all_reduce(num_tokens, group=ps.get_data_parallel_group(with_context_parallel=True))
        if num_tokens > 0:
            for chunk in model:
                chunk.scale_gradients(1.0 / num_tokens)

"""What Megatron-LM's trainer and Megatron-Bridge call on Megatron-FSDP, answered by this backend.

Both trainers build Megatron-FSDP's pieces by name (``megatron_lm.py`` and ``bridge.py`` rebind those
names); the functions here are what they get instead, each falling back to the trainer's own function
for a model that is not ``FullyShardedDataParallel``:

- ``optimizer_factory``: ``get_megatron_optimizer`` -> ``get_fsdp_optimizer``, Megatron's standard
  parameter groups (no weight decay for biases and 1-D parameters, ``--decoupled-lr``) taken from the
  trainer's ``config_overrides``; any other override is refused with one line;
- ``finalize_factory``: ``finalize_model_grads`` (both trainers install Megatron-Core's) reads the gradients of
  tied embeddings, sequence-parallel norms and TP-averaged parameters where Megatron-Core's DDP keeps them,
  and skips each one it does not find there, so a pipeline-split tied embedding would go unsummed without
  a word; ours (``finalize.py``) runs the same reductions over this backend's sharded gradients;
- ``params_norm_factory``: ``calc_params_l2_norm`` expects NVIDIA's DTensor parameters; ours is the
  norm of the fp32 main shards (``FullyShardedOptimizer.params_norm``);
- ``fsdp_dtensor_preprocess_factory``: the trainers' ``fsdp_dtensor`` preprocessing (SwiGLU split,
  expert renumbering, uneven-DTensor chunk hooks) exists for NVIDIA's layout; this backend's state dict
  already holds global keys in whole-parameter coordinates, so it is skipped (said once).
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Callable

import torch

from .data_parallel import FullyShardedDataParallel
from .finalize import DISPATCHES_TO_THIS_BACKEND, finalize_model_grads as finalize_sharded_grads
from megatron.fsdp.mcore_cpu.trainer_bridges import print_once  # noqa: F401  (the runners' one-line notices)

from .megatron_optimizer import FullyShardedMegatronOptimizer, get_fsdp_optimizer

# The optimizer built over each wrapped chunk: the params norm is the optimizer's main weights.
_OPTIMIZER_OF: "weakref.WeakKeyDictionary[torch.nn.Module, FullyShardedMegatronOptimizer]" = (
    weakref.WeakKeyDictionary())


def ours(model) -> bool:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return bool(chunks) and all(isinstance(chunk, FullyShardedDataParallel) for chunk in chunks)


def no_weight_decay_rule(config_overrides) -> Callable:
    """The trainer's ``config_overrides`` as the engine's no-weight-decay rule.

    Megatron's standard overrides are ``wd_mult=0`` on a parameter set and ``max_lr``/``min_lr`` on the
    embedding and output layer under ``--decoupled-lr`` (``get_fsdp_optimizer`` reads that from the
    config). Anything else (muP's per-class learning rates and epsilons, a user's own groups) would be
    dropped silently, so it stops the build instead.
    """
    wd_keys, unsupported = [], []
    for key, override in (config_overrides or {}).items():
        fields = dict(override)
        if fields.get("wd_mult") == 0.0:
            wd_keys.append(key)
            fields.pop("wd_mult")
        attr = getattr(key, "attr", ())
        if set(fields) <= {"max_lr", "min_lr"} and ((attr,) if isinstance(attr, str) else tuple(attr)) == (
                "is_embedding_or_output_parameter",):
            fields = {}  # --decoupled-lr's group: get_fsdp_optimizer builds it from the config
        if fields:
            unsupported.append(f"{key}: {fields}")
    if unsupported:
        raise ValueError("megatron.fsdp's optimizer takes Megatron's standard parameter groups (no weight decay "
                         "for biases and 1-D parameters, --decoupled-lr); these optimizer overrides are not "
                         f"supported: {'; '.join(unsupported)}")

    def rule(name: str, param: torch.nn.Parameter) -> bool:
        return any(key.matches(param, name) for key in wd_keys)
    return rule


def build_optimizer(config, model_chunks, config_overrides=None) -> FullyShardedMegatronOptimizer:
    """``get_fsdp_optimizer`` with the trainer's parameter groups (None: Megatron-Core's standard ones, as its
    ``get_megatron_optimizer`` takes them)."""
    if config_overrides is None:
        from megatron.core.optimizer import get_standard_config_overrides

        config_overrides = get_standard_config_overrides(config)
    optimizer = get_fsdp_optimizer(config, list(model_chunks), no_weight_decay_cond=no_weight_decay_rule(
        config_overrides))
    for chunk in model_chunks:
        _OPTIMIZER_OF[chunk] = optimizer
    ddp = model_chunks[0].ddp_config
    print_once(f"> megatron.fsdp: {len(model_chunks)} model chunk(s) at {ddp.data_parallel_sharding_strategy} over "
               f"{model_chunks[0].index.dp_cp_size} data-parallel ranks, optimizer {config.optimizer} over the shards")
    return optimizer


def optimizer_factory(original: Callable) -> Callable:
    """``get_megatron_optimizer(config, model_chunks, config_overrides=None, ...)`` for either backend."""
    @functools.wraps(original)
    def get_megatron_optimizer(config, model_chunks, config_overrides=None, *args, **kwargs):
        if not ours(model_chunks):
            return original(config, model_chunks, config_overrides, *args, **kwargs)
        return build_optimizer(config, model_chunks, config_overrides)
    return get_megatron_optimizer


def finalize_factory(original: Callable) -> Callable:
    """``finalize_model_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False)`` for either
    backend (the trainers call it as ``config.finalize_model_grads_func``, Bridge through a ``partial``)."""
    @functools.wraps(original)
    def finalize_model_grads(model, *args, **kwargs):
        return (finalize_sharded_grads if ours(model) else original)(model, *args, **kwargs)
    setattr(finalize_model_grads, DISPATCHES_TO_THIS_BACKEND, True)
    return finalize_model_grads


def params_norm(model) -> float:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    optimizer = _OPTIMIZER_OF.get(chunks[0])
    if optimizer is None:
        raise RuntimeError("the params norm of a megatron.fsdp model is its optimizer's main weights; "
                           "build the optimizer first (get_megatron_optimizer / get_fsdp_optimizer)")
    return optimizer.engine.params_norm()


def params_norm_factory(original: Callable) -> Callable:
    @functools.wraps(original)
    def calc_params_l2_norm(model, *args, **kwargs):
        return params_norm(model) if ours(model) else original(model, *args, **kwargs)
    return calc_params_l2_norm


def fsdp_dtensor_preprocess_factory(original: Callable) -> Callable:
    """``preprocess_fsdp_dtensor_state_dict(args, state_dict, model)``: the identity for this backend."""
    @functools.wraps(original)
    def preprocess_fsdp_dtensor_state_dict(args, raw_state_dict, model, *rest, **kwargs):
        if not ours(model):
            return original(args, raw_state_dict, model, *rest, **kwargs)
        print_once(" fsdp_dtensor: Megatron-Core's preprocessing for NVIDIA's Megatron-FSDP (SwiGLU split, expert "
                   "renumbering, uneven-DTensor chunks) skipped: megatron.fsdp's state dict already holds global "
                   "keys in whole-parameter coordinates")
        return raw_state_dict.copy()
    return preprocess_fsdp_dtensor_state_dict

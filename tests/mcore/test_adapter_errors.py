"""Every configuration the adapter rejects fails at construction, naming the fix."""

import warnings

import pytest

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.fsdp.mcore.data_parallel import check_configs


def _config(**overrides):
    settings = dict(num_layers=2, hidden_size=16, num_attention_heads=2, gradient_accumulation_fusion=False)
    settings.update(overrides)
    return TransformerConfig(**settings)


def _ddp(**overrides):
    settings = dict(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
    settings.update(overrides)
    return DistributedDataParallelConfig(**settings)


@pytest.mark.parametrize("config, ddp, pattern", [
    (_config(), _ddp(use_megatron_fsdp=False), "use_megatron_fsdp=True"),
    (_config(), _ddp(data_parallel_sharding_strategy="zero3"), "valid strategies are 'no_shard'"),
    (_config(), _ddp(outer_dp_sharding_strategy="optim"), "num_distributed_optimizer_instances > 1"),
    (_config(), _ddp(data_parallel_sharding_strategy="optim", outer_dp_sharding_strategy="optim_grads",
                     num_distributed_optimizer_instances=2), "shards more than inner level"),
    (_config(fp16=True), _ddp(), "use bf16"),
    (_config(gradient_accumulation_fusion=True), _ddp(), "no-gradient-accumulation-fusion"),
])
def test_rejected_configurations(config, ddp, pattern):
    with pytest.raises(ValueError, match=pattern):
        check_configs(config, ddp)


def test_ignored_tuning_field_warns_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_configs(_config(), _ddp(bucket_size=12345))
        check_configs(_config(), _ddp(bucket_size=12345))
    messages = [str(w.message) for w in caught if "bucket_size" in str(w.message)]
    assert len(messages) == 1


@pytest.mark.parametrize("field, value", [("flextron", True), ("gtp_weight_remat_size", 2),
                                          ("expert_gtp_weight_remat_size", 4),
                                          ("moe_router_load_balancing_type", "quantile_balancing")])
def test_newer_gradient_reductions_are_refused(field, value):
    """Megatron-Core 0.18/0.19 features whose gradient reductions this finalize_model_grads lacks (set on the
    config object directly: 0.16.1's TransformerConfig has no such fields, and its validation would refuse some)."""
    config = _config()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=f"TransformerConfig {field}=.*does not run the gradient reductions"):
        check_configs(config, _ddp())


def test_every_megatron_fsdp_field_is_honoured_said_or_refused():
    """Megatron-LM's and Bridge's Megatron-FSDP fields (``ddp_fields.py``), as this release's config has them: each
    substituted one is said in one line naming it, each refused one stops with one line, the trainers' own bucket
    size says nothing, and the gradient-communication dtype is honoured."""
    import torch

    from megatron.fsdp.mcore import ddp_fields
    from megatron.fsdp.mcore.data_parallel import mixed_precision

    fields = DistributedDataParallelConfig.__dataclass_fields__
    said = [f for f, _ in ddp_fields.SUBSTITUTED if f in fields]
    assert {"nccl_ub", "fsdp_manual_registration", "bucket_size"} <= set(said)
    for field in said:
        value = True if isinstance(getattr(_ddp(), field), bool) else 12345
        lines = ddp_fields.substitutions(_ddp(**{field: value}), dp_size=2)
        assert len(lines) == 1 and f"DistributedDataParallelConfig.{field}=" in lines[0], (field, lines)
    assert ddp_fields.substitutions(_ddp(bucket_size=ddp_fields.trainer_bucket_size(2)), dp_size=2) == []
    refused = [f for f, _ in ddp_fields.REFUSED if f in fields]
    assert "delay_wgrad_compute" in refused
    for field in refused:
        with pytest.raises(ValueError, match=field):
            check_configs(_config(), _ddp(**{field: True}))
    if "megatron_fsdp_grad_comm_dtype" in fields:  # Megatron-Core 0.19's fields
        ddp = _ddp(megatron_fsdp_grad_comm_dtype=torch.bfloat16)
        assert mixed_precision(_config(bf16=True), ddp).grad_reduce_dtype == torch.bfloat16
        for field, dtype in (("megatron_fsdp_main_grads_dtype", torch.bfloat16),
                             ("megatron_fsdp_grad_comm_dtype", torch.float16)):
            with pytest.raises(ValueError, match=field):
                check_configs(_config(), _ddp(**{field: dtype}))


def test_megatron_core_finalize_as_the_hook_is_refused_and_the_dispatchers_pass():
    """Why: Megatron-Core's ``finalize_model_grads`` reads ``main_grad``, which sharded parameters lack, and skipped
    the tied-embedding sum across pipeline stages without a word (PP2 grad norm 0.815 for DDP's 1.021)."""
    import functools
    import types

    from megatron.core.distributed import finalize_model_grads as core_finalize

    from megatron.fsdp.mcore import finalize_model_grads
    from megatron.fsdp.mcore.finalize import refuse_megatron_core_finalize
    from megatron.fsdp.mcore.trainer_backend import finalize_factory

    def config(hook):
        return types.SimpleNamespace(finalize_model_grads_func=hook)

    wrapped = functools.wraps(core_finalize)(lambda *args, **kwargs: core_finalize(*args, **kwargs))
    for hook in (core_finalize, functools.partial(core_finalize, pg_collection=None), wrapped):
        with pytest.raises(ValueError, match="set it to megatron.fsdp.mcore.finalize_model_grads"):
            refuse_megatron_core_finalize(config(hook))
    for hook in (None, finalize_model_grads, finalize_factory(core_finalize),
                 functools.partial(finalize_factory(core_finalize), pg_collection=None)):
        refuse_megatron_core_finalize(config(hook))

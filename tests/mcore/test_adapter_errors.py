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

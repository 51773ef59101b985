"""Adapter cases: the tiny GPT of ``megatron/fsdp_training/testing/gpt.py`` trained through ``megatron.fsdp.mcore``.

Everything but the wrapper, the optimizer and the schedule hooks is shared with
the Megatron-Core baseline (``gpt.megatron_ddp_run``), so a difference in losses
or grad norms can only come from the data-parallel backend.
"""

from __future__ import annotations

import collections
from typing import Optional

from megatron.fsdp_training.testing import gpt


def wire_fsdp_hooks(model_chunks, config, optimizer) -> None:
    from megatron.fsdp.mcore import configure_schedule_hooks

    config.grad_scale_func = optimizer.scale_loss
    configure_schedule_hooks(config, model_chunks)


def build(config, topology, strategy: str, outer: Optional[str] = None, instances: int = 1,
          use_pg_collection: bool = False, **ddp_overrides):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.fsdp.mcore import FullyShardedDataParallel, FullyShardedDataParallelConfig, get_fsdp_optimizer

    chunks = gpt.build_model_chunks(config, topology)
    ddp_config = FullyShardedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy,
        outer_dp_sharding_strategy=outer or "no_shard", num_distributed_optimizer_instances=instances,
        grad_reduce_in_fp32=True, check_for_nan_in_grad=True, **ddp_overrides)
    groups = ProcessGroupCollection.use_mpu_process_groups() if use_pg_collection else None
    model = [FullyShardedDataParallel(config, ddp_config, chunk, pg_collection=groups) for chunk in chunks]
    optimizer = get_fsdp_optimizer(gpt.optimizer_config(), model)
    return model, optimizer


def fsdp_run(ctx, topology: gpt.Topology, strategy: str, steps: int = gpt.STEPS, micro_batches: int = gpt.MICRO_BATCHES,
             trace: bool = False, outer: Optional[str] = None, use_pg_collection: bool = False,
             **ddp_overrides) -> dict:
    """``ddp_overrides``: further FullyShardedDataParallelConfig fields (e.g. the expert levels)."""
    with gpt.parallel(ctx, topology):
        config = gpt.tiny_gpt_config(topology)
        model, optimizer = build(config, topology, strategy, outer=outer, instances=topology.instances,
                                 use_pg_collection=use_pg_collection, **ddp_overrides)
        ledger = model[0].fsdp.ledger
        ledger.trace = trace
        result = gpt.train(model, optimizer, config, steps, micro_batches,
                           scheduler=gpt.make_scheduler(optimizer), wire=wire_fsdp_hooks)
        if trace:
            gathers = collections.Counter(e.tag for e in ledger.events if e.kind == "all_gather" and e.axis == "dp_shard")
            result["gathers_per_step"] = {tag: count / steps for tag, count in gathers.items()}
            result["units"] = [u.name for u in model[0].fsdp.units]
            result["resident_after"] = [u.name for m in model for u in m.fsdp.units
                                        if u.storage.levels.inner.shard_params and u.storage.resident]
            result["sections"] = {name: (str(sec.levels), sec.inner.size, sec.outer.size)
                                  for name, sec in model[0].fsdp.sections.items()}
            result["expert_params"] = [n for u in model[0].fsdp.units if u.storage.section == "expert"
                                       for n in u.param_names]
    return result

"""Megatron-Core DDP baseline runs, computed once per session and shared by every module.

``test_baseline`` checks the baseline on its own, ``test_adapter`` and ``test_moe``
compare the adapter with it; each Megatron run costs seconds, so a topology's baseline
is trained once, in whichever 4-rank pool asks first (the results do not depend on the
pool: same seeds, same data, same ranks), and every later request reads it back.
"""

from __future__ import annotations

from typing import Dict, List

from megatron.fsdp_training.testing.gpt import MICRO_BATCHES, STEPS, Topology, megatron_ddp_run


_runs: Dict[tuple, List[dict]] = {}


def megatron_ddp(pool, topology: Topology, use_distributed_optimizer: bool = False, **overrides) -> List[dict]:
    """Per-rank results of ``gpt.megatron_ddp_run`` for ``topology`` (``gpt.STEPS`` steps of ``gpt.MICRO_BATCHES`` micro-batches)."""
    key = (topology, use_distributed_optimizer, tuple(sorted(overrides.items())))
    if key not in _runs:
        _runs[key] = pool.run(megatron_ddp_run, timeout=300, topology=topology, steps=STEPS,
                              micro_batches=MICRO_BATCHES, use_distributed_optimizer=use_distributed_optimizer,
                              **overrides)
    return _runs[key]

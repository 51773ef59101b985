"""The job's context-parallel split of a batch, on every rank of a CP 2 x DP 2 pool.

Megatron-Core 0.18 changed ``get_batch_on_this_cp_rank`` so that a call without a group splits
over the whole world (``megatron/fsdp/mcore_releases.py``); this case returns what each rank's
``get_batch`` (the training job's, ``megatron/fsdp_training/data/datasets.py``) got, next to the
unsplit batch of its data-parallel rank, and the test checks the slices.
"""

from __future__ import annotations

from typing import Dict


def cp_batch_slices(ctx) -> Dict[str, object]:
    from megatron.core import parallel_state as ps
    from megatron.fsdp_training.data.datasets import get_batch
    from megatron.fsdp_training.testing.gpt import Topology, data_iterator, make_batches, parallel

    topology = Topology(cp=2)
    with parallel(ctx, topology):
        dp = topology.dp(ctx.size)
        unsplit = next(data_iterator(make_batches(1, 1, global_micro_batch_size=2 * dp)[0]))
        got = get_batch(iter([dict(unsplit)]))
        return {"cp_rank": ps.get_context_parallel_rank(), "cp_size": ps.get_context_parallel_world_size(),
                "dp_rank": ps.get_data_parallel_rank(),
                "unsplit": {k: v.tolist() for k, v in unsplit.items()},
                "got": {k: v.tolist() for k, v in got.items()}}

"""A model larger than a rank's memory limit: built on meta, trained at ZeRO-3 with Adam, saved and
resumed exactly, on 4 ranks each limited below the model's full fp32 size; the eager build of the same
model fails under the same limit. How the limit is set, and why so: ``tools/meta_init_limit.py``."""

import shutil

from megatron.fsdp_training.testing import pools
from tools import meta_init_limit as cases

# 48M parameters: 192 MiB in fp32. The run's data segment peaks ~0.82 of it above the warmed-up process on
# Python 3.11 and 3.12 (`python tools/meta_init_limit.py` prints each rank's peak); the eager build needs at least
# 1.12 (the fp32 model, then its shard).
MODEL = dict(vocab=4096, hidden=768, heads=12, layers=8)
BUDGET = 0.9
POOL = (4, "memory-limit")  # its own workers: the limit and the allocator setting stay with them


def test_a_model_larger_than_the_limit_trains_saves_and_resumes(tmp_path):
    try:
        results = pools.pool_of(*POOL).run(cases.trains_under_limit, size=4, timeout=150, path=str(tmp_path),
                                           model=MODEL, budget_fraction=BUDGET)
    finally:
        pools.close(POOL)
        shutil.rmtree(tmp_path, ignore_errors=True)  # ~0.4 GB of checkpoints
    for rank, r in enumerate(results):
        assert r["budget_bytes"] < r["model_bytes"], r
        assert r["straight"][cases.SAVED_AFTER:] == r["resumed"], f"rank {rank}: losses after resume differ: {r}"
        assert r["same_state"], f"rank {rank}: weights or optimizer state after resume differ from the straight run"
        error = r["eager_error"] or ""
        assert "allocate memory" in error or error.startswith("MemoryError"), \
            f"rank {rank}: the eager build did not fail for memory under the limit: {r['eager_error']}"

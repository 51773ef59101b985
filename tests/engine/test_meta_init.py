"""Meta-device initialisation: the sharded weights equal an eager build's, bitwise, with less memory.

The matrix (every level x world sizes 1-4 x flat and 2 x 2 meshes x dense and expert
sections) is sampled: each pool call checks several configurations on one world size,
and every level appears on every topology somewhere.
"""

import pytest

from megatron.fsdp.sharding.strategy import STRATEGIES
from tests.cases import meta_init as cases
from megatron.fsdp_training.testing.pools import pool_of


LEVELS = list(STRATEGIES)

# world size -> configurations (inner level, outer level on the 2 x 2 mesh or None, experts)
MATRIX = {
    1: [(lvl, None, False) for lvl in LEVELS],
    2: [(lvl, None, lvl in ("optim", "optim_grads_params")) for lvl in LEVELS],
    3: [(lvl, None, lvl in ("no_shard", "optim_grads")) for lvl in LEVELS],
    4: [(lvl, None, True) for lvl in LEVELS]
       + [("optim_grads_params", "no_shard", False), ("optim_grads_params", "optim", True),
          ("optim_grads_params", "optim_grads_params", False), ("optim_grads", "optim", False),
          ("optim", "optim", True), ("no_shard", "no_shard", True)],
}


@pytest.mark.parametrize("world_size", sorted(MATRIX))
def test_meta_build_equals_eager_bitwise(pool, world_size):
    train = MATRIX[world_size][-1 if world_size == 4 else world_size - 1]
    results = pool.run(cases.meta_matches_eager, size=world_size, timeout=180,
                       configs=MATRIX[world_size], train=train)
    for rank, result in enumerate(results):
        assert result["checked"] > 0 and result["tied"], result
        bad = {cfg: diff for cfg, diff in result["differences"].items() if diff}
        assert not bad, f"rank {rank}: meta build differs from eager: {bad}"
        eager_losses, meta_losses = result["losses"]
        assert eager_losses == meta_losses, f"rank {rank}: training after a meta build diverged"
        assert not result["after_training"], result["after_training"]


# every level, flat and on the 2 x 2 mesh, with and without an expert section
PEAK_CONFIGS = [("optim_grads_params", None, False), ("no_shard", None, False), ("optim", None, True),
                ("optim_grads", None, False), ("optim_grads_params", "optim_grads_params", False),
                ("optim_grads_params", "no_shard", True)]


def test_meta_build_peak_memory_is_bounded():
    """With glibc's defaults (no allocator setting, no environment variable), on 4 ranks: a meta build's
    resident peak is at most this rank's persistent state after the build plus the largest unit in fp32
    (+5%), and what stays resident is the persistent state (+5%); the eager build holds the whole model.

    On fresh workers of its own: the heap that hundreds of earlier cases fragmented is not the build's."""
    for rank, r in enumerate(pool_of(4, "build-peak").run(cases.build_peak, size=4, timeout=180, configs=PEAK_CONFIGS)):
        eager = r.pop(str(PEAK_CONFIGS[0]) + " eager")
        assert eager["peak"] >= eager["model"], eager  # the instrument sees the full model in the eager build
        assert r.pop("report_repr").endswith("optimizer_state=0) (optimizer_state is 0: no optimizer was passed; "
                                             "memory_report(optimizer) counts its state)")
        for cfg, m in r.items():
            bound = 1.05 * (m["persistent"] + m["largest_unit"])
            assert m["peak"] <= bound, f"rank {rank} {cfg}: meta build peak {m['peak'] / 2**20:.1f} MiB > " \
                                       f"{bound / 2**20:.1f} MiB (persistent + largest unit, +5%): {m}"
            assert m["after"] <= 1.05 * m["persistent"], \
                f"rank {rank} {cfg}: {m['after'] / 2**20:.1f} MiB resident after the build, persistent " \
                f"{m['persistent'] / 2**20:.1f} MiB: {m}"


@pytest.mark.parametrize("case, pattern", [
    ("buffer_without_init", r"ValueError: buffer 'table' is on the meta device and _NoInit has no "
                            r"reset_parameters\(\).*init_weights=fn"),
    ("buffer_not_set", r"ValueError: buffer 'table' of <root> \(_ForgetsBuffer\) was on the meta device and "
                       r"_ForgetsBuffer.reset_parameters\(\) did not set it"),
    ("init_raises", r"RuntimeError: meta-device initialisation of linear \(Linear\) failed in init_weights: "
                    r"KeyError: 'no rule for Linear'"),
])
def test_meta_errors_before_any_collective(pool, case, pattern):
    messages = pool.run(cases.meta_error, size=3, timeout=60, case=case)
    for message in messages:
        assert message is not None, f"{case}: nothing was raised"
        assert __import__("re").search(pattern, message), message

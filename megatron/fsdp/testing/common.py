"""What tests of every layer share: the four levels and the relative error of a number."""

from megatron.fsdp.sharding.strategy import STRATEGIES


LEVELS = list(STRATEGIES)  # no_shard, optim, optim_grads, optim_grads_params: the engine's own list


def rel(a: float, b: float) -> float:
    """|a - b| relative to |b| (b = 0 counts as 1e-12)."""
    return abs(a - b) / max(abs(b), 1e-12)

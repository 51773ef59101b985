"""ZeRO levels as a value: which of params, grads and optimizer state are sharded.

Keeping the level a small table (rather than branching on its name everywhere)
lets every other module ask one question, e.g. ``strategy.shard_grads``, and
keeps two-axis meshes a matter of choosing one row per axis.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ShardingStrategy:
    name: str
    shard_optim: bool
    shard_grads: bool
    shard_params: bool

    @property
    def keeps_full_grads(self) -> bool:
        """Full-size gradient accumulators live across micro-batches (no_shard, optim).

        Only these levels can defer gradient reduction to the last micro-batch;
        the grad-sharded levels must reduce-scatter every micro-batch to free the
        full gradient.
        """
        return not self.shard_grads

    def __str__(self) -> str:
        return self.name


NO_SHARD = ShardingStrategy("no_shard", False, False, False)
OPTIM = ShardingStrategy("optim", True, False, False)
OPTIM_GRADS = ShardingStrategy("optim_grads", True, True, False)
OPTIM_GRADS_PARAMS = ShardingStrategy("optim_grads_params", True, True, True)

STRATEGIES = {s.name: s for s in (NO_SHARD, OPTIM, OPTIM_GRADS, OPTIM_GRADS_PARAMS)}


def parse_strategy(value) -> ShardingStrategy:
    """Accept a level name or a ``ShardingStrategy``; reject anything else by name."""
    if isinstance(value, ShardingStrategy):
        return value
    if isinstance(value, str) and value in STRATEGIES:
        return STRATEGIES[value]
    raise ValueError(
        f"unknown sharding strategy {value!r}; valid strategies are "
        + ", ".join(repr(n) for n in STRATEGIES)
        + " (DDP, ZeRO-1, ZeRO-2, ZeRO-3)"
    )

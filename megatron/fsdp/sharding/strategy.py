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
_ORDER = {name: k for k, name in enumerate(STRATEGIES)}


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


@dataclasses.dataclass(frozen=True)
class MeshStrategy:
    """One level per data-parallel axis: inner (``dp_shard``) and outer (``dp_outer``).

    The outer level may shard at most what the inner level shards: an outer
    axis cannot split a tensor the inner axis keeps whole. HSDP is
    ``(optim_grads_params, no_shard)``, HFSDP ``(optim_grads_params, optim)``.
    A flat mesh is an outer axis of size one at ``no_shard``.
    """

    inner: ShardingStrategy
    outer: ShardingStrategy = NO_SHARD

    def __str__(self) -> str:
        return f"{self.inner.name} x {self.outer.name}"


def valid_pairs():
    return [(i, o) for i in STRATEGIES for o in STRATEGIES if _ORDER[o] <= _ORDER[i]]


def parse_mesh_strategy(inner, outer, has_outer_axis: bool) -> MeshStrategy:
    inner_level = parse_strategy(inner)
    if outer is None:
        return MeshStrategy(inner_level, NO_SHARD)
    outer_level = parse_strategy(outer)
    if not has_outer_axis and outer_level is not NO_SHARD:
        raise ValueError(
            f"outer_strategy={outer_level.name!r} needs an outer data-parallel axis; pass "
            "mesh=megatron.fsdp.build_mesh(outer=M) (or a DataParallelMesh with an outer group), "
            "or leave outer_strategy unset")
    if _ORDER[outer_level.name] > _ORDER[inner_level.name]:
        pairs = ", ".join(f"({i}, {o})" for i, o in valid_pairs())
        raise ValueError(
            f"outer level {outer_level.name!r} shards more than inner level {inner_level.name!r}; "
            f"valid (inner, outer) pairs are: {pairs}")
    return MeshStrategy(inner_level, outer_level)

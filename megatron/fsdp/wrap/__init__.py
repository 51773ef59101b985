"""Wrapping: ``fully_shard`` builds the wrapper once; ``FullyShardedModule`` is what the user calls.

Owns ``build`` (find units, lay out buffers, install hooks) and ``module`` (the wrapper's public
methods: no_sync, state dicts, memory report, ledger).

May import: ``collectives``, ``precision``, ``sharding``, ``schedule``, ``init``, ``checkpoint``.
"""

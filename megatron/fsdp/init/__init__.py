"""Initialisation: building a sharded model from meta-device modules, equal replicas, start-up checks.

Owns ``meta_init`` (materialise one submodule at a time, straight into the shards), ``replicas``
(rank 0's values on every replica at wrap time) and ``validation`` (the checks that must fail before
the first collective).

May import: ``collectives``.
"""

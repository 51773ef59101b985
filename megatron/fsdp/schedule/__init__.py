"""The schedule: a unit's explicit state machine and the hooks that drive it around forward and backward.

Owns ``unit`` (one FSDP unit and its ``UnitState`` transitions) and ``runtime`` (gather, release,
reduce, prefetch and overlap, in the order units run).

May import: ``collectives``, ``sharding``.
"""

"""Optimizers over the flat fp32 shards: ``FullyShardedOptimizer`` and the per-matrix (Muon) family.

Owns the elementwise optimizer (``optimizer``), the matrix optimizer on one owner per matrix
(``matrix_optimizer``, ``matrix_whole``), its pure plan (``matrix_plan``) and its checkpoint entries
(``matrix_checkpoint``).

May import: ``collectives``, ``precision``, ``sharding``, ``checkpoint``, ``wrap``.
"""

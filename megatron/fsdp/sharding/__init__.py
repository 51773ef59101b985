"""The sharding core: what is sharded where, as values and flat storage.

Owns the ZeRO levels per axis (``strategy``), the two-axis process mesh (``mesh``), the pure
flat-buffer layout of a unit (``layout``), which ranges each rank keeps (``regions``), expert
sections (``experts``) and the flat buffers themselves with the data movement on them (``buffers``).

May import: ``collectives``.
"""

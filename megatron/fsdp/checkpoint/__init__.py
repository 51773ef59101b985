"""Checkpoints: state dicts in logical per-parameter coordinates, independent of layout, level and mesh.

Owns the DCP state dicts of the model and optimizer (``state_dict``), the metadata checks made before
anything is read (``metadata``), how one rank's flat piece looks to DCP (``pieces``), the full
unsharded state (``full_state``) and the host buffers saves copy into (``staging``).

May import: ``collectives``, ``precision``, ``sharding``, ``schedule``.
"""

"""Collectives: every byte the engine moves between ranks, and the ledger that counts it.

Owns the per-axis collectives (``comm``), gloo's scattering reduce-scatter ring
(``gloo_ring``), shutting down with nothing in flight (``teardown``), the named ranges
and timeline of every collective (``profiling``) and the one predicate by which the engine runs
as a simulation, fake tensors on torch's fake process group (``simulation``).

May import: torch only. Every other engine package may import this one.
"""

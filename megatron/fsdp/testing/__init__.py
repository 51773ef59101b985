"""The engine's multi-process test harness, shared by the test suite and the benchmarks (as ``torch.testing``).

Owns the pool of gloo worker processes started once and reused by many cases (``pool``), a
worker's settings (``worker_setup``), and the engine-level cases and models that tools run too
(``models``, ``engine_training``, ``engine``, ``common``); what only the tests use lives in ``tests/``.
Installed, so that ``tools/`` and ``examples/`` never import ``tests/``.

May import: torch and ``megatron.fsdp`` (never Megatron-Core: that side is ``megatron.fsdp_training.testing``).
"""

from .pool import RankError, WorkerPool, WorkerTimeout

__all__ = ["RankError", "WorkerPool", "WorkerTimeout"]

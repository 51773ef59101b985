"""A pool of gloo worker processes, started once and reused by many tests."""

from .pool import RankError, WorkerPool, WorkerTimeout

__all__ = ["RankError", "WorkerPool", "WorkerTimeout"]

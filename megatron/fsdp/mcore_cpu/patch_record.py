"""The record of what the adapter replaces in other packages (``Patches``).

CPU mode (``cuda_standins.py``) bridges Megatron-Core's CUDA assumptions, and the trainer runners
(``megatron_lm.py``, ``bridge.py``) rebind the module-global names by which Megatron-LM's trainer and
Megatron-Bridge pick their data-parallel class and optimizer (they have no hook). The runners' rebindings go
through ``PATCHES`` so that each happens once (``install()`` is idempotent), can be undone (``uninstall()``, for
a long-lived process or a test) and is listed in one place (``installed()``); CPU mode keeps a record of its own,
undone by ``disable_cpu_mode``.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Dict, List, Tuple

_MISSING = object()


class Patches:
    """Attributes replaced in other modules, each with its value from before the first replacement."""

    def __init__(self) -> None:
        self._saved: Dict[Tuple[int, str], Tuple[Any, str, Any]] = {}
        self._done: set = set()

    def set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.setdefault((id(owner), name), (owner, name, getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    def original(self, owner: Any, name: str) -> Any:
        """The value before ``set`` replaced it (the current one when it was not replaced)."""
        saved = self._saved.get((id(owner), name))
        return getattr(owner, name) if saved is None else saved[2]

    @contextlib.contextmanager
    def temporarily(self, owner: Any, name: str, value: Any):
        before = getattr(owner, name, _MISSING)
        setattr(owner, name, value)
        try:
            yield
        finally:
            if before is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, before)

    def once(self, key: str) -> bool:
        """True the first time ``key`` is asked for (until ``restore``)."""
        if key in self._done:
            return False
        self._done.add(key)
        return True

    def installed(self) -> List[str]:
        return sorted(f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"
                      for owner, name, _ in self._saved.values())

    def restore(self) -> None:
        for owner, name, original in reversed(list(self._saved.values())):
            if original is not _MISSING:
                setattr(owner, name, original)
            elif hasattr(owner, name):
                delattr(owner, name)
        self._saved.clear()
        self._done.clear()


PATCHES = Patches()
once = PATCHES.once


def rebind(name: str, value: Any, *modules: str) -> None:
    """Rebind ``name`` in each importable module of ``modules`` that has it (a ``from x import name`` copy)."""
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            PATCHES.set(module, name, value)


def use_shipped_dataset_helpers(*copies: str) -> None:
    """``compile_helpers`` runs ``make`` in Megatron-Core's dataset folder; the wheel ships the built
    extension and no Makefile, so the call fails there. Build only when the extension does not import.
    ``copies``: modules that imported the name (Bridge's ``initialize``)."""
    from megatron.core.datasets import utils as dataset_utils

    if once("dataset_helpers"):
        original = dataset_utils.compile_helpers

        def compile_helpers():
            try:
                importlib.import_module("megatron.core.datasets.helpers_cpp")
            except ImportError:
                original()

        PATCHES.set(dataset_utils, "compile_helpers", compile_helpers)
    rebind("compile_helpers", dataset_utils.compile_helpers, *copies)

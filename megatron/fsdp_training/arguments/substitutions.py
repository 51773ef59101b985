"""Flags that select a kernel or backend this machine lacks: accepted, substituted, and said once in one line.

A Megatron-LM launch script asks for Transformer Engine, flash attention, fused kernels, NCCL
features, DeepEP dispatchers. Where the choice only picks a faster implementation of the same
mathematics, the job runs the implementation this machine has and says so once, at start-up,
on rank 0, in one line::

    > substituted on this machine: --use-flash-attn -> PyTorch SDPA (flash-attn not installed); ...

A flag that would change the mathematics is not substituted: ``validate_args`` refuses it with
one line instead. Each concern module of this package states its own substitutions (a provider: a
function of the parsed arguments returning ``Substitution`` values); ``parser.py`` registers them in
the order the line says them, so this module imports none of them and they all import
``Substitution`` from here (docs/arguments.md, "Coming from Megatron-LM").
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable, List, Sequence


@dataclasses.dataclass(frozen=True)
class Substitution:
    """``flag`` as the user wrote it, what runs ``instead``, and ``why`` (what this machine lacks)."""

    flag: str
    instead: str
    why: str

    def __str__(self) -> str:
        return f"{self.flag} -> {self.instead} ({self.why})"


Provider = Callable[[argparse.Namespace], List[Substitution]]

_PROVIDERS: List[Provider] = []


def register_providers(providers: Sequence[Provider]) -> None:
    """The providers of the one line, in its order (``parser.py`` registers every concern's when imported)."""
    _PROVIDERS[:] = providers


def substitutions(args: argparse.Namespace, providers: Sequence[Provider] = None) -> List[Substitution]:
    """Every substitution the parsed arguments need on this machine, in the providers' order."""
    return [s for provider in (_PROVIDERS if providers is None else providers) for s in provider(args)]


def substitution_line(args: argparse.Namespace, providers: Sequence[Provider] = None) -> str:
    """The one start-up line (empty when nothing is substituted)."""
    found = substitutions(args, providers)
    return "> substituted on this machine: " + "; ".join(map(str, found)) if found else ""

"""Flags that select a kernel or backend this machine lacks: accepted, substituted, and said once in one line.

A Megatron-LM launch script asks for Transformer Engine, flash attention, fused kernels, NCCL
features, DeepEP dispatchers. Where the choice only picks a faster implementation of the same
mathematics, the job runs the implementation this machine has and says so once, at start-up,
on rank 0, in one line::

    > substituted on this machine: --use-flash-attn -> PyTorch SDPA (flash-attn not installed); ...

A flag that would change the mathematics is not substituted: ``validate_args`` refuses it with
one line instead. Each group of flags states its own substitutions (a provider: a function of the
parsed arguments returning ``Substitution`` values); ``PROVIDERS`` lists them, so the one line is
assembled in one place.
"""

from __future__ import annotations

import argparse
from typing import Callable, List, Tuple

from .fp8 import fp8_substitutions
from .megatron_lm import compat_substitutions
from .fsdp_recipe import fsdp_recipe_substitutions
from .megatron_fsdp import megatron_fsdp_substitutions
from ..moe_dispatch import moe_dispatcher_substitutions
from ..profiling import profiling_substitutions
from .substitution_record import Substitution


Provider = Callable[[argparse.Namespace], List[Substitution]]


PROVIDERS: Tuple[Provider, ...] = (compat_substitutions, profiling_substitutions, fsdp_recipe_substitutions,
                                 megatron_fsdp_substitutions, moe_dispatcher_substitutions, fp8_substitutions)


def substitutions(args: argparse.Namespace, providers: Tuple[Provider, ...] = None) -> List[Substitution]:
    """Every substitution the parsed arguments need on this machine, in the providers' order."""
    return [s for provider in (PROVIDERS if providers is None else providers) for s in provider(args)]


def substitution_line(args: argparse.Namespace, providers: Tuple[Provider, ...] = None) -> str:
    """The one start-up line (empty when nothing is substituted)."""
    found = substitutions(args, providers)
    return "> substituted on this machine: " + "; ".join(map(str, found)) if found else ""

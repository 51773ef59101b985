"""Where a state dict's copies go: fresh tensors, or host buffers kept from one save to the next.

Why: the engine's state dicts hold copies, never views of live storage (see
``checkpoint/state_dict.py``). A synchronous save can let them be freed afterwards, but an
asynchronous save makes them every time training is blocked: a fresh allocation of
one checkpoint's worth of host memory per save costs page faults (each first touch
of a fresh page zeroes it) on top of the copy itself, and on a GPU pinning fresh
memory costs more still. ``StagingArena`` keeps the host memory: one tensor per
value, handed out in the order the state dict asks for them (the same order and
shapes at every save), so once a round has run the copies go into memory that is
already mapped (and pinned); ``async_save`` runs that first round at start-up.

``staged_copy`` is what the engine's state-dict functions call for each value.
A context variable (not an argument) selects the arena: the state dicts are
built through ``nn.Module.state_dict`` and the optimizer wrappers, whose
signatures are not ours to extend; outside ``staging_into`` nothing changes.

Safe reuse needs one rule, kept by the caller (``megatron/fsdp_training/checkpointing/async_save.py``):
the next save into an arena starts only after the writer of the previous one has
finished reading it.

Deferred copies (``staging_into(arena, defer=True)``): values the caller marks
``stable`` (fp32 main weights and optimizer state, which only the optimizer step
changes) are not copied at once; the arena records them and ``copy_deferred``
(called by the background writer, while the next forward and backward run) copies
them. Why: on CPU the copy of one checkpoint's worth of host memory was the
training thread's whole remaining cost of an async save (0.6-0.75 s of a 51 M
model on 4 ranks, 2 loaded cores) while a forward and backward take many times
that. The rule that makes it safe, kept by the caller: nothing changes a deferred
value (no optimizer step, no load) until ``copy_deferred`` has returned.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

_ARENA: "contextvars.ContextVar[Optional[StagingArena]]" = contextvars.ContextVar("staging_arena", default=None)


class StagingArena:
    """Host tensors reused across saves: the i-th value a round asks for gets the i-th slot.

    One tensor per value (not views of one flat buffer): DCP's writer clones a view
    whose storage is larger than itself before ``torch.save``, so separate storages
    spare the writer a copy. A slot whose element count or dtype no longer fits is
    replaced (counted in ``replaced``).
    """

    def __init__(self, pin: bool = False):
        self.pin = pin
        self.defer = False  # set by ``staging_into``: stable values are copied by ``copy_deferred``
        self._deferred: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (slot view, live value) of this round
        self._slots: List[torch.Tensor] = []
        self._cursor = 0
        self.replaced = 0  # slots allocated after the first round (sizes changed between saves)
        self.rounds = 0
        self._pieces: Dict[int, Tuple[Any, torch.Tensor, Any]] = {}  # slot index: (description, slot, DTensor)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._slots)

    def begin(self, defer: bool = False) -> None:
        """A new round (one save): slots are handed out from the first again."""
        self._cursor = 0
        self.defer = defer
        self._deferred = []

    def end(self) -> None:
        del self._slots[self._cursor:]  # values this round did not ask for
        self._pieces = {i: v for i, v in self._pieces.items() if i < self._cursor}
        self.rounds += 1

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor of ``shape`` and ``dtype`` (last round's contents)."""
        numel, i = math.prod(shape), self._cursor
        self._cursor += 1
        if i < len(self._slots) and self._slots[i].numel() == numel and self._slots[i].dtype == dtype:
            return self._slots[i].view(tuple(shape))
        slot = torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.pin)
        if i < len(self._slots):
            self._slots[i] = slot
            self.replaced += 1
        else:
            self._slots.append(slot)
            self.replaced += self.rounds > 0
        return slot.view(tuple(shape))

    def copy(self, value: torch.Tensor, dtype: Optional[torch.dtype] = None, stable: bool = False) -> torch.Tensor:
        """A slot holding ``value`` (in ``dtype``); a ``stable`` value in a deferring round: once
        ``copy_deferred`` has run."""
        out = self.take(value.shape, dtype or value.dtype)
        if stable and self.defer:
            self._deferred.append((out, value.detach()))
            return out
        return out.copy_(value.detach(), non_blocking=self.pin)  # the caller synchronises a device once

    @property
    def deferred_bytes(self) -> int:
        return sum(out.numel() * out.element_size() for out, _ in self._deferred)

    def copy_deferred(self) -> None:
        """Copy the round's deferred values into their slots (any thread; torch's copies release the GIL)."""
        deferred, self._deferred = self._deferred, []
        for out, value in deferred:
            out.copy_(value)

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.take((numel,), dtype).zero_()

    def piece(self, value: torch.Tensor, dtype: Optional[torch.dtype], description: Tuple,
              build: Callable[[torch.Tensor], Any], stable: bool = False) -> Any:
        """``build(copy of value)`` (a DTensor piece), kept with its slot: the next round that copies into the
        same slot for the same description gets the same object back, its data the slot's new contents
        (building DCP's description of a piece costs more than the copy of a small one)."""
        i = self._cursor
        return self._kept_or_built(i, self.copy(value, dtype, stable), description, build)

    def zeros_piece(self, numel: int, dtype: torch.dtype, description: Tuple,
                    build: Callable[[torch.Tensor], Any]) -> Any:
        """``piece`` of zeros (optimizer state before the first step), kept like a copied piece: the first
        save after the start-up round then reuses the description, not only the memory."""
        i = self._cursor
        return self._kept_or_built(i, self.zeros(numel, dtype), description, build)

    def _kept_or_built(self, i: int, local: torch.Tensor, description: Tuple, build: Callable) -> Any:
        kept = self._pieces.get(i)
        if kept is not None and kept[0] == description and kept[1] is self._slots[i]:
            return kept[2]
        built = build(local)
        self._pieces[i] = (description, self._slots[i], built)
        return built


@contextlib.contextmanager
def staging_into(arena: StagingArena, defer: bool = False) -> Iterator[StagingArena]:
    """State dicts built inside copy their values into ``arena`` (host memory kept between saves); with
    ``defer``, stable values only once ``arena.copy_deferred()`` runs (module docstring)."""
    arena.begin(defer)
    token = _ARENA.set(arena)
    try:
        yield arena
    finally:
        _ARENA.reset(token)
        arena.end()


def staged_copy(value: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A copy of ``value`` (in ``dtype``): into the active arena, or a fresh tensor beside ``value``."""
    arena = _ARENA.get()
    if arena is None:
        return value.detach().to(dtype=dtype or value.dtype, copy=True)
    return arena.copy(value, dtype)


def staged_piece(value: torch.Tensor, shape, lo: int, placement=None, dtype: Optional[torch.dtype] = None,
                 stable: bool = False):
    """``sharded_piece`` of a copy of ``value`` (``dcp_pieces``); in an arena the piece is reused across saves.
    ``stable``: only an optimizer step changes ``value`` (its copy may be deferred: module docstring)."""
    from .pieces import sharded_piece

    arena = _ARENA.get()
    if arena is None:
        return sharded_piece(staged_copy(value, dtype), shape, lo, placement)
    return arena.piece(value, dtype, (tuple(shape), lo, placement),
                       lambda local: sharded_piece(local, shape, lo, placement), stable)


def staged_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    arena = _ARENA.get()
    return torch.zeros(numel, dtype=dtype, device=device) if arena is None else arena.zeros(numel, dtype)


def staged_zeros_piece(numel: int, dtype: torch.dtype, device: torch.device, shape, lo: int, placement=None):
    """``sharded_piece`` of ``numel`` zeros; in an arena kept across saves like ``staged_piece``."""
    from .pieces import sharded_piece

    arena = _ARENA.get()
    if arena is None:
        return sharded_piece(torch.zeros(numel, dtype=dtype, device=device), shape, lo, placement)
    return arena.zeros_piece(numel, dtype, (tuple(shape), lo, placement),
                             lambda local: sharded_piece(local, shape, lo, placement))

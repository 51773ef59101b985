"""``--exit-signal-handler``: on SIGTERM, save a checkpoint at the next iteration boundary, then exit.

Why at the boundary and on every rank: a signal reaches each rank at its own moment
(or only some ranks: a scheduler may signal one process group member), and a save is
a collective. The handler only records the signal; at the end of every iteration all
ranks agree (one all-reduce of a flag, MAX) whether any rank received it, so they all
save the same iteration and leave the loop together. Megatron-LM's flag and behaviour.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class ExitSignalHandler:
    """Records ``sig`` instead of dying of it; ``any_rank_received()`` is the collective check."""

    def __init__(self, sig: int = signal.SIGTERM):
        self.sig = sig
        self.received = False
        self._previous = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True

    def any_rank_received(self) -> bool:
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        """Put the previous handler back."""
        signal.signal(self.sig, self._previous)

"""One rank of a world of any size, in this process: torch's fake process group and fake tensors.

Why: what a configuration keeps, allocates and sends at 1,024 ranks is decided by code that runs per rank; the fake
backend (``torch.testing._internal.distributed.fake_pg``, the one torchtitan's memory estimator uses) lets that code
run as rank R of N with no peer, every collective returning at once, and ``FakeTensorMode`` gives every tensor its
shape, dtype and device but no memory. Inputs the data pipeline makes from NumPy (a micro-batch of token ids) are
real and small; they become fake where they meet the model.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode


@contextlib.contextmanager
def simulated_rank(world_size: int, rank: int) -> Iterator[None]:
    """Rank ``rank`` of ``world_size`` until the block ends; then the groups are destroyed as the job's end does."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ...initialize import shutdown

    if dist.is_initialized():
        raise RuntimeError("a process group exists already: the simulated rank needs a process of its own "
                           "(run the estimate as its own command)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}; pass --rank between 0 and {world_size - 1}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield
    finally:
        shutdown()

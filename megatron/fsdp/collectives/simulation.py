"""The engine as a simulation: fake tensors (``FakeTensorMode``) on torch's fake process group.

Why: a configuration at 1,024 ranks and 405B parameters can only be tried on a laptop if the engine's real
code (its layouts, its schedule, every collective through the ledger) runs with no weight allocated and no
byte moved. Under ``FakeTensorMode`` every tensor has a shape, a dtype and a device but no data; on the
``fake`` backend every collective returns at once. What reads data has no answer there: a digest compared,
a NaN looked for, a norm turned into a float. Each such place asks ``is_fake`` here and says what it does
instead; nothing else in the engine knows it is simulated.
"""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import is_fake as _is_fake, unset_fake_temporarily


def is_fake(tensor: torch.Tensor) -> bool:
    """``tensor`` has no data: a fake tensor (or a view of one)."""
    return _is_fake(tensor)


def simulating() -> bool:
    """A ``FakeTensorMode`` is active: a tensor made now is fake (``torch.empty`` allocates nothing)."""
    return detect_fake_mode() is not None


def outside_simulation():
    """Suspend an active ``FakeTensorMode`` (a context manager; nothing when none is active).

    For a build on the meta device, which allocates nothing anyway: its parameters must be real meta tensors,
    which ``fully_shard`` materialises in place; a fake one cannot be (``meta_init.py``)."""
    return unset_fake_temporarily()

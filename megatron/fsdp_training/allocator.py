"""The job's allocator setting: a fixed glibc mmap threshold, so freed tensors leave the resident set.

Why: glibc serves a large block with its own mapping, but each time such a mapping is
freed it raises its mmap threshold to that block's size (up to 32 MiB on 64-bit). From
then on blocks of that size come from the heap or a thread's arena, and freed heap pages
stay resident. A ZeRO-3 step allocates and frees every unit's gathered weights and
gradient buffers, so under glibc's default the resident set grows to what the heap once
held rather than what the step holds: measured at 70M parameters and 2 ranks
(docs/performance.md, "Peak memory against FSDP2"), a step's peak was 1209 MiB with
glibc's default and 627 MiB with a fixed 64 KiB threshold (FSDP2: 1063 and 667 MiB).
A fixed threshold (``mallopt(M_MMAP_THRESHOLD)``) also stops the dynamic adjustment.

Why 4 MiB and not lower: every block at or above the threshold is mapped on allocation and
unmapped on free, and each fresh mapping is paid for in page faults. Measured on the
README's job (4 CPU ranks, 20 iterations, tokens/s over two runs; peak resident MiB):
64 KiB 2886-3079 (425), 1 MiB 3987-4127 (452-456), 4 MiB 4306-5379 (462), glibc's
dynamic default 4575-4735 (467). 4 MiB keeps the step's large buffers (gathered units,
gradient shards) mapped and costs no throughput; the measurements of the resident set
(``MEASURE_MMAP_THRESHOLD``) use 64 KiB so that it follows every live tensor.

Why the job and not the engine: the setting is process-wide (every library's buffers),
so it is the launcher's decision, taken once at start-up (``initialize``). An explicit
``MALLOC_MMAP_THRESHOLD_`` in the environment is the user's decision and wins. No-op where
glibc is not the C library.

With it (``apply_job_setting``), ``trim_after_unit_backward``: a fixed threshold maps the
step's large buffers, but a block's activations are many tensors below it, which glibc's
heap keeps resident when the backward frees them; each unit's new gradient shard (above
the threshold) is then mapped afresh, so the backward's peak counts the forward's
activations a second time, as freed heap. ``malloc_trim(0)`` after each unit's backward
(the engine's ``register_post_backward_hook``) hands those pages back before the next
unit's gradients are mapped. Measured in docs/performance.md, "Peak memory against FSDP2".
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable, Optional

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
JOB_MMAP_THRESHOLD = 4 << 20  # bytes: blocks this large and larger are mapped, and unmapped when freed
MEASURE_MMAP_THRESHOLD = 64 << 10  # memory measurements: the resident set follows every tensor over 64 KiB
ENV = "MALLOC_MMAP_THRESHOLD_"


def fix_mmap_threshold(nbytes: int = JOB_MMAP_THRESHOLD, respect_env: bool = True) -> bool:
    """Set glibc's mmap threshold to ``nbytes`` for this process; True when it was set.

    ``respect_env``: leave it alone when ``MALLOC_MMAP_THRESHOLD_`` is set (glibc has read it).
    """
    if respect_env and os.environ.get(ENV):
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, int(nbytes)))
    except (OSError, AttributeError):
        return False


_libc: Optional[ctypes.CDLL] = None


def _glibc() -> Optional[ctypes.CDLL]:
    """glibc, or None where the C library is another (no ``malloc_trim``)."""
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL("libc.so.6")
            lib.malloc_trim  # noqa: B018 (only glibc has it)
        except (OSError, AttributeError):
            return None
        _libc = lib
    return _libc


_job_setting = False  # apply_job_setting fixed the threshold in this process


def apply_job_setting() -> bool:
    """The job's allocator setting, at start-up (``initialize``): the fixed mmap threshold now, and
    from then on ``job_post_backward_hook`` gives the trim to install on the wrapped model.
    False (and no trim) where the user's ``MALLOC_MMAP_THRESHOLD_`` or a C library other than
    glibc leaves the allocator as it is."""
    global _job_setting
    _job_setting = fix_mmap_threshold() or _job_setting
    return _job_setting


def job_post_backward_hook() -> Optional[Callable[[str], None]]:
    """The trim after each unit's backward where ``apply_job_setting`` took effect, else None."""
    return trim_after_unit_backward() if _job_setting else None


def trim_heap() -> bool:
    """Hand the free pages of every malloc arena back to the OS; True when glibc released some."""
    lib = _glibc()
    return bool(lib.malloc_trim(0)) if lib is not None else False


def trim_after_unit_backward(every: int = 1) -> Callable[[str], None]:
    """A post-backward hook (``FullyShardedModule.register_post_backward_hook``): ``trim_heap``
    after every ``every``-th unit's backward, so the activations freed there leave the resident set."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    count = [0]

    def hook(_unit_name: str) -> None:
        count[0] += 1
        if count[0] % every == 0:
            trim_heap()
    return hook

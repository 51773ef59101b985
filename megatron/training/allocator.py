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
"""

from __future__ import annotations

import ctypes
import os

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

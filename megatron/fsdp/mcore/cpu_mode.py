"""Moved to megatron.fsdp.mcore_cpu.cuda_standins; this name stays for one release."""

import sys

from megatron.fsdp.mcore_cpu import cuda_standins as _moved

sys.modules[__name__] = _moved  # the same module object: names read or set through the old path are its names

"""Moved to megatron.fsdp.mcore_cpu.fp8_linears; this name stays for one release."""

import sys

from megatron.fsdp.mcore_cpu import fp8_linears as _moved

sys.modules[__name__] = _moved  # the same module object: names read or set through the old path are its names

"""Moved to megatron.fsdp.mcore_cpu.patch_record; this name stays for one release."""

import sys

from megatron.fsdp.mcore_cpu import patch_record as _moved

sys.modules[__name__] = _moved  # the same module object: names read or set through the old path are its names

"""Moved to megatron.fsdp.mcore_cpu.trainer_bridges; this name stays for one release."""

import sys

from megatron.fsdp.mcore_cpu import trainer_bridges as _moved

sys.modules[__name__] = _moved  # the same module object: names read or set through the old path are its names

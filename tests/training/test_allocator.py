"""The job's allocator setting: freed buffers leave the resident set, and the environment wins.

Each case runs in a fresh interpreter (glibc's thresholds are process-wide and only move
one way), without torch: plain ``malloc`` through ctypes, so it takes well under a second.
"""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# After a 16 MiB mapped block is freed, glibc's default raises its mmap threshold past 8 MiB, so a
# touched 8 MiB block comes from the heap and stays resident once freed; a fixed threshold maps it.
_PROBE = r"""
import ctypes, importlib.util, sys
spec = importlib.util.spec_from_file_location("allocator", sys.argv[2])
allocator = importlib.util.module_from_spec(spec); spec.loader.exec_module(allocator)
libc = ctypes.CDLL("libc.so.6"); libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) * 1024
fixed = allocator.fix_mmap_threshold() if sys.argv[1] == "job" else None
libc.free(libc.malloc(16 << 20))
before = rss()
block = libc.malloc(8 << 20); ctypes.memset(block, 1, 8 << 20)
small = libc.malloc(64)  # above the block: the heap cannot shrink under it
libc.free(block)
print(fixed, rss() - before)
"""


def _probe(setting: str, env=None):
    path = os.path.join(ROOT, "megatron", "training", "allocator.py")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environ.update(env or {})
    out = subprocess.run([sys.executable, "-c", _PROBE, setting, path], capture_output=True, text=True,
                         env=environ, timeout=60, check=True).stdout.split()
    return out[0], int(out[1])


def test_freed_block_leaves_the_resident_set_with_the_job_setting():
    fixed, kept = _probe("job")
    assert fixed == "True"
    assert kept < 1 << 20, kept
    _, kept_by_default = _probe("glibc")  # what the setting is for: glibc's default keeps it
    assert kept_by_default > 6 << 20, kept_by_default


def test_an_explicit_environment_setting_wins():
    fixed, _ = _probe("job", {"MALLOC_MMAP_THRESHOLD_": str(16 << 20)})
    assert fixed == "False"

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
# The probes' common start: the module loaded by path (argv[1]), plain malloc, the resident set.
_PRELUDE = r"""
import ctypes, importlib.util, sys
spec = importlib.util.spec_from_file_location("allocator", sys.argv[1])
allocator = importlib.util.module_from_spec(spec); spec.loader.exec_module(allocator)
libc = ctypes.CDLL("libc.so.6"); libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) * 1024
"""
_PROBE = _PRELUDE + r"""
fixed = allocator.fix_mmap_threshold() if sys.argv[2] == "job" else None
libc.free(libc.malloc(16 << 20))
before = rss()
block = libc.malloc(8 << 20); ctypes.memset(block, 1, 8 << 20)
small = libc.malloc(64)  # above the block: the heap cannot shrink under it
libc.free(block)
print(fixed, rss() - before)
"""


def _probe(setting: str, env=None):
    path = os.path.join(ROOT, "megatron", "fsdp_training", "allocator.py")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environ.update(env or {})
    out = subprocess.run([sys.executable, "-c", _PROBE, path, setting], capture_output=True, text=True,
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


# Blocks below the threshold (a layer's activations) come from the heap and stay resident when
# freed, even under the job's threshold; the job's trim after each unit's backward hands them back.
_TRIM_PROBE = _PRELUDE + r"""
before_setting = allocator.job_post_backward_hook()
applied = allocator.apply_job_setting()
hook = allocator.job_post_backward_hook()
before = rss()
blocks, keep = [], []
for _ in range(64):  # 16 MiB in blocks under the 4 MiB threshold, each with a live one above it
    blocks.append(libc.malloc(256 << 10)); ctypes.memset(blocks[-1], 1, 256 << 10)
    keep.append(libc.malloc(4096))  # the holes cannot merge, nor the heap shrink from its top
for b in blocks:
    libc.free(b)
kept = rss() - before
if hook is not None:
    hook("unit")
print(before_setting is None, applied, hook is not None, kept, rss() - before)
"""


def _trim_probe(env=None):
    path = os.path.join(ROOT, "megatron", "fsdp_training", "allocator.py")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environ.update(env or {})
    run = subprocess.run([sys.executable, "-c", _TRIM_PROBE, path], capture_output=True, text=True,
                         env=environ, timeout=60, check=True)
    out = run.stdout.split()
    return out[:3], int(out[3]), int(out[4])


def test_the_job_setting_trims_the_heap_after_a_unit_backward():
    flags, kept, after_trim = _trim_probe()
    assert flags == ["True", "True", "True"]  # no hook before the job's setting; one after it
    assert kept > 12 << 20, kept  # freed small blocks stay resident under the threshold alone
    assert after_trim < 2 << 20, after_trim  # the hook gave them back
    flags, _, _ = _trim_probe({"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
    assert flags == ["True", "False", "False"]  # the user's allocator setting: no threshold, no trim

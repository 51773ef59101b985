"""Whether this machine computes bf16 natively, so the benchmark's default dtype fits it.

On a CPU without AVX512-BF16 or AMX (an AVX2-only EPYC, for one) torch emulates bf16
matrix products through fp32 conversions, several times slower than fp32 itself: a bf16
benchmark there measures the emulation, and a 50M run prints nothing for minutes. The
benchmark therefore defaults to fp32 where bf16 is emulated, and says so.
"""

from __future__ import annotations

import time
from typing import Tuple

NATIVE_FLAGS = ("avx512_bf16", "amx_bf16")


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _probe(n: int = 256, repeats: int = 3) -> Tuple[float, float]:
    """Seconds of one n x n matmul in fp32 and in bf16 (the best of ``repeats``)."""
    import torch

    def best(dtype):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times)
    return best(torch.float32), best(torch.bfloat16)


def native_bf16() -> Tuple[bool, str]:
    """``(native, reason)``: CUDA asks torch; a CPU its flags, else a quick matmul probe."""
    import torch

    if torch.cuda.is_available():
        native = torch.cuda.is_bf16_supported()
        return native, f"CUDA device {'supports' if native else 'does not support'} bf16"
    flags = _cpu_flags()
    found = [f for f in NATIVE_FLAGS if f in flags]
    if found:
        return True, f"CPU has {'/'.join(found)}"
    if flags:
        return False, "CPU has neither AVX512-BF16 nor AMX: torch emulates bf16 matrix products"
    fp32, bf16 = _probe()
    native = bf16 <= 1.5 * fp32
    return native, f"bf16 matmul probe {bf16 / fp32:.1f}x the fp32 time ({'native' if native else 'emulated'})"

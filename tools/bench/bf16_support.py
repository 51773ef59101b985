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


# ------------------------------------------------------------------ fp32 kernels for bf16 math

class _UpcastLinear:
    """``F.linear`` on bf16 CPU tensors computed by fp32 kernels; saves what torch's linear saves.

    Autograd keeps the bf16 input and weight (as the native bf16 linear does), so the
    activation memory of a step is the native one; the fp32 copies live only inside one call.
    """

    @staticmethod
    def function():
        import torch

        class Linear(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, weight, bias):
                ctx.save_for_backward(x, weight)
                ctx.has_bias = bias is not None
                out = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
                return out.to(x.dtype)

            @staticmethod
            def backward(ctx, grad):
                x, weight = ctx.saved_tensors
                g = grad.float()
                grad_x = (g @ weight.float()).to(x.dtype)
                flat_g, flat_x = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1]).float()
                grad_w = (flat_g.t() @ flat_x).to(weight.dtype)
                grad_b = flat_g.sum(0).to(weight.dtype) if ctx.has_bias else None
                return grad_x, grad_w, grad_b
        return Linear


def _upcast_attention():
    import torch

    class Attention(torch.autograd.Function):
        """Causal ``scaled_dot_product_attention`` of bf16 q, k, v through the fp32 kernel
        (saves q, k, v in bf16 and recomputes the fp32 attention in the backward)."""

        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            with torch.no_grad():
                out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
            return out.to(q.dtype)

        @staticmethod
        def backward(ctx, grad):
            q, k, v = (t.detach().float().requires_grad_() for t in ctx.saved_tensors)
            with torch.enable_grad():
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad.float())
            return dq.to(grad.dtype), dk.to(grad.dtype), dv.to(grad.dtype)
    return Attention


def upcast_bf16_kernels() -> None:
    """In this process, run bf16 linears and causal attention on CPU through fp32 kernels.

    For a CPU that emulates bf16 matrix products (185x slower than fp32 here for a
    512 x 512 x 2048 product; a 70M-parameter bf16 step would take most of an hour): the
    memory benchmark keeps bf16 weights, activations and gradients, with the same saved
    tensors as the native kernels, at fp32 speed. Applied to every system of a run alike.
    """
    import torch
    import torch.nn.functional as F

    if getattr(F.linear, "_upcast", False):
        return
    linear, attention = F.linear, F.scaled_dot_product_attention
    Linear, Attention = _UpcastLinear.function(), _upcast_attention()

    def fast_linear(x, weight, bias=None):
        if x.dtype == torch.bfloat16 and x.device.type == "cpu" and torch.is_grad_enabled():
            return Linear.apply(x, weight, bias)
        if x.dtype == torch.bfloat16 and x.device.type == "cpu":
            return linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
        return linear(x, weight, bias)

    def fast_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        if q.dtype == torch.bfloat16 and q.device.type == "cpu" and is_causal and attn_mask is None \
                and dropout_p == 0.0 and not kwargs:
            return Attention.apply(q, k, v)
        return attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    fast_linear._upcast = True
    F.linear, F.scaled_dot_product_attention = fast_linear, fast_attention


def main() -> int:
    """Print the verdict the benchmarks use (``run.py`` and ``memory.py`` pick their default dtype by it)."""
    native, reason = native_bf16()
    print(f"bf16: {'native' if native else 'emulated'} ({reason}); the benchmarks default to "
          f"{'bf16' if native else 'fp32 (run.py --dtype bf16 measures the emulation)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

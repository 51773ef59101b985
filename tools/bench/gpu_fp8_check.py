"""FP8 cases for tools/bench/gpu_check.sh: the engine's FP8 numbers on a device against the CPU.

Why: the quantized parameter gather is proven bitwise on CPU processes (tests/engine/test_fp8_gather.py);
on a GPU the same recipe must give the same bytes, or ranks computing on CUDA would not hold the
unsharded model's weights. Per recipe (tensorwise, mxfp8) and format, the FP8 elements and scales
quantized on ``--device`` equal the CPU's bit for bit, and so do their dequantizations; where the device
has ``torch._scaled_mm`` (H100/B200; CPU in torch 2.13) a per-tensor FP8 GEMM is compared with the product
of the dequantized operands. Exit status 1 when a check fails. Runs on CPU too (tests/tools/test_bench.py).
"""

import argparse
import sys

import torch

from megatron.fsdp.precision import fp8


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8).cpu()


def quantization_parity(device: str) -> list:
    failures = []
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 192, generator=gen) * 3
    for fmt in ("e4m3", "e5m2"):
        for recipe in ("tensorwise", "mxfp8"):
            quantize = (lambda x: fp8.quantize_tensorwise(x, fmt)) if recipe == "tensorwise" else \
                (lambda x: fp8.quantize_mxfp8(x, fmt))
            ref, got = quantize(weight), quantize(weight.to(device))
            same = (torch.equal(_bits(ref.data), _bits(got.data)) and torch.equal(_bits(ref.scale_inv), _bits(got.scale_inv))
                    and torch.equal(ref.dequantize(torch.bfloat16).float(), got.dequantize(torch.bfloat16).float().cpu()))
            print(f"fp8 {recipe:<10} {fmt}: {'bitwise' if same else 'DIFFERS'} on {device} vs cpu", flush=True)
            if not same:
                failures.append(f"{recipe}/{fmt}")
    return failures


def scaled_mm_parity(device: str) -> list:
    if not hasattr(torch, "_scaled_mm"):
        print("fp8 _scaled_mm: not in this torch", flush=True)
        return []
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 128, generator=gen), torch.randn(96, 128, generator=gen)
    qa, qb = fp8.quantize_tensorwise(a.to(device), "e4m3"), fp8.quantize_tensorwise(b.to(device), "e4m3")
    try:
        out = torch._scaled_mm(qa.data, qb.data.t(), scale_a=qa.scale_inv.float(), scale_b=qb.scale_inv.float(),
                               out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as err:  # a device without FP8 GEMMs (pre-Hopper)
        print(f"fp8 _scaled_mm: not available on {device} ({str(err).splitlines()[0]})", flush=True)
        return []
    ref = qa.dequantize() @ qb.dequantize().t()
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    print(f"fp8 _scaled_mm e4m3 64x128x96: max relative difference to the dequantized product {err:.2e}", flush=True)
    return [] if err <= 1e-5 else ["_scaled_mm"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    failures = quantization_parity(args.device) + scaled_mm_parity(args.device)
    if failures:
        print("fp8 checks failed: " + ", ".join(failures), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# The engine's CUDA path at world size 1, for a machine with one CUDA GPU (under 8 minutes).
#
#     bash tools/bench/gpu_check.sh            # extra arguments go to gpu_smoke.py
#
# Why: the test suite runs on CPU processes with gloo and its cases take no device, so
# nothing in it exercises CUDA/NCCL. gpu_smoke.py runs, in one process (NCCL, one rank),
# every level in fp32 and bf16 against the unwrapped model (parity) and the world-size-1
# overhead benchmark; then gpu_fp8_check.py: the FP8 gather's quantization (per-tensor and
# MXFP8) on the GPU bitwise against the CPU's, and torch._scaled_mm where the device has it.
# The exit status is the first failing step's: 1 when a parity check fails, 124 when a
# time limit is hit.
set -euo pipefail
cd "$(dirname "$0")/../.."
export TORCHDYNAMO_DISABLE=1
python - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"no CUDA device visible to torch {torch.__version__}: this check needs one GPU")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}", flush=True)
PY
timeout 470 python tools/bench/gpu_smoke.py --device cuda "$@"
timeout 60 python tools/bench/gpu_fp8_check.py --device cuda

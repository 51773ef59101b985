"""The engine's CUDA path at world size 1: parity with the unwrapped model, and its overhead.

    python tools/bench/gpu_smoke.py                 # one CUDA GPU: NCCL, one rank
    python tools/bench/gpu_smoke.py --device cpu    # the same checks on CPU/gloo (a dry run, ~1 min on 2 cores)

Why: the test suite runs on CPU processes with gloo and its cases take no device, while
the engine promises one code path for CPU/gloo and CUDA/NCCL. On a machine with one GPU
this runs what can run there in one process: for every level, in fp32 and in bf16 mixed
precision, ``fully_shard`` + ``FullyShardedOptimizer`` train the benchmark's torch model
for a few steps and must match the unwrapped model trained with torch AdamW (fp32 losses
and weights within 1e-4 relative with TF32 off; bf16 within bf16 rounding: 3e-2 on
losses, 1e-2 relative L2 on the weights). Then the world-size-1 overhead benchmark:
step time of each level against the unwrapped model (fp32, round-robin), target 5%; a
level whose step-time spread is larger than its difference from the unwrapped model (or
from the target) gets "noise: not resolvable" instead of pass/fail. The overhead model
defaults to 50M on CUDA and to 5M on CPU (the CPU run is a dry run of the code path,
not a measurement). Exit status 1 if any parity check fails; the overhead verdict is
printed (a target, not a correctness check). ``tools/bench/gpu_check.sh`` runs this under a time limit.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tools.bench import torch_case  # noqa: E402
from tools.bench.report import NOISE, relative_spread as _spread, resolved  # noqa: E402
from tools.bench.spec import CLIP_GRAD, LEVELS, SIZES  # noqa: E402

PARITY_STEPS = 5


def init(device: str) -> None:
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --device cpu for the dry run")
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity is meant at fp32 precision
        torch.backends.cudnn.allow_tf32 = False
    init_file = os.path.join(tempfile.mkdtemp(prefix="mfsdp-gpu-smoke-"), "rendezvous")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=0, world_size=1)


def _tokens(size_name: str, rows: int, device: str, seed: int) -> torch.Tensor:
    s = SIZES[size_name]
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, s.vocab, (rows, s.seq + 1), generator=gen).to(device)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train(system: str, size_name: str, device: str, bf16: bool, batches) -> tuple:
    """Losses of ``len(batches)`` steps and the final fp32 weights by name."""
    model = torch_case.build_model(size_name).to(device)
    names = [n for n, _ in model.named_parameters()]
    if system == "unwrapped":
        run, optimizer = model, torch_case.adamw(torch_case.param_groups(model.named_parameters()))
    else:
        run, optimizer = torch_case.wrap_ours(model, system.partition(":")[2], bf16)
    losses = []
    for tokens in batches:
        loss = run(tokens)
        loss.backward()
        if system == "unwrapped":  # the engine's optimizer clips by itself
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.float().item())
    state = run.full_state_dict() if system != "unwrapped" else dict(model.named_parameters())
    return losses, {n: state[n].detach().float().cpu() for n in names if n in state}


def parity(device: str, size_name: str) -> bool:
    s = SIZES[size_name]
    batches = [_tokens(size_name, 4 * s.rows, device, seed) for seed in range(PARITY_STEPS)]
    ref_losses, ref_params = train("unwrapped", size_name, device, False, batches)
    ok = True
    for bf16 in (False, True):
        loss_tol, param_tol = (3e-2, 1e-2) if bf16 else (1e-4, 1e-4)
        for level in LEVELS:
            losses, params = train(f"ours:{level}", size_name, device, bf16, batches)
            loss_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
            diff = sum((params[n] - ref_params[n]).pow(2).sum().item() for n in params)
            norm = sum(ref_params[n].pow(2).sum().item() for n in params)
            param_err = (diff / norm) ** 0.5
            good = loss_err <= loss_tol and param_err <= param_tol and len(params) == len(ref_params)
            ok &= good
            print(f"[{'pass' if good else 'FAIL'}] parity {'bf16' if bf16 else 'fp32'} {level:<18} "
                  f"loss rel err {loss_err:.2e} (<= {loss_tol:g})  weights rel L2 {param_err:.2e} (<= {param_tol:g})",
                  flush=True)
    return ok


def overhead(device: str, size_name: str, rows: int, rounds: int, warmup: int, steps: int) -> str:
    """Round-robin step times (fp32) of the unwrapped model and of every level; target: within 5%."""
    systems = ["unwrapped"] + [f"ours:{level}" for level in LEVELS]
    tokens = _tokens(size_name, rows, device, 0)
    times = {system: [] for system in systems}
    for rnd in range(rounds):
        for system in systems[rnd % len(systems):] + systems[:rnd % len(systems)]:
            print(f"  overhead round {rnd + 1}/{rounds}: {system}...", flush=True)
            built = torch_case.build_system(system, torch_case.build_model(size_name).to(device), tokens, False)
            for _ in range(warmup):
                built.step()
            _sync(device)
            for _ in range(steps):
                start = time.perf_counter()
                built.step()
                _sync(device)
                times[system].append(time.perf_counter() - start)
            del built
            if device == "cuda":
                torch.cuda.empty_cache()
    base = statistics.median(times["unwrapped"])
    print(f"overhead at world size 1 ({size_name}, {rows} rows x {SIZES[size_name].seq} tokens, fp32, "
          f"{rounds} rounds x {steps} steps): unwrapped {base * 1e3:.2f} ms/step (spread ±{_spread(times['unwrapped']):.0%})",
          flush=True)
    verdicts = []
    for system in systems[1:]:
        rel = statistics.median(times[system]) / base - 1
        noise = math.hypot(_spread(times[system]), _spread(times["unwrapped"]))
        verdict = resolved(rel, 0.05, noise, rel <= 0.05)
        verdicts.append(verdict)
        label = NOISE if verdict is None else "pass" if verdict else "FAIL"
        print(f"[{label}] overhead {system:<24} {statistics.median(times[system]) * 1e3:8.2f}"
              f" ms/step  {rel:+.2%} ±{noise:.0%} (target <= +5%)", flush=True)
    return "FAIL" if False in verdicts else NOISE if None in verdicts else "pass"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--parity-size", choices=list(SIZES), default="tiny")
    p.add_argument("--size", choices=list(SIZES), default=None,
                   help="model of the overhead benchmark (default: 50M on cuda, 5M on cpu)")
    p.add_argument("--rows", type=int, default=None, help="sequences per step in the overhead benchmark "
                                                         "(default: 8 on cuda, 2 on cpu)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per run (default: 3 on cuda, 1 on cpu)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default: 10 on cuda, 5 on cpu)")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"  # a CPU run checks the code path: small by default, with progress
    args.size = args.size or ("50M" if cuda else "5M")
    args.rows = args.rows or (8 if cuda else 2)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    args.steps = args.steps or (10 if cuda else 5)
    init(args.device)
    try:
        started = time.perf_counter()
        parity_ok = parity(args.device, args.parity_size)
        overhead_verdict = overhead(args.device, args.size, args.rows, args.rounds, args.warmup, args.steps)
        print(f"parity: {'pass' if parity_ok else 'FAIL'}; overhead target: {overhead_verdict} "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        dist.destroy_process_group()
    return 0 if parity_ok else 1


if __name__ == "__main__":
    sys.exit(main())

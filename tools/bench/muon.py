"""Muon under ZeRO-3: our owner-per-matrix step against a gather-to-all baseline, side by side.

    python tools/bench/muon.py --ranks 2 4 --hidden 64 --layers 4 --steps 3

Same model, same data, same run: per world size it times the optimizer step
(``optimizer.step()``: norm, clip, AdamW, Muon, install) and the whole training
step for three optimizers, round-robin:

* ``ours``: ``FullyShardedOptimizer(..., matrix=PerMatrixOptimizer(torch.optim.Muon, ...))``;
  each matrix's owner receives the pieces (all-to-all-v per unit and direction),
  runs Newton-Schulz, sends the result pieces back;
* ``gather-to-all``: Moonlight's Distributed Muon on sharded state, implemented
  here: every rank all-gathers each unit's bf16 update and runs Newton-Schulz on
  every matrix, then keeps its own piece;
* ``adamw``: AdamW for everything (the whole-step reference).

Bytes per step per rank come from the engine's ledger (wire bytes: what one rank
sends) and are printed against ``2(N-1)/N^2`` (ours) and ``(N-1)/N`` (gather-to-all)
of the bf16 matrix bytes. Both Muon variants update the weights identically
(checked: the final weights must agree within bf16 rounding of the update).
Timings on a shared CPU machine are noisy: read the ratios, measured in one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

SYSTEMS = ("ours", "gather-to-all", "adamw")
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5)


def gather_to_all_step(matrix, overlap_with=None) -> None:
    """Moonlight-style: all-gather each unit's bf16 update, Newton-Schulz on every matrix on every rank."""
    import torch
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

    if overlap_with is not None:
        overlap_with()
    group = matrix.param_groups[0]
    for mu in matrix.units:
        s = mu.storage
        lo, hi = s.layout.shard_range(s.inner.rank)
        mine = torch.zeros(hi - lo, dtype=torch.bfloat16)
        for j, (g, buf) in enumerate(zip(mu.grads, mu.bufs)):
            buf.lerp_(g, 1 - group["momentum"])
            update = g.lerp(buf, group["momentum"]) if group["nesterov"] else buf
            a, b = mu.pieces[j]
            mine[a - lo:b - lo] = update
        full = torch.empty(s.layout.padded_size, dtype=torch.bfloat16)
        s.inner.all_gather(full, mine, tag="gather_to_all").wait()
        for j, m in enumerate(mu.matrices):
            result = _zeropower_via_newtonschulz(full[m.start:m.end].view(m.shape), group["ns_coefficients"],
                                                 group["ns_steps"], group["eps"]).reshape(-1)
            a, b = mu.pieces[j]
            param = mu.params[j]
            param.mul_(1 - group["lr"] * group["weight_decay"])
            param.add_(result[a - m.start:b - m.start], alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], m.shape))


def case(ctx, system: str, hidden: int, layers: int, warmup: int, steps: int, threads: int) -> dict:
    """Worker side: train ``warmup + steps`` steps under ZeRO-3; time optimizer and whole steps."""
    import torch
    import torch.distributed as dist

    import megatron.fsdp as mfsdp
    from megatron.fsdp.testing.engine_training import RunConfig, train_step
    from megatron.fsdp.testing.models import MLP, Block, TinyLM, make_batches

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = TinyLM(hidden=hidden, layers=layers, heads=4)
    fsdp = mfsdp.fully_shard(model, strategy="optim_grads_params", unit_modules=(Block, MLP), mesh=ctx.group)
    adamw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    muon = {} if system == "adamw" else dict(matrix=mfsdp.PerMatrixOptimizer(torch.optim.Muon, MUON))
    opt = mfsdp.FullyShardedOptimizer(fsdp, torch.optim.AdamW, clip_grad=1.0, **muon, **adamw)
    if system == "gather-to-all":
        opt.matrix.step = lambda overlap_with=None: gather_to_all_step(opt.matrix, overlap_with)
    timed = {"opt": [], "step": []}
    original = opt.step

    def timed_step():
        t0 = time.perf_counter()
        norm = original()
        timed["opt"].append(time.perf_counter() - t0)
        return norm
    opt.step = timed_step
    cfg = RunConfig(strategy="optim_grads_params", micro_batches=1, hidden=hidden, layers=layers)
    batches = make_batches(warmup + steps, 1, 4 * ctx.size, seq=8)
    wire = 0
    for k, batch in enumerate(batches):
        if k == warmup:
            fsdp.ledger.reset()
            fsdp.ledger.trace = True
        dist.barrier(group=ctx.group)
        t0 = time.perf_counter()
        train_step(ctx, fsdp, opt, batch, cfg)
        timed["step"].append(time.perf_counter() - t0)
    # matrix traffic only: our all-to-alls, or the baseline's all-gathers (not ZeRO-3's parameter gathers)
    wire = sum(e.wire for e in fsdp.ledger.events if e.kind == "all_to_all" or e.tag == "gather_to_all") / steps
    matrix_bytes = 2 * sum(m.numel for mu in opt.matrix.units for m in mu.matrices) if opt.matrix else 0
    weights = fsdp.full_state_dict()
    return {"opt": timed["opt"][warmup:], "step": timed["step"][warmup:], "wire": wire,
            "matrix_bytes": matrix_bytes, "weights": weights if ctx.rank == 0 else None}


def main(argv=None) -> int:
    import torch

    from megatron.fsdp.testing import WorkerPool

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    pool = WorkerPool(max(args.ranks), start_timeout=900)
    rows = []
    try:
        for n in args.ranks:
            res = {s: {"opt": [], "step": []} for s in SYSTEMS}
            for r in range(args.rounds):
                for s in SYSTEMS[r % 3:] + SYSTEMS[:r % 3]:
                    out = pool.run(case, size=n, timeout=1800, system=s, hidden=args.hidden,
                                   layers=args.layers, warmup=args.warmup, steps=args.steps, threads=args.threads)
                    res[s]["opt"] += out[0]["opt"]
                    res[s]["step"] += out[0]["step"]
                    res[s]["wire"] = [o["wire"] for o in out]
                    res[s]["matrix_bytes"] = out[0]["matrix_bytes"]
                    res[s]["weights"] = out[0]["weights"]
            ours, base = res["ours"]["weights"], res["gather-to-all"]["weights"]
            agree = max((ours[k] - base[k]).abs().max().item() for k in ours)
            rows.append((n, res, agree))
    finally:
        pool.close()
    print(f"\nMuon under ZeRO-3 (TinyLM hidden {args.hidden}, {args.layers} layers; {args.rounds} rounds x "
          f"{args.steps} timed steps; torch {torch.__version__}; medians; wire bytes per rank per step)")
    head = (f"{'ranks':>5} | {'system':<13} | {'opt step ms':>11} | {'whole step ms':>13} | "
            f"{'matrix wire B/rank':>18} | {'theory':>9} | {'opt step vs ours':>16}")
    print(head)
    print("-" * len(head))
    verdicts = []
    for n, res, agree in rows:
        med = {s: statistics.median(res[s]["opt"]) * 1e3 for s in SYSTEMS}
        whole = {s: statistics.median(res[s]["step"]) * 1e3 for s in SYSTEMS}
        mb = res["ours"]["matrix_bytes"]
        for s in SYSTEMS:
            wire = res[s].get("wire") or [0]
            per_rank = sum(wire) / len(wire)
            theory = {"ours": 2 * (n - 1) / n ** 2 * mb, "gather-to-all": (n - 1) / n * mb}.get(s)
            print(f"{n:>5} | {s:<13} | {med[s]:>11.1f} | {whole[s]:>13.1f} | "
                  f"{per_rank:>18.0f} | {theory if theory is not None else float('nan'):>9.0f} | "
                  f"{med[s] / med['ours']:>15.2f}x")
        speedup = med["gather-to-all"] / med["ours"]
        verdicts.append(f"{n} ranks: ours {speedup:.2f}x faster optimizer step than gather-to-all"
                        f"{' (target >= 1.5x at 4 ranks: ' + ('met' if speedup >= 1.5 else 'missed') + ')' if n == 4 else ''}; "
                        f"whole step Muon/AdamW {whole['ours'] / whole['adamw']:.2f}x; "
                        f"weights ours vs gather-to-all max abs diff {agree:.1e}")
    print()
    for v in verdicts:
        print(v)
    return 0


if __name__ == "__main__":
    sys.exit(main())

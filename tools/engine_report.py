"""Print the engine's measured parity, traffic and memory figures as tables.

    python tools/engine_report.py

Runs the same cases as the test suite (in the same six-rank gloo pool) and prints,
for every level on flat meshes of 2-4 ranks and every (inner, outer) pair on a 3 x 2
mesh: the largest relative error of losses and grad norms against one unsharded
process (3 micro-batches, 5 AdamW steps, fp32), the gradient traffic per axis
against theory, and persistent bytes per rank against the formulas (fp32 and bf16).
"""

from __future__ import annotations

import dataclasses
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def _rel(xs, ys):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(xs, ys))


def main() -> None:
    from megatron.fsdp.sharding.strategy import STRATEGIES, valid_pairs
    from megatron.fsdp.testing.engine import grad_traffic, memory
    from megatron.fsdp.testing.engine_training import RunConfig, reference_run, sharded_run
    from megatron.fsdp.testing import WorkerPool

    pool = WorkerPool(6)
    try:
        ref_cfg = RunConfig(strategy="no_shard", micro_batches=3)
        ref = reference_run(ref_cfg)
        rows = []
        setups = [(lvl, "-", None, n) for lvl in STRATEGIES for n in (2, 3, 4)]
        setups += [(i, o, (3, 2), 6) for i, o in valid_pairs()]
        print(f"{'inner':>18} {'outer':>18} {'mesh':>5} | {'loss rel err':>12} {'gnorm rel err':>13} | "
              f"{'inner grad B':>12} {'vs theory':>9} {'outer grad B':>12} {'vs theory':>9} | "
              f"{'bytes/rank fp32':>15} {'vs theory':>9} {'bytes/rank bf16':>15} {'vs theory':>9}")
        for inner, outer, mesh, size in setups:
            kw = dict(mesh=mesh, outer_strategy=None if outer == "-" else outer)
            cfg = dataclasses.replace(ref_cfg, strategy=inner, **kw)
            res = pool.run(sharded_run, size=size, cfg=cfg)[0]
            traffic = pool.run(grad_traffic, size=size, strategy=inner, micro_batches=3, **kw)[0]
            mem = {bf16: pool.run(memory, size=size, strategy=inner, bf16=bf16, **kw)[-1]
                   for bf16 in (False, True)}

            def ratio(axis):
                theory = traffic["theory_bytes"][axis]
                return f"{traffic['grad_bytes'][axis] / theory - 1:+.3%}" if theory else "-"

            def mem_cols(bf16):
                got, theory = sum(mem[bf16]["report"].values()), sum(mem[bf16]["theory"].values())
                return f"{got:>15,d} {got / theory - 1:>+9.3%}"

            shape = f"{mesh[0]}x{mesh[1]}" if mesh else f"{size}"
            rows.append(f"{inner:>18} {outer:>18} {shape:>5} | {_rel(res['losses'], ref['losses']):>12.2e} "
                        f"{_rel(res['grad_norms'], ref['grad_norms']):>13.2e} | "
                        f"{traffic['grad_bytes']['dp_shard']:>12,d} {ratio('dp_shard'):>9} "
                        f"{traffic['grad_bytes']['dp_outer']:>12,d} {ratio('dp_outer'):>9} | "
                        f"{mem_cols(False)} {mem_cols(True)}")
            print(rows[-1], flush=True)
        print("memory: last rank of the group (it holds the tail padding); traffic: 3 micro-batches, hidden 64")
    finally:
        pool.close()


if __name__ == "__main__":
    main()

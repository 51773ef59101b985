"""Print the adapter's measured parity with Megatron-Core's own DDP, per topology and level.

    python tools/adapter_report.py

Same cases as tests/mcore/test_adapter.py (4 gloo ranks, Megatron-Core GPTModel,
get_forward_backward_func, 4 micro-batches, 5 iterations, fp32): for each topology the
baseline is Megatron-Core DistributedDataParallel + its Adam; each row gives the
largest relative difference of losses and grad norms over the 5 iterations.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def main() -> None:
    from tests.harness import WorkerPool
    from tests.mcore.gpt import Topology
    from tests.mcore.test_adapter import LEVELS, TOPOLOGIES

    rows = [(name, topo, level, None) for name, topo in TOPOLOGIES.items() for level in LEVELS]
    rows += [("dp2x2-instances", Topology(instances=2), "optim_grads_params", outer) for outer in ("no_shard", "optim")]
    pool = WorkerPool(4)
    baselines = {}
    try:
        print(f"{'topology':>16} {'inner level':>18} {'outer':>8} | {'loss max rel':>12} {'gnorm max rel':>13} | "
              f"{'last loss':>10} {'s':>5}")
        for name, topo, level, outer in rows:
            base_key = "dp4" if topo.instances > 1 else name
            if base_key not in baselines:
                baselines[base_key] = pool.run("tests.mcore.gpt:megatron_ddp_run", timeout=600,
                                               topology=TOPOLOGIES[base_key])[0]
            base = baselines[base_key]
            start = time.time()
            res = pool.run("tests.mcore.adapter_cases:fsdp_run", timeout=600, topology=topo, strategy=level,
                           outer=outer)[0]
            rel = {k: max(abs(a - b) / abs(b) for a, b in zip(res[k], base[k])) for k in ("losses", "grad_norms")}
            print(f"{name:>16} {level:>18} {outer or '-':>8} | {rel['losses']:>12.2e} {rel['grad_norms']:>13.2e} | "
                  f"{res['losses'][-1]:>10.6f} {time.time() - start:>5.1f}", flush=True)
    finally:
        pool.close()


if __name__ == "__main__":
    main()

"""Print the adapter's measured parity with Megatron-Core's own DDP, per topology and level.

    python tools/adapter_report.py

Same cases as tests/mcore/test_adapter.py (4 gloo ranks, Megatron-Core GPTModel,
get_forward_backward_func, 4 micro-batches, 5 iterations, fp32): for each topology the
baseline is Megatron-Core DistributedDataParallel + its Adam; each row gives the
largest relative difference of losses and grad norms over the 5 iterations.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def print_parity(rows, width: int = 42) -> None:
    from megatron.fsdp_training.testing.adapter import fsdp_run
    from megatron.fsdp_training.testing.gpt import megatron_ddp_run
    """``rows``: (label, topology, level, FullyShardedDataParallelConfig overrides); one line each.

    The baseline of a row is Megatron-Core DDP on the same topology with one optimizer
    instance (the instance count only shapes our mesh).
    """
    from megatron.fsdp.testing import WorkerPool

    pool = WorkerPool(4)
    baselines = {}
    try:
        print(f"{'configuration':>{width}} | {'loss max rel':>12} {'gnorm max rel':>13} | {'last loss':>10} {'s':>5}")
        for label, topo, level, overrides in rows:
            flat = dataclasses.replace(topo, instances=1)
            if flat not in baselines:
                baselines[flat] = pool.run(megatron_ddp_run, timeout=600, topology=flat)[0]
            base = baselines[flat]
            start = time.time()
            res = pool.run(fsdp_run, timeout=600, topology=topo, strategy=level,
                           **overrides)[0]
            rel = {k: max(abs(a - b) / abs(b) for a, b in zip(res[k], base[k])) for k in ("losses", "grad_norms")}
            print(f"{label:>{width}} | {rel['losses']:>12.2e} {rel['grad_norms']:>13.2e} | "
                  f"{res['losses'][-1]:>10.6f} {time.time() - start:>5.1f}", flush=True)
    finally:
        pool.close()


def main() -> None:
    from megatron.fsdp.testing.common import LEVELS
    from megatron.fsdp_training.testing.gpt import TOPOLOGIES, Topology

    rows = [(f"{name} {level}", topo, level, {}) for name, topo in TOPOLOGIES.items() for level in LEVELS]
    rows += [(f"dp2x2-instances {outer}", Topology(instances=2), "optim_grads_params", {"outer": outer})
             for outer in ("no_shard", "optim")]
    print_parity(rows)


if __name__ == "__main__":
    main()

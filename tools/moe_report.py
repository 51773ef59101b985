"""Print the MoE parity of megatron.fsdp with Megatron-Core's own DDP, per configuration.

    python tools/moe_report.py

Same cases as tests/mcore/test_moe.py (4 gloo ranks, tiny GPT with 4 experts per
layer, top-2, aux-loss balancing, fp32, 4 micro-batches, 5 iterations): each row
gives the largest relative difference of losses and grad norms over the 5
iterations against Megatron-Core DistributedDataParallel + its chained optimizer.
"""

from __future__ import annotations

import os
import sys


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def main() -> None:
    from megatron.fsdp_training.testing.moe import EP_CASES, MIXED_CASES, moe_topology
    from tools.adapter_report import print_parity

    rows = [(f"EP {ep}, {dispatcher}, {level}", moe_topology(dispatcher, ep), level, {})
            for dispatcher, ep, level in EP_CASES]
    rows += [(name, topo, level, overrides) for name, (topo, level, overrides, _) in MIXED_CASES.items()]
    print_parity(rows)


if __name__ == "__main__":
    main()

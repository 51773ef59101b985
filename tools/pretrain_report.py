"""Run pretrain_gpt.py with Megatron-Core DDP and with --use-megatron-fsdp at every level; print the parity table.

    python tools/pretrain_report.py [--nproc 2] [-- extra pretrain_gpt.py arguments]

Each run is a real torchrun launch of pretrain_gpt.py (mock data, 10 iterations, the
tiny model of tests/training/test_pretrain.py); ``lm loss`` and ``grad norm`` are read
from the log lines, and the table gives the largest relative difference from the
baseline over all iterations.
"""

from __future__ import annotations

import argparse
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from megatron.fsdp.testing.common import LEVELS
    from megatron.fsdp_training.testing.job import PRETRAIN_MODEL, fsdp, torchrun

    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("extra", nargs="*")
    args = parser.parse_args()
    base, _ = torchrun(args.nproc, PRETRAIN_MODEL + list(args.extra))
    print(f"{'backend':>34} | {'lm loss max rel':>15} {'grad norm max rel':>17} | {'first loss':>10} {'last loss':>10}")
    print(f"{'Megatron-Core DDP (baseline)':>34} | {'-':>15} {'-':>17} | {base[0][1]:>10.6f} {base[-1][1]:>10.6f}")
    for level in LEVELS:
        rows, _ = torchrun(args.nproc, PRETRAIN_MODEL + list(args.extra) + fsdp(level))
        loss = max(abs(r[1] - b[1]) / abs(b[1]) for r, b in zip(rows, base))
        norm = max(abs(r[2] - b[2]) / abs(b[2]) for r, b in zip(rows, base))
        print(f"{'megatron.fsdp ' + level:>34} | {loss:>15.2e} {norm:>17.2e} | {rows[0][1]:>10.6f} {rows[-1][1]:>10.6f}",
              flush=True)


if __name__ == "__main__":
    main()

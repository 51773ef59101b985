"""``megatron-fsdp-estimate``: what a ``pretrain_gpt.py`` configuration keeps, allocates, sends and saves per rank
at any world size, from the job's own build and step run as a simulation in this process.

    megatron-fsdp-estimate --world-size 1024 [--rank R ...] [--gpus-per-node 8] [--hardware h100-sxm]
        [--json PATH] <pretrain_gpt.py flags>

Each rank asked (default: the first and the last rank, which hold the first and the last pipeline stage) is built
and stepped in turn, in this process, as rank R of N on torch's fake process group with fake tensors: no weight is
allocated and no byte is sent (``world.py``). The estimate reads no data, writes no checkpoint and no scalar: the
flags that would (``--data-path``, ``--save``, ``--load``, the writers) are replaced, with one line saying so.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from typing import List, Optional

from megatron.fsdp.commands import ESTIMATE, set_command_defaults

# What the estimate leaves unset (with mock data instead): it reads, writes and logs nothing of the run it estimates.
_UNSET = ("data_path", "train_data_path", "valid_data_path", "test_data_path", "save", "load", "tensorboard_dir",
          "wandb_project")


def add_estimate_args(parser: argparse.ArgumentParser) -> None:
    from .time_model import HARDWARE

    g = parser.add_argument_group(f"estimate ({ESTIMATE})")
    g.add_argument("--world-size", type=int, required=True, help="the number of ranks (GPUs) of the run estimated")
    g.add_argument("--rank", type=int, action="append", dest="estimate_ranks", default=None,
                   help="a rank to estimate (repeat for several; default: the first and the last rank)")
    g.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node: rank r is on node r // G")
    g.add_argument("--hardware", choices=HARDWARE, default="h100-sxm",
                   help="the time model's constants (docs/estimate.md, 'The time model'); this-machine measures "
                        "them here first")
    g.add_argument("--json", dest="estimate_json", default=None, help="also write the estimate here as JSON")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The job's parser plus the estimate's flags."""
    from ...arguments import build_parser

    parser = build_parser()
    parser.description = __doc__.split("\n")[0]
    add_estimate_args(parser)
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error(f"--world-size {args.world_size}: give the number of ranks, 1 or more")
    if args.gpus_per_node < 1:
        parser.error(f"--gpus-per-node {args.gpus_per_node}: give 1 or more")
    ranks = args.estimate_ranks or sorted({0, args.world_size - 1})
    bad = [r for r in ranks if not 0 <= r < args.world_size]
    if bad:
        parser.error(f"--rank {bad[0]} is outside the world of {args.world_size} ranks (0 to {args.world_size - 1})")
    args.estimate_ranks = sorted(set(ranks))
    if args.num_experts:
        parser.error(f"--num-experts {args.num_experts}: the estimate cannot simulate a mixture of experts yet (the "
                     "token dispatcher sizes its all-to-all from the routing's values, which fake tensors do not "
                     "have); estimate the model without --num-experts for its dense part")
    replaced = [name for name in _UNSET if getattr(args, name, None) not in (None, [])]
    for name in _UNSET:
        setattr(args, name, None)
    if replaced or not args.mock_data:
        args.mock_data = True
        flags = ", ".join("--" + name.replace("_", "-") for name in replaced) or "the data flags"
        print(f" the estimate reads, writes and logs nothing: {flags} replaced (mock data of the same shapes, no "
              "checkpoint, no scalar writer)", flush=True)
    return args


def _host_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def run(args: argparse.Namespace) -> List[dict]:
    """Estimate each rank asked; print its lines and return the JSON's per-rank entries."""
    import copy

    from . import report
    from .allocations import AllocationCounter
    from .one_step import measure_one_step
    from .time_model import StepWork, hardware_named, predict
    from .world import simulated_rank

    hardware = hardware_named(args.hardware)
    entries = []
    for rank in args.estimate_ranks:
        rank_args = copy.deepcopy(args)  # the job's validation completes the namespace in place
        with simulated_rank(args.world_size, rank), AllocationCounter() as counter:
            measurement = measure_one_step(rank_args, counter)
            predicted = predict(measurement, StepWork.from_args(rank_args), hardware, args.gpus_per_node)
        host = _host_peak_bytes()
        for line in report.lines(measurement, args.gpus_per_node, host, predicted, hardware.name):
            print(line, flush=True)
        entries.append(report.rank_json(measurement, args.gpus_per_node, host, predicted))
    if args.estimate_json:
        with open(args.estimate_json, "w") as f:
            json.dump(report.document(args.world_size, args.gpus_per_node, hardware.name, entries, sys.argv[1:]),
                      f, indent=1)
        print(f" estimate written to {args.estimate_json}", flush=True)
    return entries


def main(argv: Optional[List[str]] = None) -> None:
    set_command_defaults()
    from ...training import run_entry_point

    run_entry_point(lambda command_line: run(parse_args(command_line)), argv)


if __name__ == "__main__":
    main()

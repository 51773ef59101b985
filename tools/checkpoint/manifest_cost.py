"""What the checkpoint manifest costs: DCP save with and without checksumming, and the load-time verify.

    python tools/checkpoint/manifest_cost.py [--params 50e6] [--repeats 3]

One process, no process group: a state dict the size of a ``--params`` GPT's checkpoint
(fp32 main weights + Adam's two moments = 12 bytes per parameter, in 1M-element tensors)
is saved with DCP's plain ``FileSystemWriter`` and with ``ChecksummingWriter`` side by
side, then verified as the load does (``checkpoint_manifest.verify``, one rank reading all).
Prints a table of medians and the ratios.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.realpath(__file__))  # its inspect.py would shadow the standard library's
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from megatron.fsdp_training.checkpointing import manifest  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=50e6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args()
    numel = int(args.params) * 3
    state = {f"t{i}": torch.randn(min(1 << 20, numel - i * (1 << 20))) for i in range((numel + (1 << 20) - 1) >> 20)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    base = tempfile.mkdtemp(dir=args.dir)
    times = {"plain save": [], "checksummed save": [], "verify (read + CRC)": []}
    try:
        for r in range(args.repeats):
            for label, writer_cls in (("plain save", dcp.FileSystemWriter), ("checksummed save", manifest.ChecksummingWriter)):
                path = os.path.join(base, f"{r}-{writer_cls.__name__}")
                start = time.perf_counter()
                writer = writer_cls(path)
                dcp.save(state, storage_writer=writer, no_dist=True)
                if writer_cls is manifest.ChecksummingWriter:
                    manifest.write_manifest(path, writer.files)
                times[label].append(time.perf_counter() - start)
                if writer_cls is manifest.ChecksummingWriter:
                    start = time.perf_counter()
                    problems = manifest.verify(path)
                    times["verify (read + CRC)"].append(time.perf_counter() - start)
                    assert not problems, problems
                shutil.rmtree(path)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    plain = statistics.median(times["plain save"])
    print(f"checkpoint of a {args.params / 1e6:.0f}M-parameter model: {nbytes / 2**20:.0f} MiB, "
          f"median of {args.repeats}")
    print(f"| {'step':<22} | {'seconds':>8} | {'vs plain save':>13} |")
    print(f"|{'-' * 24}|{'-' * 10}|{'-' * 15}|")
    for label, values in times.items():
        m = statistics.median(values)
        print(f"| {label:<22} | {m:>8.2f} | {m / plain:>12.2f}x |")


if __name__ == "__main__":
    main()

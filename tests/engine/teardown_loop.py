"""Many 2-rank gloo runs that each train one step and exit as a user script does; count bad exits.

Why a script of its own: the defect it guards against (``terminate
called without an active exception``, or a hang in ``destroy_process_group()``) shows
only when a process really ends, so every run must be a fresh process pair that
finalizes the interpreter. Importing torch costs seconds, so this parent imports it
(and ``torch._dynamo``, which the first optimizer would import) once, freezes its objects
out of the garbage collector and forks each rank (it starts no thread before forking); a
run then costs a group init, one step and an exit (~1 s). Runs go in parallel pairs.

    python tests/engine/teardown_loop.py --runs 50 --parallel 4 [--no-shutdown]

prints one JSON line: runs, failures (exit codes or "hang"), the slowest run.
``--no-shutdown`` skips ``megatron.fsdp.shutdown()`` before ``destroy_process_group()``
(the code path before the fix) to measure how often it failed.
"""

import argparse
import json
import os
import signal
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import gc  # noqa: E402

import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401  (torch.optim.Optimizer imports it lazily: ~3 s in every child otherwise)
import torch.distributed as dist  # noqa: E402

import megatron.fsdp as mfsdp  # noqa: E402

STRATEGIES = ("optim", "optim_grads")  # the levels that leave install gathers in flight after the step


class Block(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def one_rank(rank: int, init_file: str, strategy: str, shutdown: bool) -> None:
    """One rank of one run: a step (ring reduce-scatter + install all-gathers issued), then exit."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = mfsdp.fully_shard(torch.nn.Sequential(Block(64), Block(64)), strategy=strategy, unit_modules=(Block,))
    optimizer = mfsdp.FullyShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    model(torch.randn(4, 64)).square().mean().backward()
    optimizer.step()  # leaves this step's install gathers in flight, as the examples' last step does
    if shutdown:
        mfsdp.shutdown()
    dist.destroy_process_group()


def main() -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--parallel", type=int, default=4, help="runs (rank pairs) at once")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a run counts as a hang")
    p.add_argument("--no-shutdown", action="store_true")
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="mfsdp-teardown-")
    # The children inherit the parent's objects; frozen, their final collection at exit does not
    # walk (and copy-on-write) torch's whole module graph: 2-3 s less per child.
    gc.freeze()
    running, failures, slowest = {}, [], 0.0
    started = 0
    begin = time.monotonic()
    while started < args.runs or running:
        while started < args.runs and len(running) < args.parallel:
            init_file = os.path.join(workdir, f"rendezvous{started}")
            strategy = STRATEGIES[started % len(STRATEGIES)]
            pids = []
            for rank in range(2):
                pid = os.fork()
                if pid == 0:  # the child: a normal interpreter exit (atexit, finalization), never os._exit
                    log = os.open(os.path.join(workdir, f"log{started}.{rank}"), os.O_WRONLY | os.O_CREAT, 0o644)
                    os.dup2(log, 1)
                    os.dup2(log, 2)
                    one_rank(rank, init_file, strategy, not args.no_shutdown)
                    sys.exit(0)
                pids.append(pid)
            running[started] = (pids, time.monotonic(), {})
            started += 1
        time.sleep(0.01)
        for run, (pids, start, codes) in list(running.items()):
            for pid in pids:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            elapsed = time.monotonic() - start
            if len(codes) == 2:
                slowest = max(slowest, elapsed)
                if any(codes.values()):
                    failures.append({"run": run, "exit": list(codes.values()), "log": _tail(workdir, run)})
                del running[run]
            elif elapsed > args.timeout:
                for pid in pids:
                    if pid not in codes:
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                failures.append({"run": run, "exit": "hang", "log": _tail(workdir, run)})
                del running[run]
    return {"runs": args.runs, "failures": failures, "slowest_s": round(slowest, 2),
            "total_s": round(time.monotonic() - begin, 2), "shutdown": not args.no_shutdown}


def _tail(workdir: str, run: int) -> str:
    text = ""
    for rank in range(2):
        with open(os.path.join(workdir, f"log{run}.{rank}"), errors="replace") as f:
            text += f"[rank {rank}] " + f.read()[-300:]
    return text


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)

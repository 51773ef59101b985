"""``torchrun`` for the tests that must kill a rank: one parent imports the job once and forks every rank.

Why not ``torchrun``: each of its ranks imports torch, Megatron-Core and the job again
(~8 s of CPU per rank on 2 cores, more than the run itself), and the SIGKILL-during-save
cases of ``test_checkpointing.py`` cannot run in a worker pool (the kill would take the
pool down). Here the parent imports everything before forking (it starts no thread and
runs no torch op before that), freezes its objects out of the garbage collector (so the
ranks' exits do not copy-on-write the whole module graph), and forks the ranks; each
rank gets the environment torchrun gives it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), runs ``pretrain_gpt.py``'s
``main`` with the given arguments and ends with a normal interpreter exit. As torchrun
does, when one rank fails (an exit status other than 0, or a signal) the others are
stopped (SIGTERM, then SIGKILL after 5 s) and the launcher exits with status 1.

    python tests/training/fork_launch.py --nproc 2 -- PRETRAIN_GPT_ARGUMENTS...

The one ``torchrun`` launch of the suite (``test_pretrain.py``) proves the command line itself.
"""

import argparse
import gc
import os
import signal
import socket
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401  (torch.optim.Optimizer imports it lazily: seconds in every rank)
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.training.arguments  # noqa: E402,F401
from megatron.training.training import main as pretrain_main  # noqa: E402

STOP_GRACE_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, nproc: int, port: int, argv) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.argv = ["pretrain_gpt.py"] + list(argv)
    pretrain_main(list(argv))
    sys.exit(0)  # a normal exit: atexit handlers and finalization run, as under torchrun


def _stop(pids) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while pids and time.monotonic() < deadline:
        for pid in list(pids):
            if os.waitpid(pid, os.WNOHANG)[0]:
                pids.remove(pid)
        time.sleep(0.05)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def launch(nproc: int, argv) -> int:
    port = _free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _rank(rank, nproc, port, argv)
        pids.append(pid)
    running = list(pids)
    while running:
        pid, status = os.wait()
        running.remove(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            print(f"fork_launch: rank {pids.index(pid)} failed (status {os.waitstatus_to_exitcode(status)}); "
                  f"stopping the others", file=sys.stderr, flush=True)
            _stop(running)
            return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    sys.exit(launch(args.nproc, args.argv[1:] if args.argv[:1] == ["--"] else args.argv))

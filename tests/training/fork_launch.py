"""``torchrun`` for the tests that must kill a rank: one parent imports the job once and forks every rank.

Why not ``torchrun``: each of its ranks imports torch, Megatron-Core and the job again
(~8 s of CPU per rank on 2 cores, more than the run itself), and the SIGKILL-during-save
cases of ``test_checkpoint_crash_safety.py`` cannot run in a worker pool (the kill would take the
pool down). Here the parent imports everything before forking (it starts no thread and
runs no torch op before that), freezes its objects out of the garbage collector (so the
ranks' exits do not copy-on-write the whole module graph), and forks the ranks; each
rank gets the environment torchrun gives it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), runs ``pretrain_gpt.py``'s
``main`` with the given arguments and ends with a normal interpreter exit. As torchrun
does, when one rank fails (an exit status other than 0, or a signal) the others are
stopped (SIGTERM, then SIGKILL after 5 s) and the run's status is 1.

One run, printing to this process's output (its status is the launcher's):

    python tests/training/fork_launch.py --nproc 2 -- PRETRAIN_GPT_ARGUMENTS...

Several independent runs from the one import (``--parallel`` at a time), each with
environment variables of its own and its ranks' output in a file of its own; the last
line printed is a JSON list of their statuses:

    python tests/training/fork_launch.py --runs RUNS.json [--parallel 2]
    RUNS.json: [{"nproc": 2, "argv": [...], "env": {...}, "log": "/path/run0.log"}, ...]

A run with ``"trainer": "megatron_lm"`` runs Megatron-LM's trainer instead (``argv``: the script, then its flags),
as ``python -m megatron.fsdp.mcore.megatron_lm`` does; the parent then imports ``megatron.training`` too. With
``"trainer": "bridge"`` it runs a Megatron-Bridge script (``argv`` likewise) as ``__main__``; the parent installs
the test stand-ins for what Bridge imports and this machine lacks (``tests/mcore/trainer_scripts/bridge_standins.py``)
and imports Bridge's trainer. ``"trainer": "script"`` runs any Python script ``argv[0]`` as ``__main__`` (a
converter between runs, say). A run with ``"after": [indices]`` starts only once those runs (positions in the
list) have ended, so dependent runs can share ``--parallel`` with independent ones.

The one ``torchrun`` launch of the suite (``test_pretrain.py``) proves the command line itself.
"""

import argparse
import dataclasses
import gc
import json
import os
import signal
import sys
import time
from typing import Dict, List, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401  (torch.optim.Optimizer imports it lazily: seconds in every rank)
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.fsdp_training.arguments  # noqa: E402,F401
from megatron.fsdp_training.training import main as pretrain_main  # noqa: E402
from megatron.fsdp_training.testing.ports import free_port  # noqa: E402

STOP_GRACE_S = 5.0


@dataclasses.dataclass
class Run:
    nproc: int
    argv: List[str]
    env: Dict[str, str] = dataclasses.field(default_factory=dict)
    log: Optional[str] = None  # None: the launcher's own stdout and stderr
    trainer: str = "job"  # or "megatron_lm" / "bridge": that trainer on the script argv[0]; "script": argv[0]
    after: List[int] = dataclasses.field(default_factory=list)  # runs (indices) that must have ended first
    pids: List[int] = dataclasses.field(default_factory=list)
    running: List[int] = dataclasses.field(default_factory=list)
    status: Optional[int] = None


def _rank(run: Run, rank: int, port: int) -> None:
    if run.log is not None:
        log = os.open(run.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
    os.environ.update(run.env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(run.nproc),
                      LOCAL_WORLD_SIZE=str(run.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if run.trainer == "megatron_lm":
        from megatron.fsdp.mcore import megatron_lm

        megatron_lm.main(list(run.argv))
    elif run.trainer in ("bridge", "script"):
        import runpy

        sys.argv = list(run.argv)
        runpy.run_path(run.argv[0], run_name="__main__")
    else:
        sys.argv = ["pretrain_gpt.py"] + list(run.argv)
        pretrain_main(list(run.argv))
    sys.exit(0)  # a normal exit: atexit handlers and finalization run, as under torchrun


def _start(run: Run) -> None:
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(run.nproc):
        pid = os.fork()
        if pid == 0:
            _rank(run, rank, port)
        run.pids.append(pid)
    run.running = list(run.pids)


def _stop(pids: List[int]) -> None:
    """SIGTERM, then SIGKILL after the grace period; reaps every one of ``pids``."""
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
    pids.clear()


def launch(runs: List[Run], parallel: int = 1) -> List[int]:
    """Run every run (``parallel`` at a time); return their statuses (0, or 1 when a rank failed)."""
    gc.freeze()
    pending, active = list(runs), []
    while pending or active:
        while len(active) < parallel:
            ready = [r for r in pending if all(runs[i].status is not None for i in r.after)]
            if not ready:
                break
            run = ready[0]
            pending.remove(run)
            _start(run)
            active.append(run)
        pid, status = os.wait()
        run = next(r for r in active if pid in r.running)
        run.running.remove(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            print(f"fork_launch: rank {run.pids.index(pid)} failed (status {os.waitstatus_to_exitcode(status)}); "
                  f"stopping the others", file=sys.stderr, flush=True)
            _stop(run.running)
            run.status = 1
        if not run.running:
            run.status = run.status or 0
            active.remove(run)
    return [run.status for run in runs]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, help="one run on this many ranks, with the arguments after --")
    parser.add_argument("--runs", help="a JSON file of runs (see the module docstring)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (with --runs)")
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if (args.nproc is None) == (args.runs is None):
        parser.error("give either --nproc N -- ARGUMENTS... or --runs RUNS.json")
    if args.runs is None:
        sys.exit(launch([Run(args.nproc, args.argv[1:] if args.argv[:1] == ["--"] else args.argv)])[0])
    with open(args.runs) as f:
        runs = [Run(**spec) for spec in json.load(f)]
    if any(run.trainer == "megatron_lm" for run in runs):
        import megatron.training.training  # noqa: F401  (once, before the ranks fork)
        from megatron.fsdp.mcore import megatron_lm

        megatron_lm.install()
    if any(run.trainer == "bridge" for run in runs):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mcore",
                                        "trainer_scripts"))
        import bridge_standins

        bridge_standins.install()
        import megatron.bridge.training.gpt_step  # noqa: F401  (once, before the ranks fork)
        import megatron.bridge.training.pretrain  # noqa: F401
    statuses = launch(runs, args.parallel)
    print(json.dumps(statuses), flush=True)

"""The training job's test arguments and launchers, shared by the tests of ``tests/training/``.

``MODEL``: the tiny GPT every checkpoint test trains (no dropout: runs on other layouts
must draw no masks to match); ``PRETRAIN_MODEL``: the same model with dropout and a
batch, as test_pretrain.py compares it with Megatron-Core DDP. ``pretrain`` runs the job's
training function in the Megatron pool of ``ranks`` (no new process); ``torchrun``
launches ``pretrain_gpt.py`` itself.
"""

import os
import re
import subprocess
import sys

from megatron.fsdp_training.testing.pretrain import pretrain_in_pool
from megatron.fsdp_training.testing.pools import pool_of


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--train-iters", "10", "--lr", "1e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
         "--min-lr", "1e-4", "--mock-data", "--log-interval", "1", "--eval-interval", "5", "--eval-iters", "1",
         "--seed", "7",
         "--hidden-dropout", "0", "--attention-dropout", "0"]  # runs on other layouts must match: no dropout masks
B8 = ["--micro-batch-size", "2", "--global-batch-size", "8"]
B12 = ["--micro-batch-size", "1", "--global-batch-size", "12"]  # divides DP 1, 2, 3 and 4
# 6 iterations: the warm-up, updates built on updates, a validation in the middle and at the end.
PRETRAIN_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                  "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6", "--lr", "1e-3",
                  "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-4", "--mock-data",
                  "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1", "--seed", "7"]
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: ([0-9.E+-]+) \| grad norm: ([0-9.]+) \|")


def fsdp(level):
    """``--use-megatron-fsdp`` at ``level``; None: no flag (Megatron-Core DDP)."""
    return ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", level] if level else []


def pretrain(ranks, argv, **kwargs):
    """``pretrain(parse_args(argv))`` on the Megatron pool of ``ranks``: rank 0's history."""
    return pool_of(ranks).run(pretrain_in_pool, timeout=300, argv=argv, **kwargs)[0]


def torchrun(nproc, argv):
    """``torchrun pretrain_gpt.py argv``: the logged (iteration, lm loss, grad norm) rows (one per
    iteration of ``--train-iters``) and the output."""
    from megatron.fsdp_training.arguments import parse_args, validate_args

    iterations = validate_args(parse_args(argv), nproc).train_iters  # also from --train-samples
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                          "--master_port", "29533", os.path.join(ROOT, "pretrain_gpt.py")] + argv,
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [(int(i), float(loss), float(norm)) for i, loss, norm in LINE.findall(out.stdout)]
    assert [r[0] for r in rows] == list(range(1, iterations + 1)), out.stdout[-2000:]
    return rows, out.stdout


def tree_hashes(root, keep=lambda relative: True):
    """Every file under ``root`` (links as their target path, not followed) -> its SHA-256: the bytes a test
    asserts unchanged. ``keep(relative path)`` selects the files."""
    import hashlib
    from pathlib import Path

    out = {}
    for path in sorted(Path(root).rglob("*")):
        relative = str(path.relative_to(root))
        if not keep(relative):
            continue
        if path.is_symlink():
            out[relative] = "link to " + os.readlink(path)
        elif path.is_file():
            out[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def fork_launch(runs, directory, parallel=1, timeout=300):
    """Real launches of ``runs`` (``[{"nproc", "argv", "env", "log"}, ...]``) by ``tests/training/fork_launch.py``
    (the job imported once, every rank forked; for the tests that kill a rank): their statuses and logs."""
    import json

    spec = os.path.join(str(directory), "runs.json")
    with open(spec, "w") as f:
        json.dump(runs, f)
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "training", "fork_launch.py"), "--runs", spec,
                          "--parallel", str(parallel)], capture_output=True, text=True, env=env, timeout=timeout,
                         cwd=ROOT)
    assert out.returncode == 0 or out.stdout.strip(), out.stderr[-3000:]
    logs = []
    for run in runs:
        with open(run["log"]) as f:
            logs.append(f.read())
    return json.loads(out.stdout.strip().splitlines()[-1]), logs


def assert_exact_resume(straight, resumed, at):
    """A run resumed at iteration ``at`` continues the straight run bitwise (losses, norms, validation)."""
    assert resumed["start_iteration"] == at
    assert resumed["losses"] == straight["losses"][at:]
    assert resumed["grad_norms"] == straight["grad_norms"][at:]
    assert resumed["valid_at_load"] == straight["valid"][0]
    assert resumed["valid"] == straight["valid"][1:]

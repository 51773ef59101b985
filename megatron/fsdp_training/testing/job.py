"""The training job's launch for ``tools/pretrain_report.py``: its parity model and a real ``torchrun``.

``PRETRAIN_MODEL``: the tiny GPT with dropout and a batch that the report (and tests/training/test_pretrain.py)
compares with Megatron-Core DDP; ``fsdp(level)``: the flags of a level; ``torchrun`` launches ``pretrain_gpt.py``
itself and reads the logged rows (``LINE``) back; ``ROOT``: the checkout it launches from. The tests import these
too; what only the tests use (their checkpoint model and batches, the runs in the pools, the forked launches)
lives in tests/cases/job_runs.py.
"""

import os
import re
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout
# 6 iterations: the warm-up, updates built on updates, a validation in the middle and at the end.
PRETRAIN_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                  "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6", "--lr", "1e-3",
                  "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-4", "--mock-data",
                  "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1", "--seed", "7"]
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: ([0-9.E+-]+) \| grad norm: ([0-9.]+) \|")


def fsdp(level):
    """``--use-megatron-fsdp`` at ``level``; None: no flag (Megatron-Core DDP)."""
    return ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", level] if level else []


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

"""What the training job's tests share (tests/training/ and tests/tools/test_generate.py): the test model and
batches, the runs in the Megatron pools, the real launches of ``tests/training/fork_launch.py``, the exact-resume
check, and the worker-side cases several of them run.

``MODEL``: the tiny GPT every checkpoint test trains (no dropout: runs on other layouts must draw no masks to
match); ``B8``, ``B12``: its batches. ``pretrain`` runs the job's training function in the Megatron pool of
``ranks`` (no new process); ``fork_launch`` launches real jobs whose ranks are forked from one import (for the
tests that kill a rank). Worker side (``fn(ctx, **kwargs)``, run in the gloo pools): ``load_error``,
``start_error``, ``full_disk_saves`` and ``generate_in_pool``, and the pieces of cases (``same_values``,
``causal_inputs``); a case only one module runs lives in that module. What ``tools/pretrain_report.py`` runs too
(``PRETRAIN_MODEL``, ``fsdp``, ``torchrun``, ``LINE``, ``ROOT``) is installed:
``megatron/fsdp_training/testing/job.py``."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from megatron.fsdp_training.testing.job import ROOT
from megatron.fsdp_training.testing.megatron_case import megatron_case
from megatron.fsdp_training.testing.pools import pool_of
from megatron.fsdp_training.testing.pretrain import pretrain_in_pool


MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--train-iters", "10", "--lr", "1e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
         "--min-lr", "1e-4", "--mock-data", "--log-interval", "1", "--eval-interval", "5", "--eval-iters", "1",
         "--seed", "7",
         "--hidden-dropout", "0", "--attention-dropout", "0"]  # runs on other layouts must match: no dropout masks
B8 = ["--micro-batch-size", "2", "--global-batch-size", "8"]
B12 = ["--micro-batch-size", "1", "--global-batch-size", "12"]  # divides DP 1, 2, 3 and 4


def pretrain(ranks, argv, **kwargs):
    """``pretrain(parse_args(argv))`` on the Megatron pool of ``ranks``: rank 0's history."""
    return pool_of(ranks).run(pretrain_in_pool, timeout=300, argv=argv, **kwargs)[0]


def tree_hashes(root, keep=lambda relative: True):
    """Every file under ``root`` (links as their target path, not followed) -> its SHA-256: the bytes a test
    asserts unchanged. ``keep(relative path)`` selects the files."""
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


def launch_runs(work: Path, runs: List[dict], read: Callable[[dict, Path, str], dict], parallel: int = 2) -> dict:
    """The trainer tests' runs in one ``fork_launch``, ``parallel`` at a time: each run has a ``name`` (its output
    folder ``work/name`` is its ``LOSSES_DIR``), optionally ``after`` (names of runs that must end first) and
    ``failing`` (expected to stop). ``{name: read(spec, folder, log) + log and status}``; a run that fails
    unexpectedly fails the test."""
    names = [run["name"] for run in runs]
    specs, failing = [], []
    for run in runs:
        run = dict(run)
        out = work / run.pop("name")
        out.mkdir()
        failing.append(run.pop("failing", False))
        run["after"] = [names.index(name) for name in run.get("after", [])]
        specs.append({**run, "log": str(out / "log"), "env": {"LOSSES_DIR": str(out)}})
    statuses, logs = fork_launch(specs, work, parallel=parallel, timeout=900)
    results = {}
    for spec, status, log, expected_failure in zip(specs, statuses, logs, failing):
        out = Path(spec["log"]).parent
        assert expected_failure or status == 0, f"{out.name}: {log[-6000:]}"
        results[out.name] = {**read(spec, out, log), "log": log, "status": status}
    return results


def assert_close(a: Dict[int, float], b: Dict[int, float], rel: float, iterations) -> None:
    """``a`` equals ``b`` within ``rel`` at every one of ``iterations`` (each present in both)."""
    for it in iterations:
        assert it in a and it in b, (a, b)
        assert abs(a[it] - b[it]) <= rel * abs(b[it]), f"iteration {it}: {a[it]!r} vs {b[it]!r}"


def assert_exact_resume(straight, resumed, at):
    """A run resumed at iteration ``at`` continues the straight run bitwise (losses, norms, validation)."""
    assert resumed["start_iteration"] == at
    assert resumed["losses"] == straight["losses"][at:]
    assert resumed["grad_norms"] == straight["grad_norms"][at:]
    assert resumed["valid_at_load"] == straight["valid"][0]
    assert resumed["valid"] == straight["valid"][1:]


def _snapshot(model, optimizer) -> Dict[str, torch.Tensor]:
    """Full weights and this rank's optimizer state (copies), to show a failed load changed nothing."""
    out = {f"model.{k}": v for chunk in model for k, v in chunk.full_state_dict().items()}
    for k, v in optimizer.state_dict().items():
        local = v._local_tensor if hasattr(v, "_local_tensor") else v
        out[f"optimizer.{k}"] = local.clone() if isinstance(local, torch.Tensor) else local
    return out


def same_values(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def causal_inputs(vocab: int, seq: int):
    """Two fixed sequences of ``seq`` tokens below ``vocab``: tokens, positions and the causal mask (True: masked),
    for a direct forward of the job's model."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (2, seq), generator=gen)
    positions = torch.arange(seq).unsqueeze(0).expand(2, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]  # True: masked
    return tokens, positions, mask


def load_error(ctx, argv: List[str]) -> Dict[str, object]:
    """Build the model of ``argv``, try ``--load``: the error, and whether anything changed."""
    from megatron.fsdp_training.checkpointing import save_load as checkpointing
    from megatron.fsdp_training.checkpointing.checkpoint_config import CheckpointConfig
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.job_setup import setup

    args = parse_args(argv)
    with megatron_case():
        _, _, model, optimizer, scheduler = setup(args)
        before = _snapshot(model, optimizer)
        lr = optimizer.param_groups[0]["lr"]
        try:
            checkpointing.load_checkpoint(CheckpointConfig.from_args(args), model, optimizer, scheduler)
            error = None
        except checkpointing.CheckpointError as exc:
            error = str(exc)
        after = _snapshot(model, optimizer)
        unchanged = sorted(before) == sorted(after) and all(same_values(before[k], after[k]) for k in before)
        return {"error": error, "unchanged": unchanged and optimizer.param_groups[0]["lr"] == lr}


def start_error(ctx, argv: List[str], capture_log: bool = False) -> Dict[str, object]:
    """Run the job's ``pretrain`` on ``argv``: the one-line error it stops with (None if it trained), its history,
    and (``capture_log``) rank 0's printed log. Any other exception fails the case."""
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.checkpointing.files import CheckpointError
    from megatron.fsdp_training.errors import ArgumentError
    from megatron.fsdp_training.testing.pretrain import HistoryRecorder
    from megatron.fsdp_training.training import pretrain

    log, recorder = io.StringIO(), HistoryRecorder()
    out: Dict[str, object] = {"error": None, "history": None}
    with megatron_case(), (contextlib.redirect_stdout(log) if capture_log else contextlib.nullcontext()):
        try:
            pretrain(parse_args(argv), observers=[recorder])
            out["history"] = recorder.history
        except (ArgumentError, CheckpointError) as exc:
            out["error"] = str(exc)
    out["log"] = log.getvalue()
    return out


def full_disk_saves(ctx, argv: List[str], directory: str, local: bool = False) -> Dict[str, object]:
    """Save into a size-limited ``directory`` (``--save``; ``local``: ``argv`` names it as the local non-persistent
    directory, and the save is a local non-persistent one): the size check, then a write that really hits ENOSPC.
    Each one's error, and the files left in ``directory``."""
    from megatron.fsdp_training.checkpointing import non_persistent, save_load as checkpointing
    from megatron.fsdp_training.checkpointing.checkpoint_config import CheckpointConfig
    from megatron.fsdp_training.checkpointing import paths as checkpoint_paths
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.job_setup import setup

    args = parse_args(argv if local else argv + ["--save", directory])
    save = non_persistent.save if local else checkpointing.save_checkpoint
    out: Dict[str, object] = {}
    with megatron_case():
        _, _, model, optimizer, scheduler = setup(args)
        for label, patched in (("checked", False), ("enospc", True)):
            original = checkpoint_paths.space_problem
            if patched:  # pretend the estimate fitted: the write itself runs out of space
                checkpoint_paths.space_problem = lambda *a, **k: None
            try:
                save(CheckpointConfig.from_args(args), 2, 16, model, optimizer, scheduler)
                out[label] = None
            except checkpointing.CheckpointError as exc:
                out[label] = str(exc)
            finally:
                checkpoint_paths.space_problem = original
            out[label + "_frames_left_to_the_collector"] = _checkpoint_frames_in_cycles()
            dist.barrier()
            out[label + "_leftovers"] = sorted(str(p.relative_to(directory)) for p in Path(directory).rglob("*")
                                               if p.is_file())
    return out


def _checkpoint_frames_in_cycles() -> List[str]:
    """The checkpoint code's frames (the job's checkpointing, DCP) that only the collector could free now: a
    failed write's frames hold a ``BytesIO`` and a view of its buffer, and CPython 3.12's collector can crash
    freeing the two in the wrong order. Found with ``DEBUG_SAVEALL`` (kept, not freed), then let go."""
    import gc
    import types

    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return sorted({f"{Path(o.f_code.co_filename).name}:{o.f_code.co_name}" for o in gc.garbage
                       if isinstance(o, types.FrameType) and "checkpoint" in o.f_code.co_filename})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def generate_in_pool(ctx, argv: List[str]) -> dict:
    """``tools/generate.py argv`` on the whole pool: the ids every rank generated and rank 0's streamed text."""
    from megatron.fsdp_training.tools import generate

    out = io.StringIO()
    with megatron_case():
        ids = generate.run(generate.parse_args(argv), out=out)
    return {"ids": ids, "text": out.getvalue() if ctx.rank == 0 else None}

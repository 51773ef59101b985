"""A save of pretrain_gpt.py cut short leaves the previous checkpoint to resume from: one rank SIGKILLed at four
points of a save (two with --async-save, one in the writer thread) in real launches, a background write that
fails, and the publish step (a temporary directory renamed into place, the tracker written last, a set-aside copy
that still loads).

Damaged files, a full disk and bad paths: test_checkpoint_failures.py.
"""

import json
import os
import subprocess
import sys
from typing import Dict, List

import pytest

from megatron.fsdp.testing.common import rel
from megatron.fsdp_training.checkpointing import files
from megatron.fsdp_training.testing.job import LINE, ROOT, fsdp
from megatron.fsdp_training.testing.megatron_case import megatron_case
from megatron.fsdp_training.testing.pools import pool_of
from tests.cases.job_runs import B8, MODEL, pretrain


def failing_background_write(ctx, argv: List[str], rank: int, iteration: int) -> Dict[str, object]:
    """``pretrain`` with --async-save whose background write of ``iteration`` fails on ``rank``.

    The failure is the one an unwritable directory gives (the writer's open() raises
    PermissionError): as root, permissions do not stop a write, so the test
    injects it at the write step itself. Returns the error each rank stopped with.
    """
    import torch.distributed as dist

    from megatron.fsdp_training.checkpointing import save_steps
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.checkpointing.files import CheckpointError
    from megatron.fsdp_training.training import pretrain

    real = save_steps.write_pieces

    def write(staged):
        if staged.iteration == iteration and dist.get_rank() == rank:
            raise PermissionError(13, "Permission denied", str(staged.tmp / f"__{rank}_0.distcp"))
        return real(staged)

    save_steps.write_pieces = write
    try:
        with megatron_case():
            pretrain(parse_args(argv))
        return {"error": None}
    except CheckpointError as exc:
        return {"error": str(exc)}
    finally:
        save_steps.write_pieces = real


def _leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_failed_background_write_stops_the_job(tmp_path):
    """Rank 1's background write of iteration 4 fails: every rank stops with one error, the tracker keeps 2."""
    argv = MODEL + B8 + fsdp("optim_grads_params") + ["--save", str(tmp_path), "--save-interval", "2",
                                                       "--async-save"]
    result = pool_of(2).run(failing_background_write, timeout=300,
                             argv=argv, rank=1, iteration=4)
    errors = {r["error"] for r in result}
    assert len(errors) == 1 and None not in errors, errors
    error = errors.pop()
    for fragment in ("checkpoint iteration 4 failed", "rank 1: PermissionError", "Permission denied",
                     "tracker still names iteration 2"):
        assert fragment in error, error
    assert files.read_tracker(tmp_path) == 2 and files.is_complete(tmp_path / "iter_0000002")
    assert not (tmp_path / "iter_0000004").exists()


KILLS = [("after_write", 1, []), ("before_rename", 0, ["--async-save"]), ("after_rename_before_tracker", 0, []),
         ("in_background_write", 1, ["--async-save"])]  # (point, rank killed, save mode)
KILL_PARALLEL = 2  # runs at once: two 2-rank runs keep both cores busy through each other's gloo waits


def _kill_argv(directory, mode):
    return MODEL + B8 + fsdp("optim_grads_params") + ["--train-iters", "4", "--eval-interval", "2",
                                                       "--save", str(directory), "--save-interval", "2"] + mode


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    """Every run of ``KILLS``, killed at its point of the save of iteration 4, on fresh processes
    (``fork_launch.py``: torchrun's environment and failure handling, the job imported once for
    all of them): point -> (checkpoint directory, launcher status, the ranks' output)."""
    root = tmp_path_factory.mktemp("kills")
    runs = [dict(nproc=2, argv=_kill_argv(root / point, mode), env={files.FAULT_ENV: f"{point}:{rank}:4"},
                 log=str(root / f"{point}.log")) for point, rank, mode in KILLS]
    (root / "runs.json").write_text(json.dumps(runs))
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "training", "fork_launch.py"),
                          "--runs", str(root / "runs.json"), "--parallel", str(KILL_PARALLEL)],
                         capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    statuses = json.loads(out.stdout.strip().splitlines()[-1])
    return {point: (root / point, status, (root / f"{point}.log").read_text())
            for (point, _, _), status in zip(KILLS, statuses)}


@pytest.mark.parametrize("point, rank, mode", KILLS)
def test_kill_during_save_leaves_previous_checkpoint(killed_runs, point, rank, mode):
    """SIGKILL of one rank in the save of iteration 4 (sync, or async: in the writer thread while training
    runs, or when publishing): the tracker still names 2, which resumes exactly."""
    directory, status, stdout = killed_runs[point]
    assert status != 0 and f"[rank {rank}] {files.FAULT_ENV}: killing this process at {point}" in stdout, stdout[-2000:]
    logged = [(float(loss), float(norm)) for _, loss, norm in LINE.findall(stdout)]
    assert len(logged) == 4
    assert files.read_tracker(directory) == 2
    assert (directory / "iter_0000004").exists() == (point == "after_rename_before_tracker")
    assert any(n.startswith(".tmp_iter_0000004_") for n in _leftovers(directory)) == (point != "after_rename_before_tracker")
    resumed = pretrain(2, _kill_argv(directory, mode) + ["--load", str(directory)])
    assert resumed["start_iteration"] == 2
    for (loss, norm), got_loss, got_norm in zip(logged[2:], resumed["losses"], resumed["grad_norms"]):
        assert rel(got_loss, loss) <= 1e-6 and abs(got_norm - norm) <= 1e-6  # the log's precision
    assert files.read_tracker(directory) == 4 and _leftovers(directory) == []
    assert files.is_complete(directory / "iter_0000004")


def _fake_checkpoint(directory, marker):
    directory.mkdir(parents=True)
    (directory / ".metadata").write_text(marker)
    files.write_common(directory, {"iteration": marker})


def test_publish_tracker_and_set_aside_copies(tmp_path, monkeypatch):
    _fake_checkpoint(tmp_path / "iter_0000003", "old")
    files.write_tracker(tmp_path, 3)
    tmp = files.temporary_dir(tmp_path, 3, "abcd")
    _fake_checkpoint(tmp, "new")
    (tmp_path / ".tmp_iter_0000009_dead").mkdir()  # a save that died
    assert files.publish(tmp, tmp_path, 3) == tmp_path / "iter_0000003"
    assert (tmp_path / "iter_0000003" / ".metadata").read_text() == "new"
    assert files.read_tracker(tmp_path) == 3 and _leftovers(tmp_path) == []
    # A re-save that died between its two renames: the set-aside copy still loads.
    (tmp_path / "iter_0000003").rename(tmp_path / ".old_iter_0000003_beef")
    assert files.checkpoint_dir(tmp_path, 3) == tmp_path / ".old_iter_0000003_beef"
    with pytest.raises(files.CheckpointError, match="no checkpoint directory iter_0000004"):
        files.checkpoint_dir(tmp_path, 4)
    monkeypatch.setenv(files.FAULT_ENV, "after_rename")
    with pytest.raises(ValueError, match="must be one of"):
        files.check_fault_spec()

"""Checkpoints under failure: damaged files, a full disk, stale temporaries, bad paths,
fault-injection specs and the exit signal handler. Each case gets one line a user can act on."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch.distributed as dist

from megatron.fsdp_training.arguments import ArgumentError, parse_args, validate_args
from megatron.fsdp_training.checkpointing import files
from megatron.fsdp_training.testing.job import ROOT, fsdp
from megatron.fsdp_training.testing.megatron_case import megatron_case
from megatron.fsdp_training.testing.pools import pool_of
from tests.cases.job_runs import B8, MODEL, full_disk_saves, pretrain


def _damage(directory: Path, how: str) -> None:
    root = directory.parent
    distcp = sorted(directory.glob("*.distcp"))[0]
    if how == "truncate":
        with open(distcp, "r+b") as f:
            f.truncate(distcp.stat().st_size // 2)
    elif how == "overwrite":  # same size, finite floats: only a checksum can tell
        import struct
        with open(distcp, "r+b") as f:
            f.seek(min(4096, distcp.stat().st_size // 4))
            f.write(struct.pack("<4096f", *([0.5] * 4096)))
    elif how == "no_metadata":
        (directory / ".metadata").unlink()
    elif how == "binary_tracker":
        (root / "latest_checkpointed_iteration.txt").write_bytes(b"\x00\x9f\xff garbage")


def damaged_loads(ctx, argv: List[str], directory: str, damages: List[str]) -> Dict[str, str]:
    """For each kind of damage: apply it to the newest checkpoint (a pristine copy restored first), try --load."""
    from megatron.fsdp_training.checkpointing import save_load as checkpointing
    from megatron.fsdp_training.checkpointing.checkpoint_config import CheckpointConfig
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.job_setup import setup

    root = Path(directory)
    newest = root / f"iter_{int((root / 'latest_checkpointed_iteration.txt').read_text()):07d}"
    pristine = root.parent / (root.name + "_pristine")
    args = parse_args(argv + ["--load", directory])
    out = {}
    with megatron_case():
        _, _, model, optimizer, scheduler = setup(args)
        if dist.get_rank() == 0:
            shutil.copytree(root, pristine)
        for how in damages:
            if dist.get_rank() == 0:
                shutil.rmtree(root)
                shutil.copytree(pristine, root)
                _damage(newest, how)
            dist.barrier()
            try:
                checkpointing.load_checkpoint(CheckpointConfig.from_args(args), model, optimizer, scheduler)
                out[how] = None
            except checkpointing.CheckpointError as exc:
                out[how] = str(exc)
            dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root)
            shutil.copytree(pristine, root)
    return out


def sigterm_mid_training(ctx, argv: List[str], at_iteration: int) -> Dict[str, object]:
    """Rank 1 (only) gets SIGTERM during iteration ``at_iteration``; with --exit-signal-handler all ranks save and stop."""
    import os
    import signal

    from megatron.fsdp_training import forward_step
    from megatron.fsdp_training.testing.pretrain import pretrain_in_pool

    calls = {"n": 0}
    original = forward_step.mean_loss

    def mean_loss(reduced):
        calls["n"] += 1
        if calls["n"] == at_iteration and dist.get_rank() == dist.get_world_size() - 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only records it
        return original(reduced)

    forward_step.mean_loss = mean_loss
    try:
        history = pretrain_in_pool(ctx, argv)
    finally:
        forward_step.mean_loss = original
    return {"iterations": len(history["losses"]), "handler_restored": signal.getsignal(signal.SIGTERM)}


def test_damaged_checkpoints_name_the_file_and_the_previous_good_one(tmp_path):
    """Truncated / overwritten .distcp, missing .metadata, binary tracker: one line each."""
    argv = MODEL + B8 + fsdp("optim_grads_params") + ["--train-iters", "3", "--eval-interval", "3"]
    save = str(tmp_path / "ckpt")
    pretrain(2, argv + ["--save", save, "--save-interval", "2"])
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    import json
    listed = json.loads((tmp_path / "ckpt" / "iter_0000003" / "manifest.json").read_text())["files"]
    assert ".metadata" in listed and "common.json" in listed and any(n.endswith(".distcp") for n in listed)
    from megatron.fsdp_training.checkpointing import manifest as checkpoint_manifest
    assert checkpoint_manifest.verify(tmp_path / "ckpt" / "iter_0000003") == []  # checksums taken while writing
    errors = pool_of(2).run(damaged_loads, timeout=300, argv=argv,
                             directory=save, damages=["truncate", "overwrite", "no_metadata", "binary_tracker"])
    assert errors[0] == errors[1]
    e = errors[0]
    for how in ("truncate", "overwrite", "no_metadata"):
        assert e[how] and "\n" not in e[how] and "iter_0000003 is damaged" in e[how], e
        assert "--ckpt-step 2" in e[how], e
    assert ".distcp has" in e["truncate"] and "the manifest says" in e["truncate"]
    assert ".distcp fails its checksum" in e["overwrite"]
    assert ".metadata is missing" in e["no_metadata"]
    assert "not an iteration number" in e["binary_tracker"] and "--ckpt-step" in e["binary_tracker"]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint", "inspect.py"), "--verify",
                          os.path.join(save, "iter_0000003")], capture_output=True, text=True, env=_env())
    assert out.returncode == 0 and "verified" in out.stdout, out.stdout + out.stderr


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_full_disk_one_line_and_nothing_left(tmp_path):
    """A tmpfs smaller than the checkpoint: the size check says so; a write that hits ENOSPC says so too."""
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], check=True)
    try:
        argv = MODEL + B8 + fsdp("optim")
        result = pool_of(2).run(full_disk_saves, timeout=300, argv=argv,
                                 directory=str(mount))[0]
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    assert result["checked"].startswith("not enough space to save iteration 2 in ") and "bytes" in result["checked"]
    assert "ran out of space (ENOSPC)" in result["enospc"] and "partial save was removed" in result["enospc"]
    for message in (result["checked"], result["enospc"]):
        assert "\n" not in message
    assert result["checked_leftovers"] == [] and result["enospc_leftovers"] == [], result
    # the failed write's frames are freed as the error is handled, not left in cycles for the collector
    assert result["enospc_frames_left_to_the_collector"] == [], result


def test_stale_temporaries_are_removed_only_when_no_live_job_owns_them(tmp_path):
    import json
    import time

    from megatron.fsdp_training.checkpointing import ownership, paths

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / ".tmp_iter_0000005_dead").mkdir()
    (tmp_path / ".tmp_iter_0000005_dead" / ownership.OWNER).write_text(
        json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "time": time.time()}))
    ownership.write_owner(tmp_path / ".tmp_iter_0000006_live")  # this process: alive
    (tmp_path / ".tmp_iter_0000007_fresh").mkdir()  # no owner file, new: maybe a job just starting
    assert paths.remove_stale_temporaries(tmp_path) == [".tmp_iter_0000005_dead"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp_iter_0000006_live", ".tmp_iter_0000007_fresh"]


@pytest.mark.parametrize("argv, pattern", [
    (["--save", "/etc/hostname/x"], "/etc/hostname is a file, not a directory"),
    (["--load", "/etc/hostname"], "is a file, not a checkpoint directory"),
    (["--load", "/etc"], "is not a checkpoint directory: no latest_checkpointed_iteration.txt"),
    (["--distributed-timeout-minutes", "0"], "must be at least 1"),
    (["--exit-signal-handler"], "needs --save DIR"),
])
def test_bad_paths_and_fault_tolerance_flags_fail_at_start_up(argv, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(["--mock-data", "--use-megatron-fsdp"] + argv), 2)


def test_read_only_save_dir_and_one_checkpoint_as_load_dir(tmp_path):
    from megatron.fsdp_training.checkpointing import paths

    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(ro)], check=True)
    try:
        assert "is not writable (Read-only file system)" in paths.save_dir_problem(str(ro / "x"))
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    one = tmp_path / "iter_0000004"
    one.mkdir()
    (one / ".metadata").write_bytes(b"x")
    assert paths.load_dir_problem(str(one)) == (f"--load {one} is one checkpoint, not a save directory; "
                                                f"pass its parent: --load {tmp_path} --ckpt-step 4")


@pytest.mark.parametrize("spec, pattern", [
    ("after_rename", "must be one of"), ("after_write:x", "RANK must be a non-negative integer"),
    ("after_write:5", "rank 5 does not exist in a job of 2 ranks"), ("after_tracker:1", "only rank 0 reaches"),
])
def test_fault_injection_spec_is_checked_at_start_up(monkeypatch, spec, pattern):
    monkeypatch.setenv(files.FAULT_ENV, spec)
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(["--mock-data"]), 2)


def test_exit_signal_handler_saves_at_the_next_iteration_on_every_rank(tmp_path):
    """SIGTERM on one rank during iteration 2 of 10: every rank saves iteration 2 and stops."""
    save = str(tmp_path / "ckpt")
    argv = MODEL + B8 + fsdp("optim_grads_params") + ["--save", save, "--exit-signal-handler", "--eval-interval", "10"]
    results = pool_of(2).run(sigterm_mid_training, timeout=300, argv=argv,
                              at_iteration=2)
    assert [r["iterations"] for r in results] == [2, 2]
    assert files.read_tracker(tmp_path / "ckpt") == 2

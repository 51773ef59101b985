"""Non-persistent checkpoints (--non-persistent-save-interval, --non-persistent-ckpt-type global / local).

A run saves persistently every 4 iterations and non-persistently every 2, and is stopped after iteration 6
(as if killed): the resumed run loads the non-persistent iteration 6, not --load's 4, and continues the
straight run bitwise; only the newest non-persistent checkpoint is kept; a local checkpoint is not used at
another world size (one line says why, and --load's checkpoint is loaded instead); the refusals. What loses
no work: a rank SIGKILLed in a local save (a real launch) resumes from the newest iteration every rank holds;
a non-persistent directory holding another run's checkpoints is refused, every byte of them unchanged; a
--load holding only non_persistent/ is found without the flags; a full disk is one line, nothing left.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess
from typing import Dict, List

import pytest

from megatron.fsdp_training.arguments import ArgumentError, parse_args, validate_args
from megatron.fsdp_training.checkpointing import files, ownership
from megatron.fsdp_training.checkpointing.non_persistent import _common_iterations
from megatron.fsdp_training.testing.job import fsdp
from megatron.fsdp_training.testing.pools import pool_of
from tests.cases.job_runs import B8, MODEL, fork_launch, full_disk_saves, pretrain, start_error, tree_hashes


class Crash(RuntimeError):
    """What stops the run: as if the job had been killed after the iteration's saves."""


def crashed_after(ctx, argv: List[str], iteration: int) -> Dict[str, object]:
    """``pretrain`` on ``argv``, stopped at the start of iteration ``iteration + 1`` (after iteration ``iteration``
    and its saves): whether it crashed there, and rank 0's log."""
    from megatron.fsdp_training import trainer, training
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.testing.megatron_case import megatron_case

    original = trainer.BatchRampup  # what the loop asks for each iteration's batch

    class Crashing(original):
        def global_batch_at(self, consumed):
            if consumed >= iteration * self.global_batch_size:
                raise Crash(f"stopped after iteration {iteration}")
            return super().global_batch_at(consumed)

    log = io.StringIO()
    crashed = False
    trainer.BatchRampup = Crashing
    try:
        with megatron_case(), contextlib.redirect_stdout(log):
            training.pretrain(parse_args(argv))
    except Crash:
        crashed = True
    finally:
        trainer.BatchRampup = original
    return {"crashed": crashed, "log": log.getvalue()}


def local_write_fails(ctx, argv: List[str], rank: int, iteration: int) -> Dict[str, object]:
    """``pretrain`` on ``argv`` (local non-persistent saves), with ``rank``'s write of ``iteration`` failing: the
    one-line error every rank stops with."""
    import torch.distributed as dist

    from megatron.fsdp_training import training
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.checkpointing import non_persistent
    from megatron.fsdp_training.checkpointing.files import CheckpointError
    from megatron.fsdp_training.testing.megatron_case import megatron_case

    original = non_persistent._write_local

    def failing(config, root, at, *rest):
        if at == iteration and dist.get_rank() == rank:
            raise OSError(28, "No space left on device")
        return original(config, root, at, *rest)

    non_persistent._write_local = failing
    error = None
    try:
        with megatron_case(), contextlib.redirect_stdout(io.StringIO()):
            training.pretrain(parse_args(argv))
    except CheckpointError as exc:
        error = str(exc)
    finally:
        non_persistent._write_local = original
    return {"error": error}

ARGV = MODEL + B8 + fsdp("optim_grads_params")
LOCAL = ["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "local"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The run that is never stopped (its saves change nothing: they are not read back); ``save``: its --save."""
    save = tmp_path_factory.mktemp("straight")
    return dict(pretrain(2, ARGV + ["--save", str(save), "--save-interval", "4", "--non-persistent-save-interval",
                                    "2", "--non-persistent-ckpt-type", "global"]), save=save)


@pytest.fixture(scope="module")
def killed_in_a_local_save(tmp_path_factory):
    """One real launch (``fork_launch.py``): local non-persistent saves every 2 iterations, no persistent one
    yet; rank 1 SIGKILLs itself in its save of iteration 6 (its files in its temporary, not renamed) while rank 0
    completes its own (``--exit-signal-handler``: the launcher's SIGTERM after rank 1's death does not cut rank
    0's save short). Returns the run's directory, its arguments, its status and its ranks' output."""
    root = tmp_path_factory.mktemp("local_kill")
    argv = ARGV + ["--save", str(root / "save"), "--save-interval", "100", "--exit-signal-handler", *LOCAL,
                   "--non-persistent-local-ckpt-dir", str(root / "local")]
    statuses, logs = fork_launch([dict(nproc=2, argv=argv, env={files.FAULT_ENV: "in_local_write:1:6"},
                                       log=str(root / "run.log"))], root)
    return root, argv, statuses[0], logs[0]


def _continues_bitwise(straight, resumed, at=6):
    """Resumed after iteration ``at`` (no validation there): the rest of the straight run, bitwise."""
    assert resumed["start_iteration"] == at
    assert resumed["losses"] == straight["losses"][at:] and resumed["grad_norms"] == straight["grad_norms"][at:]
    assert resumed["valid"] == straight["valid"][1:]  # the validation at iteration 10


def _stopped_after_6(argv):
    result = pool_of(2).run(crashed_after, timeout=300, argv=argv, iteration=6)[0]
    assert result["crashed"], result["log"][-2000:]
    return result["log"]


def test_global_resume_loads_the_newer_non_persistent_checkpoint(straight, tmp_path):
    save = tmp_path / "save"
    argv = ARGV + ["--save", str(save), "--save-interval", "4", "--non-persistent-save-interval", "2",
                   "--non-persistent-ckpt-type", "global"]
    log = _stopped_after_6(argv)
    assert f"non-persistent checkpoints: kept iter_0000006 in {save / 'non_persistent'}, removed iter_0000002" in log
    assert files.read_tracker(save) == 4 and files.read_tracker(save / "non_persistent") == 6
    assert sorted(p.name for p in (save / "non_persistent").iterdir()) == ["iter_0000006", files.TRACKER]
    # a --load holding only non_persistent/ (killed before its first persistent save), restarted without the
    # non-persistent flags: found and loaded, said in one line
    only = tmp_path / "only"
    shutil.copytree(save / "non_persistent", only / "non_persistent")
    found = pretrain(2, ARGV + ["--load", str(only), "--exit-interval", "7"], capture_log=True)
    assert (f"loading the global non-persistent checkpoint {only / 'non_persistent' / 'iter_0000006'} (iteration 6): "
            f"--load {only} holds none (found in --load {only}/non_persistent without --non-persistent-ckpt-type: "
            "compared as with --non-persistent-ckpt-type global)") in found["log"], found["log"][-2000:]
    assert found["start_iteration"] == 6 and found["losses"] == straight["losses"][6:7]
    resumed = pretrain(2, argv + ["--load", str(save)], capture_log=True)
    assert (f"loading the global non-persistent checkpoint {save / 'non_persistent' / 'iter_0000006'} (iteration 6): "
            "newer than --load's iteration 4") in resumed["log"]
    _continues_bitwise(straight, resumed)
    # the resumed run saved persistently at 8 and at the end (10), non-persistently at 10 (as Megatron-LM)
    assert files.read_tracker(save) == 10 and files.read_tracker(save / "non_persistent") == 10
    again = pretrain(2, argv + ["--load", str(save)], capture_log=True)  # both at 10: the non-persistent one
    assert again["start_iteration"] == 10 and "as new as --load's iteration 10" in again["log"]


def test_local_resume_and_another_world_size(straight, tmp_path):
    save, local = tmp_path / "save", tmp_path / "local"
    argv = ARGV + ["--save", str(save), "--save-interval", "4", "--non-persistent-save-interval", "2",
                   "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", str(local)]
    log = _stopped_after_6(argv)
    assert f"saved local non-persistent checkpoint at iteration        6 to {local}/rank_*/iter_0000006" in log
    assert "--non-persistent-local-ckpt-algo fully_parallel -> atomic" in log
    for rank in (0, 1):  # each rank its own files, only the newest, and the owner file naming this job's --save
        assert sorted(p.name for p in (local / f"rank_0000{rank}").iterdir()) == [ownership.DIRECTORY_OWNER,
                                                                                "iter_0000006"]
        assert ownership.directory_owner(local / f"rank_0000{rank}") == str(save.resolve())
    assert not (save / "non_persistent").exists() and files.read_tracker(save) == 4
    on_4 = pretrain(4, ARGV + ["--load", str(save), "--non-persistent-ckpt-type", "local",
                               "--non-persistent-local-ckpt-dir", str(local)], capture_log=True)
    assert on_4["start_iteration"] == 4
    line = re.search(r".*local non-persistent checkpoint is not used.*", on_4["log"]).group(0)
    assert "world_size 2 then, 4 now" in line and f"loading --load {save}'s iteration 4" in line, line
    resumed = pretrain(2, argv + ["--load", str(save)], capture_log=True)
    assert (f"loading the local non-persistent checkpoint {local}/rank_*/iter_0000006 (iteration 6): newer than "
            "--load's iteration 4") in resumed["log"]
    _continues_bitwise(straight, resumed)
    # a second job, its own --save and --load, given this job's local directory (saving there, or only loading):
    # refused on every rank with one line naming the owner, every byte of this job's local checkpoints unchanged
    before, other = tree_hashes(local), tmp_path / "other"
    for saving in (LOCAL[:2], []):
        result = pool_of(2).run(start_error, timeout=300, argv=ARGV + saving + [
            "--save", str(other), "--load", str(other), "--non-persistent-ckpt-type", "local",
            "--non-persistent-local-ckpt-dir", str(local)])
        errors = {r["error"] for r in result}
        assert len(errors) == 1 and None not in errors, result
        error = errors.pop()
        assert "\n" not in error and f"holds the non-persistent checkpoints of another job (--save {save}" in error
        assert f"pass another --non-persistent-local-ckpt-dir, or resume that job with --load {save}" in error, error
    assert tree_hashes(local) == before


def test_a_failed_local_save_keeps_the_previous_one_everywhere(tmp_path):
    """Rank 1's local write of iteration 4 fails: every rank stops with one line; both keep iteration 2 only
    (rank 0 drops its new one), so the ranks still agree on their newest."""
    local = tmp_path / "local"
    argv = ARGV + ["--save", str(tmp_path / "save"), "--non-persistent-save-interval", "2",
                   "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", str(local)]
    errors = {r["error"] for r in pool_of(2).run(local_write_fails, timeout=300, argv=argv, rank=1, iteration=4)}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert error.startswith("the local non-persistent save of iteration 4 failed (rank 1: OSError: [Errno 28] No "
                            "space left on device)"), error
    for rank in (0, 1):
        assert sorted(p.name for p in (local / f"rank_0000{rank}").iterdir()) == [ownership.DIRECTORY_OWNER,
                                                                                "iter_0000002"]


def test_a_rank_killed_in_a_local_save_resumes_the_newest_iteration_every_rank_holds(straight,
                                                                                     killed_in_a_local_save):
    """Rank 1 SIGKILLed in its local save of iteration 6 after rank 0 completed its own: rank 0 holds 4 and 6,
    rank 1 only 4. The restart loads 4 (the newest every rank holds complete), says why not 6, continues the
    straight run bitwise, and deletes none of the local checkpoints (every byte unchanged)."""
    root, argv, status, log = killed_in_a_local_save
    assert status == 1 and f"[rank 1] {files.FAULT_ENV}: killing this process at in_local_write" in log, log[-3000:]
    local, save = root / "local", root / "save"
    held = {r: sorted(p.name for p in (local / f"rank_0000{r}").glob("iter_*")) for r in (0, 1)}
    assert held == {0: ["iter_0000004", "iter_0000006"], 1: ["iter_0000004"]}, held
    assert any(p.name.startswith(".tmp_iter_0000006_") for p in (local / "rank_00001").iterdir())
    kept = lambda relative: ".tmp_iter_" not in relative and ownership.LOCK not in relative  # noqa: E731
    before = tree_hashes(local, kept)
    resumed = pretrain(2, argv + ["--load", str(save), "--exit-interval", "5"], capture_log=True)
    assert (f"loading the local non-persistent checkpoint {local}/rank_*/iter_0000004 (iteration 4): --load {save} "
            "holds none; newer iterations not complete on every rank: 6 (missing on rank 1)") in resumed["log"], \
        resumed["log"][-3000:]
    assert resumed["start_iteration"] == 4
    assert resumed["losses"] == straight["losses"][4:5] and resumed["grad_norms"] == straight["grad_norms"][4:5]
    assert tree_hashes(local, kept) == before
    assert not any(p.name.startswith(".tmp_") for p in (local / "rank_00001").iterdir())  # the dead job's, removed


def test_a_non_persistent_directory_holding_another_runs_checkpoints_is_refused(straight, tmp_path):
    """--non-persistent-global-ckpt-dir naming another run's --save: refused at start-up with one line (saving
    there, or only loading from it), before anything is written; every byte of that run's files unchanged."""
    other = tmp_path / "other_run"
    shutil.copytree(straight["save"], other)
    before = tree_hashes(other)
    mine = ["--save", str(tmp_path / "mine"), "--non-persistent-ckpt-type", "global",
            "--non-persistent-global-ckpt-dir", str(other)]
    result = pool_of(2).run(start_error, timeout=300, argv=ARGV + mine + ["--train-iters", "4",
                                                                         "--non-persistent-save-interval", "2"])
    errors = {r["error"] for r in result}
    assert len(errors) == 1 and None not in errors, result
    error = errors.pop()
    assert "\n" not in error and error.startswith(f"--non-persistent-global-ckpt-dir {other} holds checkpoints that no "
                                                   "non-persistent save of this job wrote (iter_0000004"), error
    assert "its non-persistent saves would delete them; pass a new or empty --non-persistent-global-ckpt-dir" in error
    with pytest.raises(ArgumentError, match="they are not this job's to resume"):
        validate_args(parse_args(ARGV + mine + ["--load", str(tmp_path / "mine")]), 2)
    assert tree_hashes(other) == before


def test_a_local_save_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    """A tmpfs smaller than a rank's local checkpoint: the space check stops every rank before anything is
    written; a write that really runs out of space (the check patched) is one line too; no temporary is left."""
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], check=True)
    try:
        argv = ARGV + ["--save", str(tmp_path / "save"), *LOCAL, "--non-persistent-local-ckpt-dir", str(mount)]
        results = pool_of(2).run(full_disk_saves, timeout=300, argv=argv, directory=str(mount), local=True)
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    assert results[0] == results[1], results
    got = results[0]
    assert got["checked"].startswith("the local non-persistent save of iteration 2 was not started (rank 0: not "
                                     f"enough space to save iteration 2 in {mount}/rank_00000: it needs "), got
    assert "pass another --non-persistent-local-ckpt-dir (nothing was written" in got["checked"]
    assert "ran out of space (ENOSPC)" in got["enospc"] and "the partial save was removed" in got["enospc"], got
    assert "unexpected pos" not in got["enospc"] and all("\n" not in got[k] for k in ("checked", "enospc"))
    assert got["checked_leftovers"] == [] and got["enospc_leftovers"] == [], got
    assert got["enospc_frames_left_to_the_collector"] == [], got


def test_an_older_non_persistent_checkpoint_and_ckpt_step(tmp_path):
    """--load's iteration 4 is newer than the non-persistent 3: it is loaded, said in one line; --ckpt-step
    names a persistent checkpoint, said in one line too."""
    save = tmp_path / "save"
    argv = ARGV + ["--train-iters", "4", "--non-persistent-ckpt-type", "global"]
    first = pretrain(2, argv + ["--save", str(save), "--save-interval", "4", "--non-persistent-save-interval", "3",
                                "--async-save"], capture_log=True)
    assert "--async-save (non-persistent saves) -> synchronous non-persistent saves" in first["log"]
    assert files.read_tracker(save) == 4 and files.read_tracker(save / "non_persistent") == 3
    older = pretrain(2, argv + ["--load", str(save)], capture_log=True)
    assert older["start_iteration"] == 4
    assert (f"loading --load {save}'s iteration 4: the global non-persistent checkpoint (iteration 3) is older"
            in older["log"])
    named = pretrain(2, argv + ["--load", str(save), "--ckpt-step", "4"], capture_log=True)
    assert named["start_iteration"] == 4
    assert ("--ckpt-step 4: loading --load's iteration 4, not the global non-persistent checkpoint of iteration 3"
            in named["log"])
    damaged = next((save / "non_persistent" / "iter_0000003").glob("*.distcp"))
    damaged.write_bytes(damaged.read_bytes()[:-8])
    fallback = pretrain(2, argv + ["--load", str(save)], capture_log=True)
    line = re.search(r".*global non-persistent checkpoint is not used.*", fallback["log"]).group(0)
    assert f"{damaged.parent} is damaged: {damaged} has" in line and f"loading --load {save}'s iteration 4" in line


@pytest.mark.parametrize("extra, pattern", [
    (["--non-persistent-ckpt-type", "in_memory", "--non-persistent-save-interval", "2"],
     "in_memory is not implemented"),
    (["--non-persistent-save-interval", "2"], "needs --non-persistent-ckpt-type global or local"),
    (["--non-persistent-save-interval", "0", "--non-persistent-ckpt-type", "global"], "must be at least 1"),
    (["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", "2"],
     "needs --non-persistent-local-ckpt-dir"),
    (["--non-persistent-local-ckpt-dir", "x"], "read only with --non-persistent-ckpt-type local"),
    (["--non-persistent-ckpt-type", "local", "--non-persistent-global-ckpt-dir", "x",
      "--non-persistent-local-ckpt-dir", "y"], "read only with --non-persistent-ckpt-type global"),
    (["--non-persistent-local-ckpt-algo", "atomic"], "read only with --non-persistent-ckpt-type local"),
    (["--non-persistent-ckpt-type", "global"], "only loads: it needs --load"),
    (["--non-persistent-ckpt-type", "global", "--non-persistent-save-interval", "2",
      "--non-persistent-global-ckpt-dir", "SAVE"], "is the --save directory"),
])
def test_refusals(tmp_path, extra, pattern):
    extra = [str(tmp_path) if a == "SAVE" else a for a in extra]
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(["--mock-data", "--save", str(tmp_path)] + fsdp("optim_grads_params") + extra), 2)


@pytest.mark.parametrize("argv, pattern", [
    (["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "global"], "needs --save DIR"),
    (["--save", "SAVE", "--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "global"],
     "implemented for --use-megatron-fsdp --ckpt-format fsdp_dtensor"),
])
def test_refusals_without_save_or_fsdp(tmp_path, argv, pattern):
    argv = [str(tmp_path) if a == "SAVE" else a for a in argv]
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(["--mock-data"] + argv), 2)


def test_common_iterations_name_why_no_local_checkpoint_is_used():
    """Every rank's complete local iterations (gathered): the ones every rank holds, newest first."""
    assert _common_iterations([[6, 4], [6, 4]], "L") == ([6, 4], None)
    assert _common_iterations([[6, 4], [4]], "L") == ([4], None)  # a save killed on rank 1 after rank 0's
    assert _common_iterations([[6], []], "L") == ([], "rank 1 holds no complete local checkpoint in L")
    assert _common_iterations([[], []], "L") == ([], "no local checkpoint in L")
    assert _common_iterations([[6], [4]], "L") == (
        [], "no iteration is complete on every rank (rank 0: 6; rank 1: 4)")


def test_a_load_directory_with_only_non_persistent_checkpoints_is_one(tmp_path):
    """A job killed before its first persistent save leaves --save with only non_persistent/ inside: --load takes it."""
    from megatron.fsdp_training.checkpointing.paths import load_dir_problem

    (tmp_path / "non_persistent").mkdir()
    assert load_dir_problem(str(tmp_path)) is None
    (tmp_path / "other").mkdir()
    assert "is not a checkpoint directory" in load_dir_problem(str(tmp_path))

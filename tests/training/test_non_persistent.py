"""Non-persistent checkpoints (--non-persistent-save-interval, --non-persistent-ckpt-type global / local).

A run saves persistently every 4 iterations and non-persistently every 2, and is stopped after iteration 6
(as if killed): the resumed run loads the non-persistent iteration 6, not --load's 4, and continues the
straight run bitwise; only the newest non-persistent checkpoint is kept; a local checkpoint is not used at
another world size (one line says why, and --load's checkpoint is loaded instead); the refusals.
"""

import re

import pytest

from megatron.fsdp_training.arguments.parser import ArgumentError, parse_args, validate_args
from megatron.fsdp_training.checkpointing import files
from megatron.fsdp_training.checkpointing.non_persistent import _local_verdict
from megatron.fsdp_training.testing.job import B8, MODEL, fsdp, pretrain
from megatron.fsdp_training.testing.pools import pool_of
from tests.cases.non_persistent import crashed_after, local_write_fails

ARGV = MODEL + B8 + fsdp("optim_grads_params")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The run that is never stopped (its saves change nothing: they are not read back)."""
    return pretrain(2, ARGV + ["--save", str(tmp_path_factory.mktemp("straight")), "--save-interval", "4",
                               "--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "global"])


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
    for rank in (0, 1):  # each rank its own files, only the newest
        assert sorted(p.name for p in (local / f"rank_0000{rank}").iterdir()) == ["iter_0000006"]
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
        assert sorted(p.name for p in (local / f"rank_0000{rank}").iterdir()) == ["iter_0000002"]


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


def test_local_verdict_names_why_a_local_checkpoint_is_not_used():
    """Every rank's newest complete local checkpoint (gathered): used only if all agree, verify and fit."""
    ok = {"iteration": 6, "layout": "", "problem": None}
    assert _local_verdict([ok, ok], "L") == (6, None)
    assert _local_verdict([ok, {"iteration": None}], "L") == (None, "rank 1 holds no complete local checkpoint in L")
    assert _local_verdict([{"iteration": None}] * 2, "L") == (None, "no local checkpoint in L")
    assert _local_verdict([ok, dict(ok, iteration=4)], "L") == (
        None, "the ranks' newest complete local checkpoints differ (rank 1: iteration 4; rank 0: iteration 6)")
    assert _local_verdict([ok, dict(ok, problem="L/x is missing")], "L") == (
        None, "rank 1's is damaged: L/x is missing")
    assert _local_verdict([dict(ok, layout="world_size 2 then, 4 now"), ok], "L")[1] == (
        "it was saved with another layout (world_size 2 then, 4 now)")


def test_a_load_directory_with_only_non_persistent_checkpoints_is_one(tmp_path):
    """A job killed before its first persistent save leaves --save with only non_persistent/ inside: --load takes it."""
    from megatron.fsdp_training.checkpointing.paths import load_dir_problem

    (tmp_path / "non_persistent").mkdir()
    assert load_dir_problem(str(tmp_path)) is None
    (tmp_path / "other").mkdir()
    assert "is not a checkpoint directory" in load_dir_problem(str(tmp_path))

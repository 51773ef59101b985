"""A resume does what the command line says, nobody clobbers a checkpoint, the free-space check scales.

One checkpoint directory (``six``: 6 iterations on 2 ranks, saved at 2, 4 and 6) serves most cases; each
case that changes files works on a copy. The jobs run in the Megatron pool (the job's own ``pretrain`` on a
parsed command line); the two jobs at once and the killed job run as real launches (``fork_launch.py``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import types
from pathlib import Path
from typing import Dict, List

import pytest
import torch.distributed as dist

from megatron.fsdp.commands import CONVERT
from megatron.fsdp_training.arguments import ArgumentError, parse_args, validate_args
from megatron.fsdp_training.checkpointing import files, ownership
from megatron.fsdp_training.testing.job import fsdp
from megatron.fsdp_training.testing.megatron_case import megatron_case
from megatron.fsdp_training.testing.pools import pool_of
from megatron.fsdp_training.tools.checkpoint_tools import inspect as ckpt_inspect
from tests.cases.job_runs import B8, MODEL, fork_launch, load_error, pretrain, start_error, tree_hashes


def save_size_estimate(ctx, argv: List[str]) -> Dict[str, int]:
    """Train and save once (``argv`` has ``--save``): the save's size estimate, and the bytes it wrote."""
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.checkpointing import files, paths, save_load
    from megatron.fsdp_training.training import pretrain

    args = parse_args(argv)
    estimates = []
    estimate = save_load.estimate_bytes

    def recording(state, group=None):
        estimates.append(estimate(state, group))
        return estimates[-1]
    save_load.estimate_bytes = recording
    try:
        with megatron_case():
            pretrain(args)
    finally:
        save_load.estimate_bytes = estimate
    dist.barrier()
    root = Path(args.save)
    written = paths.directory_bytes(files.checkpoint_dir(root, files.read_tracker(root)))
    return {"estimate": estimates[-1], "written": written}

SIX = MODEL + B8 + fsdp("optim") + ["--train-iters", "6", "--eval-interval", "6"]
LR = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| learning rate: ([0-9.E+-]+) \|")


@pytest.fixture(scope="module")
def six(tmp_path_factory):
    directory = tmp_path_factory.mktemp("six") / "ckpt"
    pretrain(2, SIX + ["--save", str(directory), "--save-interval", "2"])
    assert files.read_tracker(directory) == 6
    return directory


def _copy(six, tmp_path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(six, target)
    return target


def _load_error(argv):
    result = pool_of(2).run(load_error, timeout=300, argv=argv)
    assert len({r["error"] for r in result}) == 1, result  # every rank raises the same line
    return result[0]


def _start(argv, ranks=2, capture_log=False):
    result = pool_of(ranks).run(start_error, timeout=300, argv=argv, capture_log=capture_log)
    assert len({r["error"] for r in result}) == 1, result
    return result[0]


def _expected_lrs(argv, iterations):
    """The learning rates Megatron-Core's scheduler gives ``argv``'s schedule after each of ``iterations``."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron.fsdp_training import model as model_lib

    args = validate_args(parse_args(argv), 2)
    args.use_checkpoint_opt_param_scheduler = False
    sched = model_lib.scheduler(model_lib.ScheduleConfig.from_args(args), types.SimpleNamespace(param_groups=[{}]))
    assert isinstance(sched, OptimizerParamScheduler)
    return [sched.get_lr({}) for _ in iterations if sched.step(args.global_batch_size) is None]


# ----------------------------------------------------------------- 1. the schedule rule
def test_a_different_schedule_stops_the_load_naming_each_value_and_both_flags(six):
    """29.1: --train-iters 8 --lr 0.002 from iteration 6 used to train at LR 0; --lr-decay-style constant and a
    new --global-batch-size were ignored. Without a flag each stops with one line; extending a run whose decay
    length is fixed (--lr-decay-iters 6) loads."""
    cases = [
        (["--train-iters", "8", "--lr", "0.002"],
         ["max_lr 0.001 in the checkpoint, 0.002 now (--lr)", "lr_decay_steps 48 in the checkpoint, 64 now"]),
        (["--lr", "0.01", "--lr-decay-style", "constant"],
         ["max_lr 0.001 in the checkpoint, 0.01 now", "lr_decay_style 'cosine' in the checkpoint, 'constant' now"]),
        (["--global-batch-size", "12"],
         ["lr_warmup_steps 16 in the checkpoint, 24 now", "lr_decay_steps 48 in the checkpoint, 72 now"]),
    ]
    for extra, fragments in cases:
        result = _load_error(SIX + extra + ["--load", str(six)])
        error = result["error"]
        assert error is not None and "\n" not in error, (extra, error)
        assert all(f in error for f in fragments), error
        assert "--override-opt_param-scheduler" in error and "--use-checkpoint-opt_param-scheduler" in error
        assert result["unchanged"]
    extended = _load_error(SIX + ["--train-iters", "8", "--lr-decay-iters", "6", "--load", str(six)])
    assert extended["error"] is None


def test_override_and_use_checkpoint_flags_decide_which_schedule_trains(six):
    resume = SIX + ["--train-iters", "8", "--lr", "0.002", "--load", str(six)]
    override = _start(resume + ["--override-opt_param-scheduler"], capture_log=True)
    assert override["error"] is None and override["history"]["start_iteration"] == 6
    lrs = [(int(i), float(lr)) for i, lr in LR.findall(override["log"])]
    expected = _expected_lrs(SIX + ["--train-iters", "8", "--lr", "0.002"], range(8))[6:]
    assert [i for i, _ in lrs] == [7, 8] and all(lr > 0 for _, lr in lrs), override["log"][-2000:]
    assert [lr for _, lr in lrs] == pytest.approx(expected, rel=1e-6)
    kept = _start(resume + ["--use-checkpoint-opt_param-scheduler"], capture_log=True)
    assert kept["error"] is None
    assert [float(lr) for _, lr in LR.findall(kept["log"])] == pytest.approx([1e-4, 1e-4])  # its decay ended at 6
    with pytest.raises(ArgumentError, match="exclude each other"):
        validate_args(parse_args(resume + ["--override-opt_param-scheduler",
                                           "--use-checkpoint-opt-param-scheduler"]), 2)


# ----------------------------------------------------------------- 8. numerics compared
def test_norm_epsilon_and_the_other_numeric_model_args_are_compared(six):
    result = _load_error(SIX + ["--norm-epsilon", "0.001", "--load", str(six)])
    assert result["error"] is not None and "--norm-epsilon 1e-05 in the checkpoint, 0.001 now" in result["error"]
    assert result["unchanged"]


# ----------------------------------------------------------------- 4. no tracker
def test_no_tracker_loads_the_newest_verified_checkpoint_and_never_overwrites_a_newer_one(six, tmp_path):
    """29.4: without the tracker the job started at 0 and overwrote iter_2 and 4, the tracker behind iter_6."""
    root = _copy(six, tmp_path)
    (root / files.TRACKER).unlink()
    before = {p.name: (p / "manifest.json").read_bytes() for p in root.glob("iter_*")}
    fresh = _start(SIX + ["--save", str(root)])  # no --load: a fresh run into a used directory
    assert fresh["error"] is not None and "holds iter_0000006, iter_0000004, iter_0000002" in fresh["error"]
    rollback = _start(SIX + ["--load", str(root), "--ckpt-step", "2", "--save", str(root)])
    assert "newer than iteration 2" in rollback["error"] and "\n" not in rollback["error"]
    assert {p.name: (p / "manifest.json").read_bytes() for p in root.glob("iter_*")} == before
    _overwrite_floats(root / "iter_0000006")
    resumed = _start(SIX + ["--train-iters", "8", "--lr-decay-iters", "6", "--load", str(root), "--save",
                            str(root), "--save-interval", "2"], capture_log=True)
    assert resumed["error"] is None and resumed["history"]["start_iteration"] == 4
    log = resumed["log"]
    assert (f" no {files.TRACKER} in {root}: loading its newest complete checkpoint that verifies, iteration 4; "
            "newer ones that fail verification: 6") in log
    assert "the damaged checkpoints of iterations 6" in log
    assert files.read_tracker(root) == 8
    assert (root / "iter_0000002" / "manifest.json").read_bytes() == before["iter_0000002"]


def _overwrite_floats(directory: Path) -> None:
    """Same size, finite floats: only a checksum can tell (as a damaged copy looks)."""
    import struct

    distcp = sorted(directory.glob("*.distcp"))[0]
    with open(distcp, "r+b") as f:
        f.seek(4096)
        f.write(struct.pack("<1024f", *([0.5] * 1024)))


# ----------------------------------------------------------------- 6, 7 and 11: damage and hints
def test_a_deleted_manifest_and_the_hint_to_a_checkpoint_that_verifies(six, tmp_path, capsys):
    root = _copy(six, tmp_path)
    (root / "iter_0000006" / "manifest.json").unlink()
    _overwrite_floats(root / "iter_0000004")  # right sizes, wrong checksums: the hint must skip it
    error = _load_error(SIX + ["--load", str(root)])["error"]
    assert error is not None and "iter_0000006/manifest.json is missing" in error, error
    assert error.endswith("load the previous good checkpoint with --ckpt-step 2"), error
    assert ckpt_inspect.verify(root / "iter_0000006") == 1  # tools/checkpoint/inspect.py --verify
    out = capsys.readouterr().out
    assert "damaged: " in out and "manifest.json is missing" in out and "(--ckpt-step 2)" in out, out
    (root / files.TRACKER).write_text("10\n")  # 11: a tracker naming a missing directory
    error = _load_error(SIX + ["--load", str(root)])["error"]
    assert "no checkpoint directory iter_0000010" in error and error.endswith("pass --ckpt-step 2"), error
    below = _load_error(SIX + ["--train-iters", "3", "--lr-decay-iters", "6", "--load", str(six)])["error"]
    assert "--train-iters 3 is below the iteration of checkpoint" in below and "(6)" in below, below


def test_torch_dist_directory_under_fsdp_names_the_converter(tmp_path):
    directory = tmp_path / "td" / "iter_0000002"
    directory.mkdir(parents=True)
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (directory / ".metadata").write_bytes(b"x")
    (tmp_path / "td" / files.TRACKER).write_text("2\n")
    error = _load_error(SIX + ["--load", str(tmp_path / "td")])["error"]
    assert "is a torch_dist checkpoint" in error and f"{CONVERT} from-torch-dist" in error, error


def test_set_aside_copies_are_reported_at_start_up(tmp_path, capsys):
    (tmp_path / ".old_iter_0000004_abcd").mkdir()
    validate_args(parse_args(SIX + ["--save", str(tmp_path)]), 2)
    assert "holds 1 copies set aside by an interrupted re-save of an iteration (.old_iter_0000004_abcd)" in \
        capsys.readouterr().out


def test_minor_lines_name_what_they_mean():
    from megatron.fsdp.collectives.comm import CollectiveError
    from megatron.fsdp_training.logs.lines import end_of_run_line

    assert "(purpose: FSDP unit 0)" in str(CollectiveError("all_gather", "dp_shard", "0", RuntimeError("x")))
    assert "tokens per second: 0.0" in end_of_run_line(0, 1.0, 0.0, 0, 5.0)


# ----------------------------------------------------------------- 5. free space
def test_free_space_estimate_is_within_10_percent_of_what_the_save_writes(tmp_path):
    """29.5: DTensor.numel() on every rank made the estimate 1.7x the checkpoint at 2 ranks, 3.4x at 4: a 1.9 MB
    save was refused with 3 MiB free. Here every save goes to a 3 MiB tmpfs."""
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], check=True)
    try:
        for ranks in (2, 4):
            save = mount / f"dp{ranks}"
            result = pool_of(ranks).run(save_size_estimate, timeout=300,
                                        argv=MODEL + B8 + fsdp("optim_grads_params") + [
                                            "--train-iters", "3", "--eval-interval", "3", "--save", str(save)])[0]
            assert abs(result["estimate"] / result["written"] - 1) < 0.10, (ranks, result)
            shutil.rmtree(save)
    finally:
        subprocess.run(["umount", str(mount)], check=True)


# ----------------------------------------------------------------- 9, 10: data and gloo limits at start-up
def _corpus(tmp_path, top: int = 255, documents: int = 20) -> str:
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / f"c{top}_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(top)
    for _ in range(documents):
        doc = rng.integers(0, top + 1, 200).astype(np.uint16)
        doc[0] = top
        builder.add_document(doc, [doc.size])
    builder.finalize(prefix + ".idx")
    return prefix


DATA = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "1", "--train-iters", "2", "--tokenizer-type", "ByteLevelTokenizer",
        "--split", "9,1,0", "--eval-iters", "1"]


def test_bad_data_files_stop_at_start_up_with_one_line(tmp_path):
    prefix = _corpus(tmp_path)
    validate_args(parse_args(DATA + ["--data-path", prefix]), 1)  # the intact corpus passes
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ArgumentError, match=r"\.bin has 1000 bytes, its index needs 8000 .*truncated"):
        validate_args(parse_args(DATA + ["--data-path", prefix]), 1)
    open(prefix + ".bin", "w").close()
    with pytest.raises(ArgumentError, match=r"\.bin is empty \(0 bytes\)"):
        validate_args(parse_args(DATA + ["--data-path", prefix]), 1)
    open(prefix + ".idx", "w").close()
    with pytest.raises(ArgumentError, match=r"\.idx is empty \(0 bytes\); rebuild it"):
        validate_args(parse_args(DATA + ["--data-path", prefix]), 1)
    with pytest.raises(ArgumentError, match="gives the validation split no weight"):
        validate_args(parse_args(DATA + ["--data-path", _corpus(tmp_path, 254), "--split", "100,0,0"]), 1)


def test_empty_input_to_preprocess_exits_non_zero(tmp_path, capsys):
    from megatron.fsdp_training.tools import preprocess_data as tool

    (tmp_path / "empty.jsonl").write_text("")
    status = tool.cli(["--input", str(tmp_path / "empty.jsonl"), "--tokenizer-type", "ByteLevelTokenizer",
                       "--output-prefix", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert status == 2 and "no document with text under text (0 records read" in err, err
    assert not list(tmp_path.glob("c_*"))


def test_data_with_ids_beyond_the_tokenizer_stops_before_training(tmp_path):
    result = _start(DATA + ["--data-path", _corpus(tmp_path, top=300)], ranks=1)
    assert result["error"] is not None and "holds token id 300, but the tokenizer's vocabulary has 257" in \
        result["error"], result["error"]


def test_alltoall_dispatcher_with_tp_on_gloo_is_refused_at_start_up():
    with pytest.raises(ArgumentError, match="alltoall with --tensor-model-parallel-size 2 does not run on gloo"):
        validate_args(parse_args(["--mock-data", "--num-experts", "4", "--disable-bias-linear",
                                  "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--moe-token-dispatcher-type", "alltoall"]), 2)


# ----------------------------------------------------------------- 3. the --save lock, as real launches
JOB = MODEL + B8 + fsdp("optim") + ["--eval-iters", "0"]


def test_two_jobs_with_one_save_directory_and_a_killed_holder(tmp_path):
    """29.3: two jobs at once with one --save: one stops at start-up naming the other. A job SIGKILLed while it
    holds the lock (mid-save) leaves its lock file: the next job takes it over with one line and resumes."""
    save, killed = str(tmp_path / "ckpt"), str(tmp_path / "killed")
    long = JOB + ["--train-iters", "20", "--save", save, "--save-interval", "10"]
    runs = [{"nproc": 2, "argv": long, "log": str(tmp_path / f"job{k}.log")} for k in range(2)]
    runs.append({"nproc": 2, "argv": JOB + ["--train-iters", "4", "--save", killed, "--save-interval", "2"],
                 "log": str(tmp_path / "killed.log"), "env": {files.FAULT_ENV: "after_tracker:0:2"}})
    statuses, logs = fork_launch(runs, tmp_path, parallel=2)
    assert sorted(statuses[:2]) == [0, 1] and statuses[2] == 1, (statuses, [log[-1500:] for log in logs])
    stopped = logs[statuses.index(1)]
    lines = [line for line in stopped.splitlines() if "is in use by another job" in line]
    assert len(lines) == 1 and re.search(r"\(host \S+, pid \d+, started \d{4}-", lines[0]), stopped[-2000:]
    assert "saved checkpoint" not in stopped
    assert files.read_tracker(Path(save)) == 20 and not (Path(save) / ".save_lock.json").exists()

    assert "killing this process at after_tracker" in logs[2] and (Path(killed) / ".save_lock.json").exists()
    resumed = _start(JOB + ["--train-iters", "4", "--save", killed, "--save-interval", "2", "--load", killed],
                     capture_log=True)
    took = [line for line in resumed["log"].splitlines() if "took over the lock of --save" in line]
    assert resumed["error"] is None and len(took) == 1 and "from a job that is gone" in took[0], resumed["log"]
    assert resumed["history"]["start_iteration"] == 2 and files.read_tracker(Path(killed)) == 4


def test_a_lock_file_that_is_a_symbolic_link_is_refused(tmp_path):
    """A --save copied with ``cp -rs`` (its lock file, left by a killed job, a link to the original's): the job
    never writes through it (O_NOFOLLOW): one line on every rank, the file it points to unchanged."""
    original, copy = tmp_path / "original", tmp_path / "copy"
    original.mkdir()
    (original / ownership.LOCK).write_text(json.dumps({"host": "another-host", "pid": 4242, "time": 0}))
    (original / "notes.txt").write_text("the original run's")
    subprocess.run(["cp", "-rs", str(original), str(copy)], check=True)
    assert (copy / ownership.LOCK).is_symlink()
    before = tree_hashes(original)
    stopped = _start(JOB + ["--train-iters", "4", "--save", str(copy), "--save-interval", "2"])
    error = stopped["error"]
    assert error == (f"--save {copy}: its lock file {copy / ownership.LOCK} is a symbolic link (to "
                     f"{original / ownership.LOCK}; a tree copied with cp -rs?): the lock is never written through a "
                     "link; delete the link (the file it points to is left as it is) and start again"), stopped
    assert tree_hashes(original) == before and (copy / ownership.LOCK).is_symlink()
    assert not list(copy.glob("iter_*"))

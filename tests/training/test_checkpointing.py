"""Checkpoints of pretrain_gpt.py (--save/--load, --ckpt-format fsdp_dtensor): exact resume, resharding,
kills during a save, load errors, conversion to and from a torch file, MoE under another EP size.

Megatron cases run in gloo pools of the size they need (each case uses its whole
pool: ``initialize_model_parallel`` spans the world); only the runs that must be
killed start processes of their own (torchrun).
"""

import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from megatron.fsdp.mcore.checkpoint_keys import ParallelRanks, chunk_keys, global_key, rename_optimizer_key
from megatron.training import checkpoint_files as files
from megatron.training.arguments import ArgumentError, parse_args, validate_args
from tests.conftest import _pool_of
from tools.checkpoint import convert
from tools.checkpoint import inspect as ckpt_inspect

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--train-iters", "10", "--lr", "1e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
         "--min-lr", "1e-4", "--mock-data", "--log-interval", "1", "--eval-interval", "5", "--eval-iters", "1",
         "--seed", "7"]
B8 = ["--micro-batch-size", "2", "--global-batch-size", "8"]
B12 = ["--micro-batch-size", "1", "--global-batch-size", "12"]  # divides DP 1, 2, 3 and 4
LEVELS = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: ([0-9.E+-]+) \| grad norm: ([0-9.]+) \|")


def _fsdp(level):
    return ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", level]


def _pretrain(ranks, argv):
    return _pool_of(ranks).run("tests.training.pretrain_cases:pretrain_in_pool", timeout=300, argv=argv)[0]


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def _assert_exact_resume(straight, resumed, at):
    assert resumed["start_iteration"] == at
    assert resumed["losses"] == straight["losses"][at:]
    assert resumed["grad_norms"] == straight["grad_norms"][at:]
    assert resumed["valid_at_load"] == straight["valid"][0]
    assert resumed["valid"] == straight["valid"][1:]


def _leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# ----------------------------------------------------------------- exact resume
@pytest.mark.parametrize("level", [pytest.param(lv, marks=pytest.mark.slow) for lv in LEVELS[:3]] + [LEVELS[3]])
def test_exact_resume_2_ranks(tmp_path, level):
    """10 iterations (saving at 5 and 10) against a fresh run that loads iteration 5: bitwise equal."""
    argv = MODEL + B8 + _fsdp(level)
    straight = _pretrain(2, argv + ["--save", str(tmp_path), "--save-interval", "5"])
    assert files.read_tracker(tmp_path) == 10 and _leftovers(tmp_path) == []
    resumed = _pretrain(2, argv + ["--load", str(tmp_path), "--ckpt-step", "5"])
    _assert_exact_resume(straight, resumed, 5)


def test_exact_resume_tp2_dp2_with_exit_interval(tmp_path):
    """TP 2 x DP 2 at ZeRO-2: a run that never saved, against --exit-interval 5 (saves, stops) + --load."""
    argv = MODEL + B8 + _fsdp("optim_grads") + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    straight = _pretrain(4, argv)
    first = _pretrain(4, argv + ["--save", str(tmp_path), "--exit-interval", "5"])
    assert len(first["losses"]) == 5 and files.read_tracker(tmp_path) == 5
    resumed = _pretrain(4, argv + ["--load", str(tmp_path), "--save", str(tmp_path)])
    _assert_exact_resume(straight, resumed, 5)
    assert files.read_tracker(tmp_path) == 10  # the end of training saves
    keys = ckpt_inspect.describe(tmp_path / "iter_0000010")["keys"]
    assert {k.split(".")[1] for k in keys if k.startswith("model.")} == {"tp0", "tp1"}


def test_no_load_optim_and_finetune(tmp_path):
    argv = MODEL + B8 + _fsdp("optim_grads_params")
    straight = _pretrain(2, argv + ["--save", str(tmp_path), "--save-interval", "5"])
    fresh_optim = _pretrain(2, argv + ["--load", str(tmp_path), "--ckpt-step", "5", "--no-load-optim"])
    # The loss and gradient of iteration 6 depend on the weights only; its update on the optimizer.
    assert fresh_optim["start_iteration"] == 5
    assert fresh_optim["losses"][0] == straight["losses"][5] and fresh_optim["grad_norms"][0] == straight["grad_norms"][5]
    assert fresh_optim["losses"][1] != straight["losses"][6]
    tuned = _pretrain(2, argv + ["--load", str(tmp_path), "--ckpt-step", "5", "--finetune", "--train-iters", "3"])
    assert tuned["start_iteration"] == 0 and len(tuned["losses"]) == 3 and tuned["valid_at_load"] is None


# ------------------------------------------------------------------- resharding
@pytest.fixture(scope="module")
def dp4_zero3(tmp_path_factory):
    """DP 4 ZeRO-3, 10 iterations, saved at 5 and 10: the run that never stopped."""
    directory = tmp_path_factory.mktemp("dp4_zero3")
    history = _pretrain(4, MODEL + B12 + _fsdp("optim_grads_params") + ["--save", str(directory),
                                                                         "--save-interval", "5"])
    return directory, history


RESHARD = {
    "dp2-zero1": (2, _fsdp("optim")),
    "dp4-hsdp-2x2": (4, _fsdp("optim_grads_params") + ["--num-distributed-optimizer-instances", "2",
                                                         "--outer-dp-sharding-strategy", "no_shard"]),
    "dp1-no_shard": (1, _fsdp("no_shard")),
    "dp3-zero2": (3, _fsdp("optim_grads")),
    "pp2-dp2-zero3": (4, _fsdp("optim_grads_params") + ["--pipeline-model-parallel-size", "2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("target", list(RESHARD))
def test_reshard_dp4_zero3_checkpoint(dp4_zero3, target):
    """Loaded elsewhere: the validation loss before any step and the steps after match the run that never stopped."""
    directory, saved = dp4_zero3
    ranks, layout = RESHARD[target]
    got = _pretrain(ranks, MODEL + B12 + layout + ["--load", str(directory), "--ckpt-step", "5"])
    assert got["start_iteration"] == 5
    assert _rel(got["valid_at_load"], saved["valid"][0]) <= 1e-5, (got["valid_at_load"], saved["valid"][0])
    for key in ("losses", "grad_norms"):
        assert len(got[key]) == 5
        for a, b in zip(got[key], saved[key][5:]):
            assert _rel(a, b) <= 1e-5, (key, got[key], saved[key][5:])


@pytest.mark.slow
def test_virtual_pipeline_checkpoint_loads_without_pipeline(tmp_path):
    """PP 2 x VPP 2 (four chunks' layers under global numbers, tied output on the last stage) -> DP 4 and back."""
    argv = MODEL + B8 + _fsdp("optim_grads_params") + ["--num-layers", "4", "--train-iters", "4",
                                                       "--eval-interval", "2"]
    vpp = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    saved = _pretrain(4, argv + vpp + ["--save", str(tmp_path), "--save-interval", "2"])
    flat = _pretrain(4, argv + ["--load", str(tmp_path), "--ckpt-step", "2"])
    again = _pretrain(4, argv + vpp + ["--load", str(tmp_path), "--ckpt-step", "2"])
    for got in (flat, again):
        assert _rel(got["valid_at_load"], saved["valid"][0]) <= 1e-5
        assert all(_rel(a, b) <= 1e-5 for a, b in zip(got["losses"], saved["losses"][2:]))
    assert again["losses"] == saved["losses"][2:]


# ----------------------------------------------------------------------- faults
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc, argv, env):
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", **env)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                           "--master_port", str(_free_port()), os.path.join(ROOT, "pretrain_gpt.py")] + argv,
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


@pytest.mark.parametrize("point, rank", [("after_write", 1), ("before_rename", 0),
                                         ("after_rename_before_tracker", 0)])
def test_kill_during_save_leaves_previous_checkpoint(tmp_path, point, rank):
    """SIGKILL of one rank in the save of iteration 4: the tracker still names 2, which resumes exactly."""
    argv = MODEL + B8 + _fsdp("optim_grads_params") + ["--train-iters", "4", "--eval-interval", "2",
                                                       "--save", str(tmp_path), "--save-interval", "2"]
    out = _torchrun(2, argv, {files.FAULT_ENV: f"{point}:{rank}:4"})
    assert out.returncode != 0 and f"killing this process at {point}" in out.stdout, out.stdout[-2000:]
    logged = [(float(loss), float(norm)) for _, loss, norm in LINE.findall(out.stdout)]
    assert len(logged) == 4
    assert files.read_tracker(tmp_path) == 2
    assert (tmp_path / "iter_0000004").exists() == (point == "after_rename_before_tracker")
    assert any(n.startswith(".tmp_iter_0000004_") for n in _leftovers(tmp_path)) == (point != "after_rename_before_tracker")
    resumed = _pretrain(2, argv + ["--load", str(tmp_path)])
    assert resumed["start_iteration"] == 2
    for (loss, norm), got_loss, got_norm in zip(logged[2:], resumed["losses"], resumed["grad_norms"]):
        assert _rel(got_loss, loss) <= 1e-6 and abs(got_norm - norm) <= 1e-6  # the log's precision
    assert files.read_tracker(tmp_path) == 4 and _leftovers(tmp_path) == []
    assert files.is_complete(tmp_path / "iter_0000004")


# ------------------------------------------------------------------ load errors
def _crafted(source, target):
    """A copy of ``source`` with a key removed, one added and one shape changed (via the torch file format)."""
    state = convert.read_checkpoint(source)
    state["common"] = files.read_common(source)
    del state["model"]["decoder.layers.1.mlp.linear_fc2.bias"]
    state["model"]["decoder.layers.7.mlp.extra.weight"] = torch.zeros(3)
    state["optimizer"]["state.decoder.layers.0.mlp.linear_fc1.weight.exp_avg"] = torch.zeros(3, 3)
    torch.save(state, target.parent / "crafted.pt")
    return convert.from_torch(str(target.parent / "crafted.pt"), str(target))


def test_load_errors_name_the_problem_and_change_nothing(dp4_zero3, tmp_path):
    directory, _ = dp4_zero3
    crafted = _crafted(directory / "iter_0000005", tmp_path / "crafted")
    cases = [
        (["--hidden-size", "128", "--ffn-hidden-size", "512", "--load", str(directory)],
         ["--hidden-size 64 in the checkpoint, 128 now", "--ffn-hidden-size 256 in the checkpoint, 512 now"]),
        (["--tensor-model-parallel-size", "2", "--load", str(directory)],
         ["--tensor-model-parallel-size 1 in the checkpoint, 2 now", "needs a conversion"]),
        (["--load", str(crafted.parent)],
         ["missing keys: model.decoder.layers.1.mlp.linear_fc2.bias",
          "unexpected keys: model.decoder.layers.7.mlp.extra.weight",
          "mismatched keys: optimizer.state.decoder.layers.0.mlp.linear_fc1.weight.exp_avg (checkpoint (3, 3)"]),
    ]
    for extra, fragments in cases:
        result = _pool_of(4).run("tests.training.checkpoint_cases:load_error", timeout=300,
                                 argv=MODEL + B12 + _fsdp("optim_grads_params") + extra)
        assert len({r["error"] for r in result}) == 1  # every rank raises the same error
        error = result[0]["error"]
        assert error is not None and all(f in error for f in fragments), error
        assert all(r["unchanged"] for r in result)


# ------------------------------------------------------------------- conversion
def test_convert_round_trip(dp4_zero3, tmp_path, capsys):
    """DCP -> torch file -> DCP: the unsharded model gets the same weights and outputs; pretrain resumes from it."""
    directory, saved = dp4_zero3
    model_file, full_file, back = tmp_path / "model.pt", tmp_path / "full.pt", tmp_path / "back"
    convert.to_torch(str(directory), str(model_file), model_only=True, iteration=5)
    convert.to_torch(str(directory), str(full_file), iteration=5)
    convert.from_torch(str(full_file), str(back))
    original, copy = (ckpt_inspect.describe(d)["keys"] for d in (directory / "iter_0000005", back / "iter_0000005"))
    assert {k: v.get("shape") for k, v in original.items()} == {k: v.get("shape") for k, v in copy.items()}
    ckpt_inspect.main([str(back)])
    assert "iteration 5, consumed samples 60, saved on 4 ranks" in capsys.readouterr().out
    result = _pool_of(4).run("tests.training.checkpoint_cases:loaded_vs_unsharded", timeout=300,
                             argv=MODEL + B12 + _fsdp("optim") + ["--load", str(back)], model_file=str(model_file))
    for r in result:
        assert r["iteration"] == 5 and r["compute_matches_main"] and r["weights_equal"], r
        assert r["missing"] == [] and r["unexpected"] == [] and r["max_logit_diff"] <= 1e-5, r
    got = _pretrain(4, MODEL + B12 + _fsdp("optim_grads") + ["--load", str(back)])
    assert _rel(got["valid_at_load"], saved["valid"][0]) <= 1e-6
    assert all(_rel(a, b) <= 1e-5 for a, b in zip(got["losses"], saved["losses"][5:]))


# -------------------------------------------------------------------------- MoE
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--moe-aux-loss-coeff", "0.01",
       "--moe-router-load-balancing-type", "aux_loss", "--train-iters", "4", "--eval-interval", "4"]


def test_moe_checkpoint_loads_under_another_ep(tmp_path):
    """Saved at EP 2 (experts keyed by global index), loaded at EP 1 and EP 4: the same validation loss."""
    argv = MODEL + B8 + MOE + _fsdp("optim_grads_params")
    saved = _pretrain(4, argv + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
                                 "--save", str(tmp_path)])
    keys = ckpt_inspect.describe(tmp_path / "iter_0000004")["keys"]
    assert {k.split("local_experts.")[1].split(".")[0] for k in keys if "local_experts." in k} == {"0", "1", "2", "3"}
    for ep in ("1", "4"):
        got = _pretrain(4, argv + ["--expert-model-parallel-size", ep, "--moe-token-dispatcher-type", "allgather",
                                   "--load", str(tmp_path)])
        assert got["start_iteration"] == 4 and got["losses"] == []
        assert _rel(got["valid_at_load"], saved["valid"][0]) <= 1e-5, (ep, got["valid_at_load"], saved["valid"])


def test_rng_states_round_trip(tmp_path):
    result = _pool_of(2).run("tests.training.checkpoint_cases:rng_round_trip", timeout=300,
                             argv=MODEL + B8 + _fsdp("optim"), directory=str(tmp_path))
    assert all(all(r.values()) for r in result), result


# ----------------------------------------------------- keys, files, arguments
class _Chunk(torch.nn.Module):
    """The attributes of a GPTModel chunk that checkpoint keys read: layer numbers, expert indices, stage."""

    def __init__(self, layer_numbers, experts=None, pre=True, post=True, tied=True):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(torch.nn.Module() for _ in layer_numbers)
        for layer, number in zip(self.decoder.layers, layer_numbers):
            layer.layer_number = number
            layer.mlp = torch.nn.Module()
            if experts is not None:
                layer.mlp.local_expert_indices = experts
        self.pre_process, self.post_process, self.share_embeddings_and_output_weights = pre, post, tied


def test_global_keys():
    stage = _Chunk([3, 4], experts=[2, 3], pre=False)
    plain = ParallelRanks()
    assert global_key("decoder.layers.1.self_attention.linear_qkv.weight", stage, plain) == \
        "decoder.layers.3.self_attention.linear_qkv.weight"
    assert global_key("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", stage, plain) == \
        "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"
    assert global_key("output_layer.weight", stage, plain) == "embedding.word_embeddings.weight"
    assert global_key("output_layer.weight", _Chunk([1], tied=False, pre=False), plain) == "output_layer.weight"
    tp = ParallelRanks(tp=(1, 2), expert_tp=(0, 1), ep=(1, 2))
    assert global_key("decoder.final_layernorm.weight", stage, tp) == "tp1.decoder.final_layernorm.weight"
    assert global_key("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight", stage, tp) == \
        "decoder.layers.2.mlp.experts.local_experts.2.linear_fc2.weight"
    assert global_key("decoder.layers.1.mlp.experts.weight1", stage, tp) == "ep1.decoder.layers.3.mlp.experts.weight1"
    keys = chunk_keys(stage, ["decoder.layers.0.x", "output_layer.weight"], plain)
    assert keys.localize(keys.globalize({"decoder.layers.0.x": 1})) == {"decoder.layers.0.x": 1}
    with pytest.raises(ValueError, match="same checkpoint keys"):
        chunk_keys(stage, ["output_layer.weight", "embedding.word_embeddings.weight"], plain)
    params = {"chunk1.decoder.layers.0.w": "decoder.layers.2.w"}
    assert rename_optimizer_key("state.chunk1.decoder.layers.0.w.exp_avg", params) == "state.decoder.layers.2.w.exp_avg"
    assert rename_optimizer_key("main.chunk1.decoder.layers.0.w", params) == "main.decoder.layers.2.w"
    assert rename_optimizer_key("param_groups.0.lr", params) == "param_groups.0.lr"


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


@pytest.mark.parametrize("argv, pattern", [
    (["--save", "x"], "implemented for --use-megatron-fsdp"),
    (["--use-megatron-fsdp", "--load", "x", "--ckpt-format", "torch"], "fsdp_dtensor only"),
    (["--save-interval", "5"], "needs --save DIR"),
    (["--finetune"], "--finetune needs --load"),
    (["--ckpt-step", "3"], "--ckpt-step needs --load"),
    (["--exit-interval", "0"], "must be at least 1"),
])
def test_checkpoint_argument_errors(argv, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(["--mock-data"] + argv), 2)


# ------------------------------------------------------------ issue 18: damage, full disk, paths
def test_damaged_checkpoints_name_the_file_and_the_previous_good_one(tmp_path):
    """Truncated / overwritten .distcp, missing .metadata, binary tracker: one line each."""
    argv = MODEL + B8 + _fsdp("optim_grads_params") + ["--train-iters", "3", "--eval-interval", "3"]
    save = str(tmp_path / "ckpt")
    _pretrain(2, argv + ["--save", save, "--save-interval", "2"])
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    import json
    listed = json.loads((tmp_path / "ckpt" / "iter_0000003" / "manifest.json").read_text())["files"]
    assert ".metadata" in listed and "common.json" in listed and any(n.endswith(".distcp") for n in listed)
    from megatron.training import checkpoint_manifest
    assert checkpoint_manifest.verify(tmp_path / "ckpt" / "iter_0000003") == []  # checksums taken while writing
    errors = _pool_of(2).run("tests.training.failure_cases:damaged_loads", timeout=300, argv=argv,
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
        argv = MODEL + B8 + _fsdp("optim")
        result = _pool_of(2).run("tests.training.failure_cases:full_disk_saves", timeout=300, argv=argv,
                                 directory=str(mount))[0]
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    assert result["checked"].startswith("not enough space to save iteration 1 in ") and "bytes" in result["checked"]
    assert "ran out of space (ENOSPC)" in result["enospc"] and "partial save was removed" in result["enospc"]
    for message in (result["checked"], result["enospc"]):
        assert "\n" not in message
    assert result["checked_leftovers"] == [] and result["enospc_leftovers"] == [], result


def test_stale_temporaries_are_removed_only_when_no_live_job_owns_them(tmp_path):
    import json
    import time
    from megatron.training import checkpoint_paths as paths

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / ".tmp_iter_0000005_dead").mkdir()
    (tmp_path / ".tmp_iter_0000005_dead" / paths.OWNER).write_text(
        json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "time": time.time()}))
    paths.write_owner(tmp_path / ".tmp_iter_0000006_live")  # this process: alive
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
    from megatron.training import checkpoint_paths as paths

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
    """Issue 18.7: SIGTERM on one rank during iteration 2 of 10: every rank saves iteration 2 and stops."""
    save = str(tmp_path / "ckpt")
    argv = MODEL + B8 + _fsdp("optim_grads_params") + ["--save", save, "--exit-signal-handler", "--eval-interval", "10"]
    results = _pool_of(2).run("tests.training.failure_cases:sigterm_mid_training", timeout=300, argv=argv,
                              at_iteration=2)
    assert [r["iterations"] for r in results] == [2, 2]
    assert files.read_tracker(tmp_path / "ckpt") == 2

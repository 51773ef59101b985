"""``--ckpt-format torch_dist`` (the Megatron-Core DDP baseline, Megatron-Core's dist_checkpointing) and its
conversion to and from ``fsdp_dtensor``: a job moves between DistributedOptimizer and ``--use-megatron-fsdp``.

One chain of four 2-rank runs in the shared pool (no new processes), fp32, dropout 0, per optimizer
layout (Megatron-LM's default dp_reshardable, and fully_reshardable): the baseline saves torch_dist at 5
and 10; it resumes its own checkpoint bitwise; iteration 5 converted to fsdp_dtensor (with the Adam
state) resumes under ZeRO-3 within 1e-5 of the baseline continuing, saving at 7; that converted back
to torch_dist (fully_reshardable) resumes the baseline within 1e-5 again, with the DistributedOptimizer and with
Megatron-Core's non-distributed optimizer alike.
"""

import contextlib
import json
import re
import shutil
import socket
import subprocess
import sys

import pytest

from megatron.fsdp_training.checkpointing import files, manifest, ownership
from megatron.fsdp_training.checkpointing.torch_dist import read_common
from megatron.fsdp.mcore_releases import COMMON_PT, COMMON_STATE_IN_DCP
from megatron.fsdp_training.arguments import ArgumentError, parse_args, validate_args
from megatron.fsdp.testing.common import rel
from megatron.fsdp_training.testing.job import fsdp
from megatron.fsdp.testing.pool import RankError
from megatron.fsdp.commands import CONVERT
from megatron.fsdp_training.tools.checkpoint_tools import convert
from megatron.fsdp_training.tools.checkpoint_tools import inspect as ckpt_inspect
from megatron.fsdp_training.tools.checkpoint_tools import torch_dist_convert, torch_dist_dp_layout
from megatron.fsdp_training.tools.checkpoint_tools.torch_dist_dp_layout import DpReshardable
from tests.cases.job_runs import B8, MODEL, assert_exact_resume, pretrain, tree_hashes

ORIGINAL = DpReshardable._dense_params


BASELINE = MODEL + B8 + ["--use-distributed-optimizer"]
FSDP = MODEL + B8 + fsdp("optim_grads_params")


def _close(got, expected, rtol=1e-5):
    assert len(got) == len(expected) and all(rel(a, b) < rtol for a, b in zip(got, expected)), (got, expected)


def _keys(directory):
    """Every key of a DCP checkpoint (either format) with its global shape and dtype, or "bytes"."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {k: (tuple(md.size), md.properties.dtype) if isinstance(md, TensorStorageMetadata) else "bytes"
            for k, md in FileSystemReader(str(directory)).read_metadata().state_dict_metadata.items()}


BUCKET = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.exp_avg"
PER_PARAMETER = "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight"


@pytest.mark.parametrize("layout", ["dp_reshardable", "fully_reshardable"])
def test_torch_dist_baseline_to_fsdp_and_back(tmp_path, monkeypatch, capsys, layout):
    """Megatron-LM's default optimizer layout (flat buckets) and --dist-ckpt-optim-fully-reshardable's."""
    td, fsdp, back = tmp_path / "torch_dist", tmp_path / "fsdp", tmp_path / "back"
    flag = ["--dist-ckpt-optim-fully-reshardable"] if layout == "fully_reshardable" else []
    straight = pretrain(2, BASELINE + flag + ["--save", str(td), "--save-interval", "5"])
    assert sorted(p.name for p in td.iterdir()) == ["iter_0000005", "iter_0000010", files.TRACKER]
    assert files.read_tracker(td) == 10
    meta = json.loads((td / "iter_0000005" / "metadata.json").read_text())
    assert meta["sharded_backend"] == "torch_dist"
    # the common state: common.pt before Megatron-Core 0.19, inside the DCP files from 0.19; read alike
    assert (td / "iter_0000005" / COMMON_PT).is_file() != COMMON_STATE_IN_DCP
    assert read_common(td / "iter_0000005")["iteration"] == 5
    saved = _keys(td / "iter_0000005")
    assert "decoder.layers.self_attention.linear_qkv.weight" in saved  # Megatron-Core's stacked layers
    assert (BUCKET in saved, PER_PARAMETER in saved) == (layout == "dp_reshardable", layout == "fully_reshardable")

    # (a) the baseline resumes its own torch_dist checkpoint exactly
    resumed = pretrain(2, BASELINE + ["--load", str(td), "--ckpt-step", "5"])
    assert_exact_resume(straight, resumed, 5)
    if layout == "dp_reshardable":  # flat buckets of each model-parallel rank: another TP is one clear line
        with pytest.raises(RankError, match="dp_reshardable layout .* --tensor-model-parallel-size 1 in the "
                                            "checkpoint, 2 now.*--dist-ckpt-optim-fully-reshardable"):
            pretrain(2, BASELINE + ["--load", str(td), "--ckpt-step", "5", "--tensor-model-parallel-size", "2",
                                    "--make-vocab-size-divisible-by", "64"])  # the same padded vocabulary
        # a parameter order that does not fit the buckets is refused, not converted
        with monkeypatch.context() as m:
            m.setattr(DpReshardable, "_dense_params", lambda self, model: ORIGINAL(self, model)[::-1])
            with pytest.raises(SystemExit, match="--dist-ckpt-optim-fully-reshardable"):
                convert.main(["from-torch-dist", str(td), str(tmp_path / "wrong"), "--iteration", "5"])
        # a layout it does not slice (TP or PP > 1): the weights only, said in one line with the fix
        with monkeypatch.context() as m:
            m.setattr(torch_dist_dp_layout.SavedLayout, "problem", lambda layout: "--tensor-model-parallel-size 2")
            convert.main(["from-torch-dist", str(td), str(tmp_path / "weights"), "--iteration", "5"])
        assert re.search(r"optimizer state not converted: .*tensor-model-parallel-size 2.*"
                         r"--dist-ckpt-optim-fully-reshardable; load the result with --no-load-optim",
                         capsys.readouterr().out)
        assert not [k for k in _keys(tmp_path / "weights" / "iter_0000005") if k.startswith("optimizer.state.")]

    # (b) torch_dist -> fsdp_dtensor -> --use-megatron-fsdp ZeRO-3: the baseline's next iterations within 1e-5
    convert.main(["from-torch-dist", str(td), str(fsdp), "--iteration", "5"])
    assert files.read_tracker(fsdp) == 5
    assert manifest.read_manifest(fsdp / "iter_0000005") and manifest.verify(fsdp / "iter_0000005") == []
    moved = pretrain(2, FSDP + ["--load", str(fsdp), "--save", str(fsdp), "--save-interval", "7"])
    assert moved["start_iteration"] == 5
    _close(moved["losses"], straight["losses"][5:])
    _close(moved["grad_norms"], straight["grad_norms"][5:])
    _close([moved["valid_at_load"]] + moved["valid"], straight["valid"])
    # the converted checkpoint has exactly the keys, shapes and dtypes of one the engine wrote
    native, converted = _keys(fsdp / "iter_0000007"), _keys(fsdp / "iter_0000005")
    assert {k: v for k, v in converted.items() if not k.startswith("rng.")} == \
           {k: v for k, v in native.items() if not k.startswith("rng.")}

    # and back: fsdp_dtensor (saved at 7 by the ZeRO-3 run) -> torch_dist -> the baseline resumes within 1e-5
    convert.main(["to-torch-dist", str(fsdp), str(back), "--iteration", "7"])
    assert files.read_tracker(back) == 7
    returned = pretrain(2, BASELINE + ["--load", str(back)])
    assert returned["start_iteration"] == 7
    _close(returned["losses"], straight["losses"][7:])
    _close(returned["losses"], moved["losses"][2:])
    _close(returned["valid"], straight["valid"][1:])
    if layout == "fully_reshardable":  # to-torch-dist writes this layout: the tensors its save writes, no other
        assert {k: v for k, v in _keys(back / "iter_0000007").items() if v != "bytes"} == \
               {k: v for k, v in saved.items() if v != "bytes"}
        # Megatron-Core's non-distributed optimizer (no --use-distributed-optimizer) takes it too, Adam state
        # and step included: the same iterations as the DistributedOptimizer's
        plain = pretrain(2, MODEL + B8 + ["--load", str(back)])
        assert plain["start_iteration"] == 7
        _close(plain["losses"], returned["losses"])
        _close(plain["grad_norms"], returned["grad_norms"])


@pytest.mark.parametrize("argv, pattern", [
    (["--use-megatron-fsdp", "--ckpt-format", "torch_dist", "--save", "x"],
     rf"--use-megatron-fsdp saves and loads --ckpt-format fsdp_dtensor; convert .*{CONVERT} from-torch-dist"),
    (["--ckpt-format", "fsdp_dtensor", "--load", "x"],
     rf"fsdp_dtensor needs --use-megatron-fsdp.*{CONVERT} to-torch-dist"),
    (["--save", "x", "--async-save"], "the baseline's torch_dist saves are synchronous"),
])
def test_ckpt_format_errors_at_start_up(argv, pattern):
    """Before any process group: a format the chosen data-parallel implementation does not write."""
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(["--mock-data"] + argv), 2)


def test_ckpt_format_defaults_to_each_implementation():
    assert validate_args(parse_args(["--mock-data"]), 2).ckpt_format == "torch_dist"
    assert validate_args(parse_args(["--mock-data", "--use-megatron-fsdp"]), 2).ckpt_format == "fsdp_dtensor"


# A process that holds a directory's save lock as a running job holds its --save's (the lock module alone, loaded
# from its file: no torch import), until its stdin closes.
_HOLDER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("ownership", sys.argv[1])
ownership = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ownership)
problem, _ = ownership.acquire_save_lock(sys.argv[2])
print(problem or "held", flush=True)
sys.stdin.read()
ownership.release_save_lock(sys.argv[2])
"""


@contextlib.contextmanager
def _lock_held_elsewhere(root):
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, ownership.__file__, str(root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder.pid
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def _largest_item(directory, within=""):
    """(file, offset, length) of the largest tensor item DCP's .metadata places in a file (of a key containing
    ``within``)."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(directory)).read_metadata().storage_data
    info = max((i for index, i in storage.items() if within in index.fqn), key=lambda i: i.length)
    return directory / info.relative_path, info.offset, info.length


def test_from_torch_dist_checks_its_source_and_holds_its_destination(tmp_path, monkeypatch, capsys):
    """A tracker naming a missing iteration, a missing .metadata, a garbage common.pt, a truncated .distcp: one line
    each, before anything is written (the retry then converts). A failure mid-write leaves the destination as it
    was; a destination whose lock a running job holds is refused. A flipped bit converts (torch_dist has no
    checksums): the manifest records the source as unverified, and --verify and the job's load say so."""
    td, out = tmp_path / "td", tmp_path / "out"
    # fully_reshardable: every tensor is read while the destination is written (the case that left a temporary)
    pretrain(2, BASELINE + ["--dist-ckpt-optim-fully-reshardable", "--train-iters", "4", "--save", str(td),
                            "--save-interval", "4"])

    def refused(source, *extra):
        before = tree_hashes(out) if out.exists() else None
        with pytest.raises(SystemExit) as exc:
            convert.main(["from-torch-dist", str(source), str(out), *extra])
        message = str(exc.value.code)
        assert message.startswith("error: ") and "\n" not in message, message
        assert (tree_hashes(out) if out.exists() else None) == before  # the destination as it was
        return message

    def damaged(how, damage):
        copy = tmp_path / f"td_{how}"
        shutil.copytree(td, copy)
        damage(copy / "iter_0000004")
        return copy

    tracker = damaged("tracker", lambda it: files.write_tracker(it.parent, 9))
    assert refused(tracker).endswith(f"{tracker} has no iter_0000009 (its tracker names iteration 9); pass "
                                     "--iteration N for one it holds (4)")
    no_metadata = damaged("metadata", lambda it: (it / ".metadata").unlink())
    assert f"{no_metadata / 'iter_0000004' / '.metadata'} is missing; nothing was converted" in refused(no_metadata)
    garbage = damaged("common", lambda it: (it / "common.pt").write_bytes(b"not a pickle" * 8))
    assert f"{garbage / 'iter_0000004' / 'common.pt'} is unreadable (" in refused(garbage)

    def truncate(it):
        shard, offset, length = _largest_item(it)
        shard.write_bytes(shard.read_bytes()[:offset + length // 2])
    truncated = damaged("truncated", truncate)
    assert re.search(r"__\d+_\d+\.distcp has \d+ bytes, its \.metadata names bytes up to \d+ \(truncated\)",
                     refused(truncated))
    convert.main(["from-torch-dist", str(td), str(out)])  # the retry: nothing of the failed ones was left
    assert files.read_tracker(out) == 4 and sorted(p.name for p in out.iterdir()) == ["iter_0000004", files.TRACKER]

    # a failure in the middle of writing (--overwrite): its temporary and its lock removed, the rest untouched
    calls = {"n": 0}
    real_read = torch_dist_convert._read

    def failing_read(directory, keys):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(5, "Input/output error")
        return real_read(directory, keys)
    with monkeypatch.context() as m:
        m.setattr(torch_dist_convert, "_read", failing_read)
        assert "from-torch-dist failed (OSError: [Errno 5] Input/output error)" in refused(td, "--overwrite")

    # the --save of a running job (its lock held): refused with one line naming it, until it ends
    with _lock_held_elsewhere(out) as pid:
        message = refused(td, "--overwrite")
        assert (f"the destination {out} is in use by another job (host {socket.gethostname()}, pid {pid}, started"
                in message and message.endswith("or convert into another directory")), message
    convert.main(["from-torch-dist", str(td), str(out), "--overwrite"])
    assert not (out / ownership.LOCK).exists()

    # a flipped bit inside a tensor converts (one nothing cross-checks: an Adam moment): the manifest says the
    # source was not verified, and so do the tools
    def flip(it):
        shard, offset, length = _largest_item(it, within="exp_avg_sq")
        data = bytearray(shard.read_bytes())
        data[offset + length // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    flipped, flipped_out = damaged("flipped", flip), tmp_path / "flipped_out"
    convert.main(["from-torch-dist", str(flipped), str(flipped_out)])
    assert manifest.read_source(flipped_out / "iter_0000004") == {
        "format": "torch_dist", "path": str((flipped / "iter_0000004").resolve()), "verified": False,
        "why": "carries no checksums"}
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        ckpt_inspect.main([str(flipped_out), "--verify"])
    said = capsys.readouterr().out
    assert exc.value.code == 0 and ": verified " not in said, said
    assert (f"are as the conversion wrote them (sizes and CRC-32 match manifest.json); source unverified: converted "
            f"from torch_dist {(flipped / 'iter_0000004').resolve()}, which carries no checksums, so damage the source "
            "held before the conversion is in these files too") in said, said
    loaded = pretrain(2, FSDP + ["--load", str(out), "--train-iters", "4"], capture_log=True)  # loads, trains none
    assert loaded["start_iteration"] == 4 and "source unverified: converted from torch_dist" in loaded["log"]

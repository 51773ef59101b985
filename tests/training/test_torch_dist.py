"""``--ckpt-format torch_dist`` (the Megatron-Core DDP baseline, Megatron-Core's dist_checkpointing) and its
conversion to and from ``fsdp_dtensor``: a job moves between DistributedOptimizer and ``--use-megatron-fsdp``.

One chain of four 2-rank runs in the shared pool (no new processes), fp32, dropout 0, per optimizer
layout (Megatron-LM's default dp_reshardable, and fully_reshardable): the baseline saves torch_dist at 5
and 10; it resumes its own checkpoint bitwise; iteration 5 converted to fsdp_dtensor (with the Adam
state) resumes under ZeRO-3 within 1e-5 of the baseline continuing, saving at 7; that converted back
to torch_dist (fully_reshardable) resumes the baseline within 1e-5 again.
"""

import json
import re

import pytest

from megatron.fsdp_training.checkpointing import files, manifest
from megatron.fsdp_training.arguments.parser import ArgumentError, parse_args, validate_args
from megatron.fsdp.testing.common import rel
from megatron.fsdp_training.testing.job import B8, MODEL, assert_exact_resume, fsdp, pretrain
from megatron.fsdp.testing.pool import RankError
from tools.checkpoint import convert
from tools.checkpoint import torch_dist_dp_layout
from tools.checkpoint.torch_dist_dp_layout import DpReshardable

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
    assert meta["sharded_backend"] == "torch_dist" and (td / "iter_0000005" / "common.pt").is_file()
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
            m.setattr(torch_dist_dp_layout, "_problem", lambda args: "--tensor-model-parallel-size 2")
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


@pytest.mark.parametrize("argv, pattern", [
    (["--use-megatron-fsdp", "--ckpt-format", "torch_dist", "--save", "x"],
     r"--use-megatron-fsdp saves and loads --ckpt-format fsdp_dtensor; convert .*convert.py from-torch-dist"),
    (["--ckpt-format", "fsdp_dtensor", "--load", "x"],
     r"fsdp_dtensor needs --use-megatron-fsdp.*convert.py to-torch-dist"),
    (["--save", "x", "--async-save"], "the baseline's torch_dist saves are synchronous"),
])
def test_ckpt_format_errors_at_start_up(argv, pattern):
    """Before any process group: a format the chosen data-parallel implementation does not write."""
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(["--mock-data"] + argv), 2)


def test_ckpt_format_defaults_to_each_implementation():
    assert validate_args(parse_args(["--mock-data"]), 2).ckpt_format == "torch_dist"
    assert validate_args(parse_args(["--mock-data", "--use-megatron-fsdp"]), 2).ckpt_format == "fsdp_dtensor"

"""Data inputs that would train wrongly or fail late: each is one line at start-up, before any process group.

- an int32 ``.bin`` with the uint16 ``.idx`` of the same documents trained on tokens interleaved with
  zeros: the ``.bin``'s size must be exactly what the index describes (and the reverse, extra bytes, a
  damaged document index are named too);
- blend weights that are zero or negative (a bare ``AssertionError`` of Megatron-Core after the process
  groups, and a gloo error on the other ranks);
- a read-only ``--data-cache-path`` (25 frames), or a read-only data directory without one; a read-only
  directory that already holds the caches trains.
"""

import gc
import subprocess

import numpy as np
import pytest

from megatron.fsdp_training.arguments import ArgumentError, parse_args, validate_args
from tests.cases.corpus import SMALL, corpus


def _validate(argv):
    return validate_args(parse_args(SMALL + argv + ["--split", "9,1,0"]), 1)


def _corpus_in(directory):
    directory.mkdir(exist_ok=True)
    return corpus(directory, 10)


def _rewritten(prefix, dtype):
    """``prefix``'s ``.bin`` written again with ``dtype`` tokens (its ``.idx`` left as it is)."""
    tokens = np.fromfile(prefix + ".bin", dtype=np.uint16)
    tokens.astype(dtype).tofile(prefix + ".bin")


def test_bin_and_idx_must_agree_on_the_token_dtype(tmp_path, capsys):
    from megatron.fsdp_training.training import main

    prefix = corpus(tmp_path, 10)
    _validate(["--data-path", prefix])  # the intact pair passes
    _rewritten(prefix, np.int32)
    argv = ["--data-path", prefix]
    with pytest.raises(ArgumentError) as error:
        _validate(argv)
    message = str(error.value)
    assert (f"{prefix}.bin has 8000 bytes, 2000 tokens of 4 bytes (int32 or float32), but {prefix}.idx says its "
            "tokens are uint16 (4000 bytes): the two files were written with different token dtypes") in message
    with pytest.raises(SystemExit) as status:  # the command: one line, exit status 2, no process group
        main(SMALL + argv + ["--split", "9,1,0"])
    assert status.value.code == 2 and capsys.readouterr().out.strip().splitlines() == [f"error: {message}"]
    other = _corpus_in(tmp_path / "more")
    with open(other + ".bin", "ab") as f:
        f.write(b"\0" * 6)
    with pytest.raises(ArgumentError, match=r"has 4006 bytes, 6 more than .* describes .*do not belong together"):
        _validate(["--data-path", other])
    with open(other + ".idx", "r+b") as f:  # the document index's last entry, past the sequence count
        f.seek(-8, 2)
        f.write(np.int64(99).tobytes())
    with pytest.raises(ArgumentError, match=r"\.idx is damaged \(its offsets or document boundaries"):
        _validate(["--data-path", other])


@pytest.mark.parametrize("weights", [("0", "1"), ("-1", "2"), ("1", "nan")])
def test_blend_weights_must_be_positive(tmp_path, weights, capsys):
    from megatron.fsdp_training.training import main

    a, b = _corpus_in(tmp_path / "a"), _corpus_in(tmp_path / "b")
    _validate(["--data-path", "1", a, "2", b])  # positive weights pass
    argv = ["--data-path", weights[0], a, weights[1], b]
    bad, prefix = (weights[0], a) if float(weights[0]) <= 0 else (weights[1], b)
    with pytest.raises(ArgumentError, match=rf"--data-path: weight {bad} for {prefix}: blend weights must be "
                                            rf"positive .*give {prefix} a positive weight, or leave it out"):
        _validate(argv)
    with pytest.raises(SystemExit) as status:
        main(SMALL + argv + ["--split", "9,1,0"])
    out = capsys.readouterr().out.strip().splitlines()
    assert status.value.code == 2 and len(out) == 1 and "blend weights must be positive" in out[0], out
    with pytest.raises(ArgumentError, match="--train-data-path: weight 0 for"):
        validate_args(parse_args(SMALL + ["--train-data-path", "0", a, "1", b]), 1)


def _mount(directory, options):
    directory.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=4m,{options}", "tmpfs", str(directory)], check=True)


def test_a_read_only_data_cache_is_refused_unless_it_holds_the_caches(tmp_path):
    from megatron.fsdp_training.data import datasets as data
    from megatron.fsdp_training.data.data_config import DataConfig

    prefix = corpus(tmp_path, 10)
    ro, cache = tmp_path / "ro", tmp_path / "cache"
    _mount(ro, "ro")
    _mount(cache, "rw")
    try:
        with pytest.raises(ArgumentError, match=rf"--data-cache-path {ro} is not writable \(Read-only file system\): "
                                                "Megatron-Core writes the dataset indexes there"):
            _validate(["--data-path", prefix, "--data-cache-path", str(ro)])
        with pytest.raises(ArgumentError, match=rf"--data-cache-path {ro}/sub is not writable"):
            _validate(["--mock-data", "--data-cache-path", str(ro / "sub")])
        # a cache built once, then made read-only: read without writing, so it is no reason to refuse
        args = _validate(["--data-path", prefix, "--data-cache-path", str(cache)])
        config = DataConfig.from_args(args)
        built = data.build_datasets(config, data.build_tokenizer(config.tokenizer))
        assert sorted(p.name.split("-", 1)[1] for p in cache.glob("*-description.txt")) == [
            "GPTDataset-train-description.txt", "GPTDataset-valid-description.txt"]
        subprocess.run(["mount", "-o", "remount,ro", str(cache)], check=True)
        args = _validate(["--data-path", prefix, "--data-cache-path", str(cache)])
        config = DataConfig.from_args(args)
        again = data.build_datasets(config, data.build_tokenizer(config.tokenizer))
        assert [len(d) for d in again[:2]] == [len(d) for d in built[:2]]
        assert (again[0][0]["tokens"] == built[0][0]["tokens"]).all()
        del built, again  # (their indexes are memory maps of the mounted files)
        gc.collect()
        # no --data-cache-path: Megatron-Core writes beside the data (a read-only data directory is refused)
        subprocess.run(["umount", str(ro)], check=True)
        _mount(ro, "rw")
        moved = _corpus_in(ro)
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        with pytest.raises(ArgumentError, match=rf"the dataset index cache {moved}/cache/GPTDataset_indices "
                                                r"\(beside the data\) is not writable .*pass --data-cache-path DIR"):
            _validate(["--data-path", moved])
    finally:
        gc.collect()
        for mounted in (ro, cache):  # lazily where a memory map still holds it
            subprocess.run(["umount", "-l", str(mounted)], check=False, stderr=subprocess.DEVNULL)

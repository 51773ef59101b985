"""Converters never clobber a checkpoint directory and write what ``inspect.py --verify`` checks.

- into a directory whose tracker names a newer iteration: refused with one line, exit code 1, with
  or without ``--overwrite``, and nothing there changes (``from-hf``, ``from-torch``);
- into a non-empty directory: refused without ``--overwrite``; with it, the converted iteration is
  written and the other iterations are left;
- every converter's output has a manifest: ``inspect.py --verify`` passes, and a flipped byte fails it.
"""

import os
import subprocess
import sys

import pytest
import torch

from megatron.fsdp_training.checkpointing import files
from megatron.fsdp_training.tools.checkpoint_tools import convert, inspect as ckpt_inspect

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def hf_model(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def _snapshot(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


def _newer(tmp_path, hf_model):
    """A save directory whose tracker names iteration 10 (a job's, further along than any conversion)."""
    live = tmp_path / "live"
    convert.main(["from-hf", str(hf_model), str(live)])
    os.rename(live / "iter_0000000", live / "iter_0000010")
    files.write_tracker(live, 10)
    return live


def test_a_newer_tracker_is_never_moved_back(tmp_path, hf_model, capsys):
    live = _newer(tmp_path, hf_model)
    convert.to_torch(str(live), str(tmp_path / "full.pt"))
    before = _snapshot(live)
    for argv in (["from-hf", str(hf_model), str(live)], ["from-hf", str(hf_model), str(live), "--overwrite"],
                 ["from-torch", str(tmp_path / "full.pt"), str(live), "--overwrite"]):
        with pytest.raises(SystemExit) as exc:
            convert.main(argv)
        message = str(exc.value.code)
        assert "\n" not in message and "tracker names iteration 10" in message and "backwards" in message, message
    assert _snapshot(live) == before and files.read_tracker(live) == 10
    # the command line: exit code 1, the one line on stderr
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint", "convert.py"), "from-hf",
                          str(hf_model), str(live)], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 1 and out.stderr.strip().count("\n") == 0 and "backwards" in out.stderr, out.stderr


def test_a_non_empty_directory_needs_overwrite_and_the_output_verifies(tmp_path, hf_model, capsys):
    out = tmp_path / "out"
    convert.main(["from-hf", str(hf_model), str(out)])
    convert.to_torch(str(out), str(tmp_path / "full.pt"))
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="is not empty .*--overwrite"):
        convert.main(["from-torch", str(tmp_path / "full.pt"), str(out)])
    convert.main(["from-torch", str(tmp_path / "full.pt"), str(out), "--overwrite"])
    assert (out / "notes.txt").read_text() == "mine" and files.read_tracker(out) == 0
    with pytest.raises(SystemExit, match="not empty"):
        convert.main(["to-hf", str(out), str(hf_model)])
    for checkpoint in (out / "iter_0000000",):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            ckpt_inspect.main([str(checkpoint), "--verify"])
        said = capsys.readouterr().out  # a converted checkpoint: its files vouched for, not its source
        assert exc.value.code == 0 and ": verified " not in said, said
        assert (f"source unverified: converted from a torch file {(tmp_path / 'full.pt').resolve()}, which was not "
                "checked against checksums") in said, said
    shard = next(checkpoint.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(SystemExit) as exc:
        ckpt_inspect.main([str(checkpoint), "--verify"])
    assert exc.value.code == 1 and "fails its checksum" in capsys.readouterr().out


def test_inspect_shows_a_from_hf_checkpoint_and_its_unverified_source(tmp_path, hf_model, capsys):
    """``inspect.py CKPT`` on a from-hf checkpoint (its layout records no level): its lines, no traceback; its
    manifest says the safetensors were not verified."""
    out = tmp_path / "out"
    convert.main(["from-hf", str(hf_model), str(out)])
    capsys.readouterr()
    ckpt_inspect.main([str(out)])
    said = capsys.readouterr().out
    assert ("  written at: world 1 = TP 1 x PP 1 x CP 1 x DP 1; EP 1, expert TP 1 (converted from HuggingFace "
            "llama: no training layout)") in said, said
    with pytest.raises(SystemExit) as exc:
        ckpt_inspect.main([str(out), "--verify"])
    said = capsys.readouterr().out
    assert exc.value.code == 0 and (f"source unverified: converted from HuggingFace safetensors {hf_model.resolve()}, "
                                    "which carries no checksums") in said, said

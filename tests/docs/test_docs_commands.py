"""Every command block of README.md, docs/*.md and tools/README.md runs.

Each ```bash block is preceded by a marker, an HTML comment the rendered page does not show:

    <!-- doc-test: append="--train-iters 2 --eval-iters 1" replace="iter_0000100=>iter_0000004" -->

``append``: arguments added to every training command of the block (``pretrain_gpt.py``, an
``examples/*.sh``), scaled down (the job's argparse takes the last value of a flag);
``replace``: ``OLD=>NEW`` pairs separated by ``;;`` applied to the block first (paths the scaled
run writes, a benchmark's size); ``needs``: files the block reads that a reader has (a corpus,
GPT-2's vocabulary, a HuggingFace model), made by ``FIXTURES``; ``installed``: the set-up steps
that open a chain (``pip install``, making and activating a venv: the README's per-environment
commands) are the test environment's own and are left out; ``skip-reason``: the
block needs a GPU or a SLURM cluster, or Megatron-LM's own files (its ``pretrain_gpt.py``, its
checkpoints), and then names the test that runs the same command on what this repository has
(few, and said why).

The test runs each file's blocks in order, in one working directory (a later block reads what an
earlier one wrote, as a reader following the page would), with each command line run by bash.
It fails when a command exits non-zero, or a training command trains no iteration (its
``training done | iterations: N`` line with N = 0, or none).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "tools/README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
_BLOCK = re.compile(r"```(bash|sh|shell)\n(.*?)```", re.S)
_MARKER = re.compile(r"<!--\s*doc-test:(.*?)-->")
_ATTR = re.compile(r'([a-z-]+)(?:="((?:[^"\\]|\\.)*)")?')
_TRAINS = re.compile(r"(pretrain_gpt\.py|examples/\S+\.sh)")
_DONE = re.compile(r"training done \| iterations: (\d+)")
# blocks that need a GPU, SLURM or another project's checkout (Megatron-LM's script, its checkpoints): few, each says
# why, and one of the third kind names the test that runs its command on what this repository has
MAX_SKIPPED = 5
# what every run gets: the repository's code first, one thread per rank (and TMPDIR in the run's directory)
ENV = {"PYTHONPATH": str(ROOT), "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclasses.dataclass(frozen=True)
class Block:
    path: str
    line: int
    text: str
    marker: Dict[str, str]

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def blocks(path: str) -> List[Block]:
    text = (ROOT / path).read_text()
    found = []
    for m in _BLOCK.finditer(text):
        attrs = None
        for line in reversed(text[:m.start()].splitlines()):  # the comment lines right above the fence
            marker = _MARKER.fullmatch(line.strip())
            if marker:
                attrs = {k: v.replace('\\"', '"') if v else "" for k, v in _ATTR.findall(marker.group(1))}
                break
            if line.strip() and not re.fullmatch(r"<!--.*-->", line.strip()):  # e.g. <!-- ci:test -->
                break
        found.append(Block(path, text[:m.start()].count("\n") + 1, m.group(2), attrs))
    return found


ALL = [b for path in DOCS for b in blocks(path)]


def commands(block: Block) -> List[str]:
    """The block's command lines after ``replace`` (continuations joined, comments and blank lines dropped)."""
    text = block.text
    for pair in filter(None, (p.strip() for p in block.marker.get("replace", "").split(";;"))):
        old, new = pair.split("=>", 1)
        assert old in text, f"{block.name}: replace={old!r} matches nothing"
        text = text.replace(old, new)
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        if not tokens:
            continue
        if "installed" in block.marker:  # `pip install ... && cmd`: the environment is installed already
            while tokens and _sets_up(tokens[:tokens.index("&&")] if "&&" in tokens else tokens):
                tokens = tokens[tokens.index("&&") + 1:] if "&&" in tokens else []
        if tokens and _TRAINS.search(" ".join(tokens)) and block.marker.get("append"):
            tokens += shlex.split(block.marker["append"])
        if tokens:
            out.append(_join(tokens))
    return out


def _sets_up(step: List[str]) -> bool:
    """A set-up step of an ``installed`` block: ``pip ...``, ``python3.12 -m venv DIR``, ``. DIR/bin/activate``."""
    return bool(step) and (step[0] == "pip" or step[1:3] == ["-m", "venv"]
                           or (step[0] in (".", "source") and len(step) == 2 and step[1].endswith("/bin/activate")))


def _join(tokens: List[str]) -> str:
    """Back to one shell line; ``A=1`` assignments and ``&&`` stay unquoted."""
    return " ".join(t if t in ("&&", "||", "|") or re.fullmatch(r"[A-Z_]+=\S*", t) else shlex.quote(t)
                    for t in tokens)


# ------------------------------------------------------------------ fixtures
def _gpt2_vocab(d: Path) -> None:
    from megatron.fsdp_training.data.tokenizer import bytes_to_unicode

    (d / "gpt2").mkdir()
    vocab = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    vocab["<|endoftext|>"] = len(vocab)
    (d / "gpt2" / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (d / "gpt2" / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")


def _corpus(d: Path) -> None:
    stdlib = Path(os.__file__).parent
    docs = [p.read_text(errors="replace") for p in sorted(stdlib.glob("[a-c]*.py"))[:40]]
    (d / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    (d / "books").mkdir()
    for i, t in enumerate(docs[:5]):
        (d / "books" / f"{i}.txt").write_text(t)
    (d / "extra.txt").write_text(docs[5])


def _hf_tokenizer(d: Path) -> None:
    from tools.train_hf_tokenizer import train_tokenizer

    (d / "tok.txt").write_text("def f(x):\n    return x\n" * 50)
    train_tokenizer([str(d / "tok.txt")], 257, str(d / "my-tokenizer"))


def _hf_model(d: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(d / "hf_model")


FIXTURES = {"gpt2-vocab": _gpt2_vocab, "corpus": _corpus, "hf-tokenizer": _hf_tokenizer, "hf-model": _hf_model}


# ------------------------------------------------------------------ running
def run_block(block: Block, cwd: Path) -> List[Tuple[str, str]]:
    """Run every command of ``block`` in ``cwd``; returns (command, output) pairs. Asserts as it goes."""
    for name in block.marker.get("needs", "").split():
        FIXTURES[name](cwd)
    for entry in ("pretrain_gpt.py", "tools", "examples", "megatron", "tests", "pyproject.toml"):
        if not (cwd / entry).exists():
            (cwd / entry).symlink_to(ROOT / entry)
    (cwd / "tmp").mkdir(exist_ok=True)  # the examples' data (each its own folder under TMPDIR), the pools' files
    env = {**os.environ, **ENV, "TMPDIR": str(cwd / "tmp")}
    done = []
    for command in commands(block):
        result = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                                timeout=1800)
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"{block.name}: `{command}` exited {result.returncode}:\n{output[-4000:]}"
        if _TRAINS.search(command):
            trained = [int(n) for n in _DONE.findall(output)]
            assert trained and min(trained) > 0, f"{block.name}: `{command}` trained no iteration:\n{output[-3000:]}"
        done.append((command, output))
    return done


def test_every_command_block_carries_a_marker():
    """Each block has a marker; ``skip-reason`` only for GPU / SLURM / Megatron-LM-files blocks, and few; every ``needs`` exists;
    every ``replace`` matches; every training command gets scaled-down arguments."""
    missing = [b.name for b in ALL if b.marker is None]
    assert not missing, f"command blocks without a <!-- doc-test: ... --> marker: {missing}"
    skipped = [b for b in ALL if "skip-reason" in b.marker]
    assert len(skipped) <= MAX_SKIPPED, [b.name for b in skipped]
    for b in skipped:
        reason = b.marker["skip-reason"]
        assert re.search(r"\b(GPU|GPUs|SLURM)\b", reason) or (
            "Megatron-LM" in reason and re.search(r"tests/\S+\.py", reason)
            and (ROOT / re.search(r"tests/\S+\.py", reason).group(0)).is_file()), (b.name, b.marker)
    for b in ALL:
        unknown = set(b.marker) - {"append", "replace", "needs", "installed", "skip-reason"}
        assert not unknown, (b.name, unknown)
        assert set(b.marker.get("needs", "").split()) <= set(FIXTURES), b.name
        if "skip-reason" in b.marker:
            continue
        lines = commands(b)
        assert lines, f"{b.name}: no command"
        assert all("..." not in c and "<" not in c.replace("<<", "") for c in lines), (b.name, lines)
        trains = [c for c in lines if _TRAINS.search(c)]
        assert not trains or b.marker.get("append"), f"{b.name}: training commands without scaled-down append"


def test_pages_say_what_is_true_now():
    """Every page holds the current figures and how to reproduce them; their history lives in git
    (a page under 500 lines for the benchmark, no per-round or per-issue accounts, no dated measurements)."""
    history = re.compile(r"\bissue ?\d+|\b(first|second|third|fourth|fifth|last) round\b|\bround \d+\b"
                         r"|\bmeasured (on )?20\d\d-|\b(before|after) issue\b|\btwo stops before\b", re.I)
    assert len((ROOT / "docs" / "performance.md").read_text().splitlines()) < 500
    found = []
    for name in DOCS:
        lines = (ROOT / name).read_text().splitlines()
        found += [f"{name}:{i}: {line.strip()}" for i, line in enumerate(lines, 1) if history.search(line)]
    assert found == [], found


def test_pages_are_short_and_listed():
    """A page is about 600 lines at most (split by topic beyond that), and docs/index.md lists every page."""
    index = (ROOT / "docs" / "index.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert len(page.read_text().splitlines()) <= 620, f"{page.name}: over ~600 lines, split it by topic"
        if page.name != "index.md":
            assert f"]({page.name})" in index, f"docs/index.md does not list {page.name}"


def test_the_test_fails_a_command_that_trains_nothing(tmp_path):
    """A block whose job trains 0 iterations (a resume with the same --train-iters) fails the test."""
    fake = Block("fake.md", 1, "echo ' training done | iterations: 0 |' pretrain_gpt.py\n", {})
    with pytest.raises(AssertionError, match="trained no iteration"):
        run_block(fake, tmp_path)
    with pytest.raises(AssertionError, match="exited 3"):
        run_block(Block("fake.md", 1, "bash -c 'exit 3'\n", {}), tmp_path)


@pytest.mark.slow
@pytest.mark.docs_commands
@pytest.mark.parametrize("path", DOCS)
def test_documented_commands_run(path, tmp_path):
    """Every block of ``path`` but the skipped ones, in order, in one directory."""
    for block in blocks(path):
        assert block.marker is not None, f"{block.name}: no <!-- doc-test: ... --> marker"
        if "skip-reason" not in block.marker:
            run_block(block, tmp_path)
    assert not any(tmp_path.glob("core*")), "a command dumped core"

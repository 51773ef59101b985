"""Tokenizers (megatron/fsdp_training/data/tokenizer.py) and preprocessing (tools/preprocess_data.py) round trips."""

import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.fsdp_training.data import tokenizer as tk
from megatron.fsdp_training.data.tokenizer import TOKENIZER_TYPES, build_tokenizer
from megatron.fsdp_training.tools import preprocess_data

ROOT = Path(__file__).resolve().parents[2]


def _run_tool(argv, capsys):
    """(status, stdout, stderr) of the tool. With ``--workers`` > 1 it runs as a user runs it, in a fresh
    interpreter: its worker pool forks, and this test process is multi-threaded (the session's worker pools),
    where a fork may inherit a lock another thread holds."""
    workers = int(argv[argv.index("--workers") + 1]) if "--workers" in argv else 1
    if workers > 1:
        out = subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py")] + argv,
                             capture_output=True, text=True, timeout=300)
        return out.returncode, out.stdout, out.stderr
    status = preprocess_data.cli(argv)
    out = capsys.readouterr()
    return status, out.out, out.err


# --------------------------------------------------------------------------------------
# A tiny GPT-2 style vocabulary: the 256 byte symbols, a few merges, <|endoftext|>.
# --------------------------------------------------------------------------------------

MERGES = [("h", "e"), ("l", "l"), ("e", "l"), ("Ġ", "t"), ("Ġt", "he"), ("he", "ll"),
          ("hell", "o"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or"), ("Ã", "©"), (",", "Ġ")]
ROUND_TRIP = ["hello the world", "Hello, world!", "  multiple   spaces\n\nnew\tlines \n",
              "it's we'll they're I'd", "café naïve — 東京 🙂 e\u0301", "snake_case x__y 123abc",
              "", " ", "<|endoftext|> is text here"]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2")
    symbols = list(tk.bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols)}
    for a, b in MERGES:
        vocab.setdefault(a + b, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (d / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES),
                                  encoding="utf-8")
    return str(d / "vocab.json"), str(d / "merges.txt")


@pytest.fixture(scope="module")
def gpt2(gpt2_files):
    return build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])


def test_gpt2_merges(gpt2):
    v = gpt2.vocab
    assert gpt2.vocab_size == 256 + len(MERGES) + 1 and gpt2.eod == v["<|endoftext|>"]
    assert gpt2.tokenize("hello the world") == [v["hello"], v["Ġthe"], v["Ġwor"], v["l"], v["d"]]
    # lowest rank first: "h e" (rank 0) beats "e l" (rank 2)
    assert gpt2.tokenize("hel") == [v["he"], v["l"]]
    assert gpt2.tokenize("el") == [v["el"]]
    assert gpt2.tokenize("é") == [v["Ã©"]]  # a merge of the two UTF-8 bytes of é
    assert gpt2.detokenize([gpt2.eod]) == "<|endoftext|>"


def test_gpt2_pretokenisation_does_not_cross_words(gpt2):
    v = gpt2.vocab
    assert gpt2.tokenize("a, b") == [v["a"], v[","], v["Ġ"], v["b"]]


def test_gpt2_round_trip(gpt2):
    for text in ROUND_TRIP:
        ids = gpt2.tokenize(text)
        assert all(isinstance(i, int) and 0 <= i < gpt2.vocab_size for i in ids)
        assert gpt2.detokenize(ids) == text
        assert gpt2.detokenize(np.asarray(ids)) == text
    assert gpt2.eod not in gpt2.tokenize("<|endoftext|>")  # never parsed as special


def test_re_fallback_matches_regex():
    """The `re` approximation of GPT-2's pattern splits like the `regex` one, except for
    numeric characters that are not decimal digits (documented)."""
    import regex  # a runtime dependency (pyproject.toml)
    exact, approx = regex.compile(tk.GPT2_PATTERN), re.compile(tk.GPT2_PATTERN_RE)
    samples = ROUND_TRIP + ["Ünïcödé ΑΒΓ αβγ Кириллица العربية ٣٤ हिन्दी ไทย 中文",
                            "tabs\t\tand\r\nCRLF  ", "x=1+2*(y-3)/z; // ok?!", "''quotes'' \"d\"",
                            "don't DON'T 've'm'll'd's't", "a_b __init__ 1_000",
                            "\u00a0nbsp\u2003em"]
    for s in samples:
        assert approx.findall(s) == exact.findall(s), s
    assert approx.findall("x²") != exact.findall("x²")  # the documented difference


def test_re_fallback_tokenizer(gpt2_files, gpt2):
    t = tk.GPT2BPETokenizer(*gpt2_files, split_pattern=re.compile(tk.GPT2_PATTERN_RE))
    for text in ROUND_TRIP:
        assert t.tokenize(text) == gpt2.tokenize(text)
        assert t.detokenize(t.tokenize(text)) == text


def test_gpt2_bad_files(tmp_path, gpt2_files):
    with pytest.raises(ValueError, match="--vocab-file"):
        build_tokenizer("GPT2BPETokenizer", merge_file=gpt2_files[1])
    with pytest.raises(FileNotFoundError):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "x.json"),
                        merge_file=gpt2_files[1])
    (tmp_path / "v.json").write_text(json.dumps({"a": 0, "<|endoftext|>": 1}))
    with pytest.raises(ValueError, match="byte symbols are missing"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "v.json"),
                        merge_file=gpt2_files[1])


def test_byte_level():
    t = build_tokenizer("ByteLevelTokenizer")
    assert (t.vocab_size, t.eod) == (257, 256)
    for text in ["plain ascii", "naïve café — 東京 🙂", ""]:
        ids = t.tokenize(text)
        assert ids == list(text.encode("utf-8"))
        assert t.detokenize(ids + [t.eod]) == text
    assert t.detokenize([0xE6, 0x9D]) == "\ufffd"  # a cut multi-byte character is replaced
    with pytest.raises(NotImplementedError):
        t.pad
    with pytest.raises(ValueError, match="outside"):
        t.detokenize([257])


def test_vocab_size_padding(gpt2_files):
    t = build_tokenizer("ByteLevelTokenizer", vocab_size=300)
    assert (t.vocab_size, t.eod, t.pad) == (300, 256, 257)
    assert t.detokenize([104, 105, 257, 299]) == "hi"
    with pytest.raises(ValueError, match="smaller"):
        build_tokenizer("ByteLevelTokenizer", vocab_size=100)
    g = build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1],
                        vocab_size=512)
    natural = 256 + len(MERGES) + 1
    assert (g.vocab_size, g.pad) == (512, natural)
    assert g.detokenize(g.tokenize("hello") + [natural, 511]) == "hello"


def test_null_tokenizer():
    t = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (t.vocab_size, t.eod) == (101, 100)
    assert t.tokenize("1 2  3\n99") == [1, 2, 3, 99]
    assert t.detokenize([1, 2, 3]) == "1 2 3"
    with pytest.raises(ValueError):
        t.tokenize("1 two")
    with pytest.raises(ValueError, match="vocab-size"):
        build_tokenizer("NullTokenizer")


def test_unknown_type():
    with pytest.raises(ValueError) as e:
        build_tokenizer("SentencePieceTokenizerX")
    for name in TOKENIZER_TYPES:
        assert name in str(e.value)


@pytest.fixture(scope="module")
def hf_dir(gpt2_files, tmp_path_factory):
    import shutil

    d = tmp_path_factory.mktemp("hf")  # GPT-2's files and a config naming the class
    shutil.copy(gpt2_files[0], d / "vocab.json")
    shutil.copy(gpt2_files[1], d / "merges.txt")
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>",
         "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "model_max_length": 10**6}))
    return str(d)


def test_hf_tokenizer(hf_dir, gpt2, tmp_path):
    t = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir)
    assert (t.vocab_size, t.eod) == (gpt2.vocab_size, gpt2.eod)
    for text in ROUND_TRIP[:-1]:  # HF parses <|endoftext|> as the special token
        assert t.tokenize(text) == gpt2.tokenize(text), text  # our BPE == Hugging Face's
        assert t.detokenize(t.tokenize(text)) == text
    with pytest.raises(ValueError, match="local files"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "missing"))


# --------------------------------------------------------------------------------------
# tools/preprocess_data.py
# --------------------------------------------------------------------------------------

TEXT_DOCS = ["hello the world", "Hello, world!\n\nSecond paragraph.", "", "café 🙂 東京",
             "x" * 3000 + " tail", "it's   spaced\tout"]
NULL_DOCS = ["1 2 3", "", "7\n8  9 99", "0"]


def _tokenizer_args(kind, gpt2_files, hf_dir):
    if kind == "GPT2BPETokenizer":
        return ["--vocab-file", gpt2_files[0], "--merge-file", gpt2_files[1]]
    if kind == "NullTokenizer":
        return ["--vocab-size", "100"]
    if kind == "HuggingFaceTokenizer":
        return ["--tokenizer-model", hf_dir]
    return []


def _tokenizer_kwargs(kind, gpt2_files, hf_dir):
    return {"GPT2BPETokenizer": dict(vocab_file=gpt2_files[0], merge_file=gpt2_files[1]),
            "NullTokenizer": dict(vocab_size=100),
            "HuggingFaceTokenizer": dict(tokenizer_model=hf_dir)}.get(kind, {})


def _write_inputs(d, docs, fmt):
    d.mkdir()
    if fmt == "jsonl":  # two files, given as two --input
        half = len(docs) // 2
        for name, part in (("a.jsonl", docs[:half]), ("b.jsonl", docs[half:])):
            lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(part)]
            (d / name).write_text("\n".join(lines) + "\n\n", encoding="utf-8")
        return ["--input", str(d / "a.jsonl"), "--input", str(d / "b.jsonl")]
    for i, t in enumerate(docs):  # one file per document, given as a glob
        (d / f"doc_{i:03d}.txt").write_bytes(t.encode("utf-8"))
    return ["--input-format", "text", "--input", str(d / "doc_*.txt")]


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return ds, [ds[i].tolist() for i in range(len(ds))]


# Every tokenizer and input format with one worker; the forking worker pool (a fresh interpreter each, about 5 s)
# on both formats and with a tokenizer of each library (the pool inherits the tokenizer, whatever its kind).
MULTI_WORKER = {("GPT2BPETokenizer", "text"), ("NullTokenizer", "jsonl"), ("HuggingFaceTokenizer", "jsonl")}
WITH_EOD = {("ByteLevelTokenizer", "jsonl", 1), ("GPT2BPETokenizer", "text", 2), ("NullTokenizer", "jsonl", 2),
            ("GPT2BPETokenizer", "jsonl", 1), ("HuggingFaceTokenizer", "jsonl", 2)}
CASES = [(kind, fmt, workers, (kind, fmt, workers) in WITH_EOD)
         for kind in ("ByteLevelTokenizer", "GPT2BPETokenizer", "NullTokenizer", "HuggingFaceTokenizer")
         for fmt in ("jsonl", "text") for workers in (1, 2)
         if not (kind == "HuggingFaceTokenizer" and fmt == "text") and (workers == 1 or (kind, fmt) in MULTI_WORKER)]


@pytest.mark.parametrize("kind,fmt,workers,eod", CASES,
                         ids=[f"{k}-{f}-w{w}-{'eod' if e else 'noeod'}" for k, f, w, e in CASES])
def test_preprocess_round_trip(kind, fmt, workers, eod, gpt2_files, hf_dir, tmp_path, capsys):
    docs = NULL_DOCS if kind == "NullTokenizer" else TEXT_DOCS
    tok_args = ["--tokenizer-type", kind] + _tokenizer_args(kind, gpt2_files, hf_dir)
    prefix = str(tmp_path / "out" / "corpus")
    argv = (_write_inputs(tmp_path / "in", docs, fmt) + tok_args
            + ["--output-prefix", prefix, "--workers", str(workers), "--log-interval", "2",
               "--chunk-size", "2"] + (["--append-eod"] if eod else []))
    status, stdout, stderr = _run_tool(argv, capsys)
    assert status == 0, stderr
    assert "docs/s" in stderr and "MB/s" in stderr and "Done:" in stdout

    tok = build_tokenizer(kind, **_tokenizer_kwargs(kind, gpt2_files, hf_dir))
    expected = [tok.tokenize(t) + ([tok.eod] if eod else []) for t in docs]
    expected = [e for e in expected if e]  # empty documents are skipped
    ds, got = _read(prefix + "_text_document")
    assert got == expected
    assert ds.index.dtype == np.uint16
    assert ds.document_indices.tolist() == list(range(len(expected) + 1))
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus_text_document.bin",
                                                    "corpus_text_document.idx"]


def test_preprocess_json_keys_and_int32(tmp_path, capsys):
    """Two keys give two datasets; a vocabulary >= 65500 gives int32 tokens."""
    rows = [{"text": "abc", "title": "T1"}, {"text": "naïve", "title": "T2"}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    prefix = str(tmp_path / "c")
    preprocess_data.main(["--input", str(tmp_path / "in.jsonl"), "--json-keys", "text", "title",
                       "--tokenizer-type", "ByteLevelTokenizer", "--vocab-size", "70000",
                       "--output-prefix", prefix, "--append-eod"])
    for key in ("text", "title"):
        ds, got = _read(f"{prefix}_{key}_document")
        assert ds.index.dtype == np.int32
        assert got == [list(r[key].encode()) + [256] for r in rows]


def test_preprocess_failure_leaves_no_partial_output(tmp_path, capsys):
    tool = preprocess_data
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "first"}\n{"text": "second"}\n', encoding="utf-8")
    prefix = str(tmp_path / "out" / "c")
    common = ["--tokenizer-type", "ByteLevelTokenizer", "--output-prefix", prefix]
    tool.main(["--input", str(good)] + common)
    before = {p: Path(p).read_bytes() for p in glob.glob(prefix + "*")}
    assert len(before) == 2

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n' * 50 + '{"txt": "no text key"}\n', encoding="utf-8")
    for workers in (1, 2):
        status, _, stderr = _run_tool(["--input", str(bad), "--workers", str(workers), "--chunk-size", "4"]
                                      + common, capsys)
        assert status == 2 and "bad.jsonl:51: no key 'text'" in stderr, stderr
        assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr
        # the earlier outputs are untouched and no temporary file is left behind
        assert {p: Path(p).read_bytes() for p in glob.glob(str(tmp_path / "out" / "*"))} \
            == before
    _, got = _read(prefix + "_text_document")
    assert got == [list(b"first"), list(b"second")]


def test_preprocess_bad_arguments(tmp_path, capsys):
    tool = preprocess_data
    with pytest.raises(FileNotFoundError, match="no file matches"):
        tool.main(["--input", str(tmp_path / "*.jsonl"), "--tokenizer-type",
                   "ByteLevelTokenizer", "--output-prefix", str(tmp_path / "c")])
    with pytest.raises(SystemExit):
        tool.main(["--input", "x", "--tokenizer-type", "Nope", "--output-prefix", "c"])


def test_preprocess_command_line_prints_the_message_only(tmp_path, capsys):
    """On the command line an input error is its message on one line (exit status 2), not a traceback."""
    tool = preprocess_data
    status = tool.cli(["--input", str(tmp_path / "*.jsonl"), "--tokenizer-type", "ByteLevelTokenizer",
                       "--output-prefix", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("preprocess_data.py: error: --input ") and "no file matches" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    (tmp_path / "in.txt").write_text("text")
    status = tool.cli(["--input", str(tmp_path / "in.txt"), "--input-format", "text", "--tokenizer-type",
                       "GPT2BPETokenizer", "--output-prefix", str(tmp_path / "c")])
    assert status == 2 and capsys.readouterr().err.strip() == (
        "preprocess_data.py: error: GPT2BPETokenizer needs --vocab-file")

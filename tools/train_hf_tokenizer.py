#!/usr/bin/env python
"""Train a byte-level BPE tokenizer on local text; save it where ``--tokenizer-type HuggingFaceTokenizer`` loads it.

    python tools/train_hf_tokenizer.py --input "$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')/*.py" \\
        --vocab-size 4096 --output-dir /tmp/stdlib-bpe

Nothing is downloaded: the ``tokenizers`` package learns the merges from the input files
(GPT-2's byte-level pre-tokenisation, so every byte sequence round-trips), and
``transformers`` writes ``tokenizer.json`` + ``tokenizer_config.json`` into
``--output-dir``, which ``tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer
--tokenizer-model DIR`` and ``pretrain_gpt.py`` then read with ``local_files_only=True``.
``<|endoftext|>`` is the end-of-document (eos) token. Both packages are in the ``test`` extra.

Inputs ending in ``.jsonl`` or ``.json`` are read as ``tools/preprocess_data.py`` reads them: one
JSON object per line, the text under ``--json-keys`` (default ``text``); a line that is not such
an object stops the tool with one line naming the file and line. Other files are plain text.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from typing import Iterator, List, Optional, Sequence

EOD = "<|endoftext|>"


def _files(patterns: Sequence[str]) -> List[str]:
    files: List[str] = []
    for pattern in patterns:
        matches = [pattern] if os.path.isfile(pattern) else sorted(
            f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
        if not matches:
            raise FileNotFoundError(f"--input {pattern!r}: no such file, and no file matches it as a glob")
        files.extend(matches)
    return files


def is_json_lines(path: str) -> bool:
    return path.endswith((".jsonl", ".json"))


def texts(files: Sequence[str], json_keys: Sequence[str] = ("text",)) -> Iterator[str]:
    """Each plain-text file whole, and each JSON-lines record's ``json_keys`` values."""
    for path in files:
        if not is_json_lines(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()
            continue
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{path}:{lineno}: not a JSON object ({exc})") from None
                for key in json_keys:
                    if not isinstance(record, dict) or not isinstance(record.get(key), str):
                        raise ValueError(f"{path}:{lineno}: no string under key {key!r} (pass --json-keys)")
                    yield record[key]


def train_tokenizer(files: Sequence[str], vocab_size: int, output_dir: str,
                    json_keys: Sequence[str] = ("text",)) -> str:
    """Learn ``vocab_size`` byte-level BPE ids (incl. eod) from ``files``; returns ``output_dir``."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast
    except ImportError as exc:
        raise ImportError("train_hf_tokenizer needs `tokenizers` and `transformers`: pip install tokenizers "
                          "transformers (both are in the test extra)") from exc
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    if any(is_json_lines(f) for f in files):
        tokenizer.train_from_iterator(texts(files, json_keys), trainer)
    else:
        tokenizer.train(list(files), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOD, bos_token=EOD, unk_token=EOD)
    os.makedirs(output_dir, exist_ok=True)
    fast.save_pretrained(output_dir)
    return output_dir


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", action="append", required=True, metavar="PATH", help="text file or glob; repeatable")
    p.add_argument("--vocab-size", type=int, default=4096, help="ids in all, eod included (default: %(default)s)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys holding the text in .jsonl / .json inputs (default: %(default)s)")
    args = p.parse_args(argv)
    if args.vocab_size < 257:
        p.error("--vocab-size must be at least 257 (the 256 byte symbols and eod)")
    try:
        files = _files(args.input)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    megabytes = sum(os.path.getsize(f) for f in files) / 2**20
    print(f"> training a {args.vocab_size}-id byte-level BPE on {len(files)} file(s), {megabytes:.1f} MB", flush=True)
    try:
        train_tokenizer(files, args.vocab_size, args.output_dir, args.json_keys)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"> saved to {args.output_dir} in {time.perf_counter() - start:.1f} s "
          f"(--tokenizer-type HuggingFaceTokenizer --tokenizer-model {args.output_dir})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

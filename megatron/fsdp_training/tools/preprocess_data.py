"""Tokenise a corpus into Megatron-Core indexed datasets (``.bin`` + ``.idx``).

Megatron-LM's ``tools/preprocess_data.py`` shape, for the training job's ``--data-path``::

    megatron-fsdp-preprocess --input corpus.jsonl --json-keys text \\
        --output-prefix data/corpus --tokenizer-type GPT2BPETokenizer \\
        --vocab-file vocab.json --merge-file merges.txt --append-eod --workers 4

writes ``data/corpus_text_document.bin`` and ``.idx`` (``{prefix}_{key}_document`` for
each JSON key), one document per input record, one sequence per document. Inputs:

* ``--input-format jsonl`` (default): one JSON object a line; each ``--json-keys`` field is
  tokenised into its own dataset. Blank lines are skipped.
* ``--input-format text``: each input file is one document (key ``text``).

``--input`` may be repeated and may be a glob; files are read in the order given (each
glob sorted). Documents that tokenise to nothing (and have no eod appended) are skipped.
The token dtype follows the vocabulary size as in Megatron-LM (uint16 below 65500, else
int32). Outputs are written under temporary names and renamed at the end, so a failed
run never leaves a partial ``.bin``/``.idx`` under the final name.
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing
import os
import sys
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy

from megatron.fsdp_training.data.tokenizer import TOKENIZER_TYPES, build_tokenizer


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", action="append", required=True, metavar="PATH",
                   help="input file or glob; may be given several times")
    g.add_argument("--input-format", choices=("jsonl", "text"), default="jsonl",
                   help="jsonl: one JSON object a line; text: one document per file")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="JSON fields to tokenise, one output dataset each (jsonl only)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--tokenizer-model", default=None,
                   help="HuggingFaceTokenizer: local directory (or locally cached name)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer: number of ids; others: pad the vocabulary to this")
    g.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token to every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="writes {prefix}_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1,
                   help="tokenising processes (1: in this process)")
    g.add_argument("--chunk-size", type=int, default=32,
                   help="documents handed to a worker at a time")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="print progress every this many input records (0: never)")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be at least 1")
    if args.chunk_size < 1:
        p.error("--chunk-size must be at least 1")
    if args.input_format == "text" and args.json_keys != ["text"]:
        p.error("--json-keys applies to --input-format jsonl only (text input writes key 'text')")
    if len(set(args.json_keys)) != len(args.json_keys):
        p.error("--json-keys has duplicates")
    return args


def expand_inputs(patterns: Sequence[str]) -> List[str]:
    """Files named by ``--input``: each an existing file or a glob matching at least one."""
    files: List[str] = []
    for pattern in patterns:
        if os.path.isfile(pattern):
            files.append(pattern)
            continue
        matches = sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
        if not matches:
            raise FileNotFoundError(f"--input {pattern!r}: no such file, and no file matches "
                                    "it as a glob")
        files.extend(matches)
    return files


# ---------------------------------------------------------------------------------------
# Workers: each builds the tokenizer once, then encodes records.
# ---------------------------------------------------------------------------------------

_STATE: Optional[dict] = None  # {"config", "tokenizer", "dtype"} in this process


def _init_worker(config: dict) -> None:
    global _STATE
    if _STATE is not None and _STATE["config"] == config:
        return  # inherited through fork
    tokenizer = build_tokenizer(**config["tokenizer"])
    _STATE = {"config": config, "tokenizer": tokenizer,
              "dtype": numpy.dtype(config["dtype"])}


def _to_array(ids: List[int], dtype: numpy.dtype, where: str) -> numpy.ndarray:
    arr = numpy.asarray(ids, dtype=numpy.int64)
    if arr.size:
        info = numpy.iinfo(dtype)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > info.max:
            raise ValueError(f"{where}: token id {lo if lo < 0 else hi} does not fit the "
                             f"dataset dtype {dtype.name}")
    return arr.astype(dtype)


def _encode(item: Tuple[str, int, bytes]) -> Tuple[Dict[str, Optional[numpy.ndarray]], int]:
    """``(source, lineno, payload)`` -> ({key: tokens or None when skipped}, input bytes)."""
    source, lineno, payload = item
    config, tok, dtype = _STATE["config"], _STATE["tokenizer"], _STATE["dtype"]
    where = f"{source}:{lineno}" if lineno else source
    if config["input_format"] == "text":
        with open(source, "rb") as f:
            raw = f.read()
        nbytes = len(raw)
        try:
            texts = {"text": raw.decode("utf-8")}
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not UTF-8 text: {e}") from None
    else:
        nbytes = len(payload)
        try:
            record = json.loads(payload)
        except ValueError as e:
            raise ValueError(f"{where}: not a JSON object: {e}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        texts = {}
        for key in config["json_keys"]:
            if key not in record:
                raise ValueError(f"{where}: no key {key!r} (keys: {sorted(record)})")
            if not isinstance(record[key], str):
                raise ValueError(f"{where}: {key!r} is {type(record[key]).__name__}, "
                                 "not a string")
            texts[key] = record[key]
    out: Dict[str, Optional[numpy.ndarray]] = {}
    for key, text in texts.items():
        ids = list(tok.tokenize(text))
        if config["append_eod"]:
            ids.append(tok.eod)
        out[key] = _to_array(ids, dtype, where) if ids else None
    return out, nbytes


def _records(files: Sequence[str], input_format: str) -> Iterator[Tuple[str, int, bytes]]:
    for path in files:
        if input_format == "text":
            yield path, 0, b""
            continue
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield path, lineno, line


# ---------------------------------------------------------------------------------------


def _progress_bar(files: Sequence[str]):
    """tqdm over the input bytes, on a terminal, for inputs of 32 MiB and more (small ones finish at once)."""
    from tqdm import tqdm

    total = sum(os.path.getsize(f) for f in files)
    return tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", mininterval=1.0,
                disable=None if total >= 32 << 20 else True)


def _publish(tmp_prefix: str, final_prefix: str) -> None:
    """Move a finished dataset to its final name: the old ``.idx`` goes first, so a crash
    between the renames leaves a ``.bin`` without ``.idx`` (which fails to load) and
    never a new ``.bin`` paired with an old ``.idx``."""
    if os.path.exists(final_prefix + ".idx"):
        os.remove(final_prefix + ".idx")
    os.replace(tmp_prefix + ".bin", final_prefix + ".bin")
    os.replace(tmp_prefix + ".idx", final_prefix + ".idx")


def _fsync(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the tool; returns 0 (raises on errors). ``argv`` defaults to ``sys.argv[1:]``."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    args = get_args(argv)
    files = expand_inputs(args.input)
    tok_config = dict(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                      merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                      vocab_size=args.vocab_size)
    tokenizer = build_tokenizer(**tok_config)
    dtype = numpy.dtype(DType.optimal_dtype(tokenizer.vocab_size))
    keys = ["text"] if args.input_format == "text" else list(args.json_keys)
    config = {"tokenizer": tok_config, "dtype": dtype.name, "input_format": args.input_format,
              "json_keys": keys, "append_eod": args.append_eod}
    global _STATE
    _STATE = {"config": config, "tokenizer": tokenizer, "dtype": dtype}

    final = {k: f"{args.output_prefix}_{k}_document" for k in keys}
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    tmp = {k: f"{p}.tmp-{os.getpid()}" for k, p in final.items()}
    print(f"> {len(files)} input file(s), format {args.input_format}, tokenizer "
          f"{tokenizer!r}, dtype {dtype.name}, {args.workers} worker(s)", flush=True)

    builders = {}
    pool = None
    done = False
    try:
        for k in keys:
            builders[k] = IndexedDatasetBuilder(tmp[k] + ".bin", dtype=dtype.type)
        records = _records(files, args.input_format)
        if args.workers > 1:
            methods = multiprocessing.get_all_start_methods()
            ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
            pool = ctx.Pool(args.workers, initializer=_init_worker, initargs=(config,))
            encoded = pool.imap(_encode, records, args.chunk_size)
        else:
            encoded = map(_encode, records)

        start = time.perf_counter()
        n_records = n_bytes = 0
        progress = _progress_bar(files)
        docs = {k: 0 for k in keys}
        tokens = {k: 0 for k in keys}
        skipped = {k: 0 for k in keys}
        for out, nbytes in encoded:
            n_records += 1
            n_bytes += nbytes
            progress.update(nbytes)
            for k, arr in out.items():
                if arr is None:
                    skipped[k] += 1
                    continue
                builders[k].add_document(arr, [arr.size])
                docs[k] += 1
                tokens[k] += arr.size
            if args.log_interval and n_records % args.log_interval == 0:
                elapsed = max(time.perf_counter() - start, 1e-9)
                print(f"Processed {n_records} documents ({n_records / elapsed:.1f} docs/s, "
                      f"{n_bytes / elapsed / 1024 ** 2:.2f} MB/s).", file=sys.stderr, flush=True)
        progress.close()
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
        empty = [k for k in keys if docs[k] == 0]
        if empty:  # an empty dataset cannot be loaded: write nothing and say so (exit status 2)
            names = ", ".join(map(str, files[:3])) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
            raise ValueError(
                f"{names}: no document with text under {', '.join(empty)} ({n_records} records read, "
                f"{skipped[empty[0]]} of them empty); nothing was written: check --input and --json-keys")
        for k in keys:
            builders[k].finalize(tmp[k] + ".idx")
            _fsync(tmp[k] + ".bin")
            _fsync(tmp[k] + ".idx")
        for k in keys:
            _publish(tmp[k], final[k])
        done = True
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        if not done:
            for b in builders.values():
                b.data_file.close()
            for k in keys:
                for ext in (".bin", ".idx"):
                    if os.path.exists(tmp[k] + ext):
                        os.remove(tmp[k] + ext)

    elapsed = max(time.perf_counter() - start, 1e-9)
    print(f"Done: {n_records} input documents, {n_bytes / 1024 ** 2:.2f} MB in "
          f"{elapsed:.2f} s ({n_records / elapsed:.1f} docs/s, "
          f"{n_bytes / elapsed / 1024 ** 2:.2f} MB/s).")
    for k in keys:
        print(f"  {final[k]}.bin/.idx: {docs[k]} documents, {tokens[k]} tokens"
              + (f", {skipped[k]} empty documents skipped" if skipped[k] else ""))
    return 0


# Input problems the tool explains itself; their messages name the file, line and fix.
INPUT_ERRORS = (ValueError, FileNotFoundError, ImportError, NotImplementedError, UnicodeError)


def cli(argv: Optional[Sequence[str]] = None) -> int:
    """The command line: an input error prints its message (one line, no traceback) and exits 2."""
    try:
        return main(argv)
    except INPUT_ERRORS as exc:
        print(f"preprocess_data.py: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())

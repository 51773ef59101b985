"""Tokenizers for the training job and ``tools/preprocess_data.py``.

``build_tokenizer(tokenizer_type, ...)`` returns a tokenizer with what Megatron-Core's
``GPTDataset`` / ``MockGPTDataset`` read: ``.vocab_size``, ``.eod`` and, when it exists,
``.pad``; on Megatron-Core 0.16.1 a subclass of its legacy tokenizer interface
(``megatron.core.datasets.megatron_tokenizer.MegatronLegacyTokenizer``, removed in 0.17.0:
``mcore_releases.tokenizer_base``).

Types (Megatron-LM's names where it has one):

``GPT2BPETokenizer``
    GPT-2 byte-level BPE read from local ``vocab.json`` + ``merges.txt``; implemented
    here (no ``transformers`` needed). eod = ``<|endoftext|>``.
``HuggingFaceTokenizer``
    ``transformers.AutoTokenizer.from_pretrained(tokenizer_model, local_files_only=True)``;
    never downloads. Needs ``transformers``.
``ByteLevelTokenizer``
    No files: ids 0..255 are the UTF-8 bytes, 256 is eod (vocab size 257).
``NullTokenizer``
    Megatron-LM's: the text is whitespace-separated integer ids; ``vocab_size=V`` means
    ids ``0..V-1``, eod = ``V`` and ``.vocab_size`` = ``V + 1``.

``vocab_size`` (all types but ``NullTokenizer``): if given it must be at least the
tokenizer's own size and ``.vocab_size`` reports it (the extra ids are padding that
``tokenize`` never produces; ``.pad`` is then the first of them). This is not
Megatron-LM's ``--make-vocab-size-divisible-by`` padding, which the training job
applies on top of ``.vocab_size``.

``tokenize`` returns a ``list[int]`` (as Megatron-LM's tokenizers do) and never adds
eod: ``tools/preprocess_data.py --append-eod`` does. Text is never parsed for special
tokens: a literal ``<|endoftext|>`` in a document is encoded as ordinary text.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Tuple

from megatron.fsdp.mcore_releases import tokenizer_base

_Base = tokenizer_base()  # Megatron-Core's legacy tokenizer interface (0.16.1), plain object from 0.17.0

__all__ = [
    "TOKENIZER_TYPES",
    "build_tokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "ByteLevelTokenizer",
    "NullTokenizer",
    "bytes_to_unicode",
]

EOD_TEXT = "<|endoftext|>"


class _Tokenizer(_Base):
    """Common base: the identifiers Megatron-Core's base keeps, without its deprecation log
    (which is about Megatron-Core's own legacy tokenizers, not this interface)."""

    def __init__(self, *tokenizer_paths, **tokenizer_options):  # noqa: D107
        # Deliberately not calling _Base.__init__ (it only logs a deprecation warning and
        # fills these two fields).
        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = [str(p) for p in tokenizer_paths]
        for option, value in tokenizer_options.items():
            self.unique_identifiers[option] = str(value)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    # Padding (``vocab_size`` larger than the tokenizer's own size) -------------------
    def _init_padding(self, natural_size: int, vocab_size: Optional[int]) -> None:
        if vocab_size is None:
            vocab_size = natural_size
        vocab_size = int(vocab_size)
        if vocab_size < natural_size:
            raise ValueError(
                f"{type(self).__name__}: vocab_size={vocab_size} is smaller than the "
                f"tokenizer's own vocabulary ({natural_size} ids)")
        self._natural_size = natural_size
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    # Subclasses set ``_vocab``, ``_inv_vocab`` and ``_eod`` in their constructors.
    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self._inv_vocab

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        """An id ``tokenize`` never produces: the first padding id when ``vocab_size`` was
        padded. Without padding there is none and this raises ``NotImplementedError``, as
        Megatron-LM's tokenizers do (Megatron-Core's datasets then use their own sentinel;
        a real token must never be the pad id, since GPTDataset masks it out of the loss).
        """
        if self._vocab_size > self._natural_size:
            return self._natural_size
        raise NotImplementedError(
            f"{type(self).__name__} has no pad id (pass a larger vocab_size to reserve one)")

    @property
    def eos(self) -> int:
        return self.eod

    def _check_ids(self, ids) -> List[int]:
        out = [int(i) for i in ids]
        for i in out:
            if not 0 <= i < self._vocab_size:
                raise ValueError(f"{type(self).__name__}: token id {i} is outside "
                                 f"[0, {self._vocab_size})")
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


# --------------------------------------------------------------------------------------
# GPT-2 byte-level BPE
# --------------------------------------------------------------------------------------

def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters.

    Printable Latin-1 bytes map to themselves; the other 68 (control characters, space,
    ...) map to ``chr(256 + n)`` in byte order, so that no symbol is whitespace.
    """
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
          + list(range(ord("\xae"), ord("\xff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


# GPT-2's pre-tokenisation pattern (openai/gpt-2, encoder.py), for the `regex` package.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# The same with the standard `re` module, which has no \p{..} classes. In `re`,
# \w = letters + numeric characters + '_', \d = decimal digits (Nd) only, so:
#   \p{L}               ~ [^\W\d_]     (exact for letters, but numeric characters that are not
#                                       decimal digits, category No/Nl such as '²' or 'Ⅳ',
#                                       fall here instead of in \p{N})
#   \p{N}               ~ \d           (Nd only)
#   [^\s\p{L}\p{N}]     ~ [^\s\w]|_
# These three classes still partition the non-space characters, so every character is
# covered; the split differs from `regex` only around No/Nl characters. ASCII is exact.
GPT2_PATTERN_RE = r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""

try:
    import regex as _regex

    _GPT2_SPLIT = _regex.compile(GPT2_PATTERN)
    GPT2_SPLIT_IS_EXACT = True
except ImportError:  # the approximation documented above
    _GPT2_SPLIT = re.compile(GPT2_PATTERN_RE)
    GPT2_SPLIT_IS_EXACT = False


def _pairs(word: Tuple[str, ...]):
    return {(word[i], word[i + 1]) for i in range(len(word) - 1)}


class GPT2BPETokenizer(_Tokenizer):
    """GPT-2 byte-level BPE from a local ``vocab.json`` (token -> id) and ``merges.txt``
    (one ``a b`` merge a line, highest priority first, optional ``#version`` header).

    Every one of the 256 byte symbols must be in the vocabulary (as in GPT-2's), so any
    text can be encoded; eod is ``<|endoftext|>``.
    """

    CACHE_LIMIT = 200_000  # pre-tokens memoised; cleared when full

    def __init__(self, vocab_file: str, merge_file: str, vocab_size: Optional[int] = None,
                 split_pattern=None):
        super().__init__(vocab_file, merge_file, vocab_size=vocab_size)
        if not vocab_file or not merge_file:
            raise ValueError("GPT2BPETokenizer needs --vocab-file (vocab.json) and "
                             "--merge-file (merges.txt)")
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder: Dict[str, int] = json.load(f)
        if not isinstance(self.encoder, dict):
            raise ValueError(f"{vocab_file}: expected a JSON object token -> id")
        self.decoder: Dict[int, str] = {int(v): k for k, v in self.encoder.items()}
        if len(self.decoder) != len(self.encoder):
            raise ValueError(f"{vocab_file}: two tokens share an id")
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        missing = [s for s in self.byte_encoder.values() if s not in self.encoder]
        if missing:
            raise ValueError(f"{vocab_file}: not a byte-level BPE vocabulary: {len(missing)} "
                             f"of the 256 byte symbols are missing (e.g. {missing[:5]})")
        if EOD_TEXT not in self.encoder:
            raise ValueError(f"{vocab_file}: no {EOD_TEXT} token (the eod)")
        self._eod = self.encoder[EOD_TEXT]
        self._vocab, self._inv_vocab = self.encoder, self.decoder

        merges: List[Tuple[str, str]] = []
        with open(merge_file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                if not line.strip() or (lineno == 1 and line.startswith("#version")):
                    continue
                parts = line.split()
                if len(parts) != 2:
                    raise ValueError(f"{merge_file}:{lineno}: expected two symbols, "
                                     f"got {line!r}")
                merges.append((parts[0], parts[1]))
        self.bpe_ranks: Dict[Tuple[str, str], int] = {}
        for rank, pair in enumerate(merges):
            self.bpe_ranks.setdefault(pair, rank)
        self._split = split_pattern if split_pattern is not None else _GPT2_SPLIT
        self._cache: Dict[str, Tuple[int, ...]] = {}
        self._init_padding(max(self.decoder) + 1, vocab_size)

    def bpe(self, token: str) -> Tuple[str, ...]:
        """Merge the symbols of one byte-mapped pre-token greedily, lowest rank first."""
        word = tuple(token)
        pairs = _pairs(word)
        ranks = self.bpe_ranks
        while pairs:
            best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
            if best not in ranks:
                break
            first, second = best
            merged, i, n = [], 0, len(word)
            while i < n:
                if i < n - 1 and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
            if len(word) == 1:
                break
            pairs = _pairs(word)
        return word

    def _encode_pretoken(self, piece: str) -> Tuple[int, ...]:
        ids = self._cache.get(piece)
        if ids is None:
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            try:
                ids = tuple(self.encoder[s] for s in self.bpe(mapped))
            except KeyError as e:
                raise ValueError(f"merges.txt produces {e.args[0]!r}, which is not in "
                                 f"vocab.json") from None
            if len(self._cache) >= self.CACHE_LIMIT:
                self._cache.clear()
            self._cache[piece] = ids
        return ids

    def tokenize(self, text: str) -> List[int]:
        out: List[int] = []
        for piece in self._split.findall(text):
            out.extend(self._encode_pretoken(piece))
        return out

    def detokenize(self, ids: Iterable[int]) -> str:
        symbols = "".join(self.decoder.get(i, "") for i in self._check_ids(ids))
        return bytearray(self.byte_decoder[c] for c in symbols).decode("utf-8",
                                                                        errors="replace")



# --------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------

class HuggingFaceTokenizer(_Tokenizer):
    """``transformers.AutoTokenizer`` loaded from local files only (a directory or a model
    already in the local Hugging Face cache). Like Megatron-LM, ``tokenize`` is
    ``tokenizer(text).input_ids`` (so a tokenizer that adds BOS adds it) and eod is the
    tokenizer's eos token."""

    def __init__(self, tokenizer_model: str, vocab_size: Optional[int] = None, **hf_kwargs):
        super().__init__(tokenizer_model, vocab_size=vocab_size, **hf_kwargs)
        if not tokenizer_model:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model (a local directory "
                             "or a model name already in the local Hugging Face cache)")
        try:
            import transformers
        except ImportError as e:
            raise ImportError(
                "HuggingFaceTokenizer needs the `transformers` package, which is not "
                "installed: `pip install transformers`, or choose another --tokenizer-type "
                f"({', '.join(t for t in TOKENIZER_TYPES if t != 'HuggingFaceTokenizer')})"
            ) from e
        try:
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(
                tokenizer_model, local_files_only=True, **hf_kwargs)
        except (OSError, ValueError) as e:
            raise ValueError(f"could not load Hugging Face tokenizer {tokenizer_model!r} from "
                             f"local files (downloads are disabled): {e}") from e
        if self._tokenizer.eos_token_id is None:
            raise ValueError(f"Hugging Face tokenizer {tokenizer_model!r} has no eos token "
                             "to use as eod")
        self._vocab = self._tokenizer.get_vocab()
        self._inv_vocab = {v: k for k, v in self._vocab.items()}
        self._eod = self._tokenizer.eos_token_id
        self._init_padding(len(self._tokenizer), vocab_size)

    def tokenize(self, text: str) -> List[int]:
        return list(self._tokenizer(text).input_ids)

    def detokenize(self, ids: Iterable[int]) -> str:
        ids = [i for i in self._check_ids(ids) if i < self._natural_size]
        return self._tokenizer.decode(ids)


    @property
    def pad(self) -> int:
        """The tokenizer's pad token when it has one distinct from eod, else as the base."""
        pad = self._tokenizer.pad_token_id
        if pad is not None and pad != self.eod:
            return pad
        return super().pad

    @property
    def bos(self) -> int:
        if self._tokenizer.bos_token_id is None:
            raise NotImplementedError("this Hugging Face tokenizer has no bos token")
        return self._tokenizer.bos_token_id


# --------------------------------------------------------------------------------------
# Byte level and null
# --------------------------------------------------------------------------------------

class ByteLevelTokenizer(_Tokenizer):
    """Self-contained: ids 0..255 are UTF-8 bytes, 256 is eod; vocab size 257 (or the
    larger ``vocab_size`` given). ``detokenize`` drops eod and padding ids and decodes
    with ``errors="replace"``."""

    EOD_ID = 256

    def __init__(self, vocab_size: Optional[int] = None):
        super().__init__(vocab_size=vocab_size)
        self._init_padding(self.EOD_ID + 1, vocab_size)
        self._vocab = {f"<0x{b:02X}>": b for b in range(256)}
        self._vocab[EOD_TEXT] = self.EOD_ID
        self._inv_vocab = {v: k for k, v in self._vocab.items()}
        self._eod = self.EOD_ID

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        return bytes(i for i in self._check_ids(ids) if i < 256).decode("utf-8",
                                                                        errors="replace")



class NullTokenizer(_Tokenizer):
    """Megatron-LM's: text is whitespace-separated integer ids in ``[0, vocab_size)``;
    eod = ``vocab_size`` and ``.vocab_size`` = ``vocab_size + 1`` (so eod is the last id)."""

    def __init__(self, vocab_size: int):
        if vocab_size is None:
            raise ValueError("NullTokenizer needs --vocab-size")
        super().__init__(None, vocab_size=vocab_size)
        self._eod = int(vocab_size)
        self._init_padding(self._eod + 1, None)

    def tokenize(self, text: str) -> List[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError as e:
            raise ValueError(f"NullTokenizer: the text must be integer ids: {e}") from None
        return self._check_ids(ids)

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(i) for i in self._check_ids(ids))

    @property
    def vocab(self):
        raise NotImplementedError("NullTokenizer has no vocabulary")

    @property
    def inv_vocab(self):
        raise NotImplementedError("NullTokenizer has no vocabulary")


# --------------------------------------------------------------------------------------

TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "ByteLevelTokenizer",
                   "NullTokenizer")


def build_tokenizer(tokenizer_type: str, vocab_file: Optional[str] = None,
                    merge_file: Optional[str] = None, tokenizer_model: Optional[str] = None,
                    vocab_size: Optional[int] = None) -> _Tokenizer:
    """The tokenizer ``tokenizer_type`` (one of ``TOKENIZER_TYPES``) from local files.

    ``GPT2BPETokenizer`` reads ``vocab_file`` + ``merge_file``; ``HuggingFaceTokenizer``
    reads ``tokenizer_model``; ``NullTokenizer`` needs ``vocab_size``. Unknown types raise
    ``ValueError``; ``HuggingFaceTokenizer`` without ``transformers`` raises ``ImportError``.
    """
    if tokenizer_type == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path:
                raise ValueError(f"GPT2BPETokenizer needs {flag}")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"GPT2BPETokenizer: {flag} {path!r} does not exist")
        return GPT2BPETokenizer(vocab_file, merge_file, vocab_size=vocab_size)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model, vocab_size=vocab_size)
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer(vocab_size=vocab_size)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ValueError(f"unknown tokenizer type {tokenizer_type!r}; valid types: "
                     f"{', '.join(TOKENIZER_TYPES)}")

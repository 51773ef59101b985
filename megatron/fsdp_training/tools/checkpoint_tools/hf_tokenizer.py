"""The tokenizer side of ``convert.py to-hf`` and ``from-hf``: special ids, tokenizer files, the training command.

Why: without ``bos_token_id`` / ``eos_token_id`` in ``config.json`` transformers fills in its
model type's defaults (Llama: bos 1, eos 2; GPT-2: 50256, outside a 257-id vocabulary), and
``generate()`` never stops at the job's end-of-document token. The ids come from the job's
own tokenizer, rebuilt from the flags stored in ``common.json``; a model converted from
HuggingFace keeps the ids of its own ``config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from megatron.fsdp.commands import PRETRAIN

SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt")


def recorded_tokenizer(common: Mapping[str, Any]):
    """The training job's ``TokenizerConfig`` from a checkpoint's recorded arguments; None for a model converted
    from HF."""
    args = common.get("args", {})
    if common.get("hf", {}).get("config") and "tokenizer_type" not in args:
        return None
    from megatron.fsdp_training.data.data_config import TokenizerConfig

    return TokenizerConfig(**{f.name: args.get(f.name) for f in dataclasses.fields(TokenizerConfig)})


def job_tokenizer(common: Mapping[str, Any]):
    """The training job's tokenizer as its stored flags build it; None for a model converted from HF."""
    config = recorded_tokenizer(common)
    if config is None:
        return None
    from megatron.fsdp_training.data.datasets import build_tokenizer

    return build_tokenizer(config)


def special_ids(tokenizer) -> Dict[str, int]:
    """bos / eos / pad of a job tokenizer: eos is its end-of-document id (what training appended);
    bos is the HF tokenizer's own when it has one, else eos (GPT-2's convention); pad is a padding id
    when the vocabulary was padded, else eos (transformers' own fallback)."""
    eos = int(tokenizer.eod)
    bos = getattr(getattr(tokenizer, "_tokenizer", None), "bos_token_id", None)
    try:
        pad = int(tokenizer.pad)
    except NotImplementedError:
        pad = eos
    return {"bos_token_id": eos if bos is None else int(bos), "eos_token_id": eos, "pad_token_id": pad}


def write_generation_files(out: Path, config: Dict[str, Any], common: Mapping[str, Any]) -> Dict[str, Any]:
    """Put the special ids into ``config`` and ``generation_config.json``, copy the tokenizer files.

    Returns ``config`` with the ids (the caller writes it). A tokenizer whose files are gone is
    said in one line (the ids are then the source config's, if any)."""
    try:
        tokenizer = job_tokenizer(common)
    except (OSError, ValueError, ImportError) as exc:
        print(f"tokenizer of the checkpoint not loadable ({exc}): config.json carries no new special ids and "
              "no tokenizer files are written")
        tokenizer = None
    if tokenizer is not None:
        config = {**config, **special_ids(tokenizer)}
        _copy_tokenizer_files(tokenizer, recorded_tokenizer(common), out)
    ids = {k: config[k] for k in SPECIAL if config.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(ids, indent=2, sort_keys=True) + "\n")
    return config


def _copy_tokenizer_files(tokenizer, config, out: Path) -> None:
    """``config``: the tokenizer's recorded ``TokenizerConfig``."""
    kind = config.tokenizer_type
    if kind == "HuggingFaceTokenizer":
        tokenizer._tokenizer.save_pretrained(str(out))
    elif kind == "GPT2BPETokenizer":  # what transformers' GPT2Tokenizer reads
        shutil.copyfile(config.vocab_file, out / "vocab.json")
        shutil.copyfile(config.merge_file, out / "merges.txt")


def has_tokenizer(hf_dir: Path) -> bool:
    return any((Path(hf_dir) / name).is_file() for name in _TOKENIZER_FILES[:3])


def training_flags(arch, hf_dir: str, seq_length_cap: int = 4096) -> List[str]:
    """``pretrain_gpt.py`` flags that build exactly the HF model: its shape, its vocabulary rows, no dropout
    (HF's configs here have none), a sequence length the model takes, and its tokenizer when the directory
    has one."""
    flags = arch.megatron_flags() + ["--seq-length", str(min(arch.max_position_embeddings, seq_length_cap)),
                                     "--hidden-dropout", "0", "--attention-dropout", "0",
                                     "--make-vocab-size-divisible-by", "1"]
    if has_tokenizer(Path(hf_dir)):
        flags += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_dir)]
    return flags


def training_command(arch, hf_dir: str, save_dir: str) -> str:
    return shlex.join([PRETRAIN, "--load", save_dir, "--finetune"] + training_flags(arch, hf_dir))


def tokenizer_note(arch, hf_dir: str) -> Optional[str]:
    if has_tokenizer(Path(hf_dir)):
        return None
    hint = " (ByteLevelTokenizer has 257)" if arch.vocab_size == 257 else ""
    return (f"({hf_dir} has no tokenizer files: add --tokenizer-type and its files for a tokenizer of "
            f"{arch.vocab_size} ids{hint})")

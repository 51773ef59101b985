"""The data flags: mock data, indexed datasets (one blend split by ``--split``, or a dataset per split), the
tokenizer, and how samples are read.

Megatron-LM's names, defaults and meanings. Before any process group exists every blend must be
one Megatron-Core accepts, every split the run reads must have documents (an empty one would make
Megatron-Core loop forever) and the dataset index cache must be writable (``data/checks.py`` and
``data/splits.py`` hold those checks; this module says which flags they read). docs/data.md says
what each flag does here.
"""

from __future__ import annotations

import argparse
from typing import List

from megatron.fsdp.commands import PREPROCESS

from ..errors import refuse
from .substitutions import Substitution


def add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true", help="Megatron-Core's mock GPT dataset instead of --data-path")
    g.add_argument("--data-path", nargs="*", default=None,
                   help=f"indexed dataset prefix(es) from {PREPROCESS}, optionally weighted: W1 P1 W2 P2")
    g.add_argument("--split", default="969,30,1",
                   help="train,validation,test weights of the documents of each --data-path")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="*", default=None,
                       help=f"weights and prefixes of an independent {split} dataset (as --data-path; "
                            "replaces --data-path and --split)")
    g.add_argument("--data-cache-path", default=None, help="where Megatron-Core caches dataset indexes")
    g.add_argument("--tokenizer-type", default=None,
                   help="GPT2BPETokenizer | HuggingFaceTokenizer | ByteLevelTokenizer | NullTokenizer")
    g.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer: a local directory")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: ids below it; others: pad to it")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x TP")
    g.add_argument("--tiktoken-pattern", choices=("v1", "v2"), default=None,
                   help="TikTokenizer's pattern (only TikTokenizer reads it)")
    g.add_argument("--num-workers", type=int, default=0,
                   help="data-loader worker processes; the job reads samples in the training process (N > 0 is said "
                        "at start-up)")
    g.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false",
                   help="read the .bin files instead of memory-mapping them")
    g.add_argument("--no-create-attention-mask-in-dataloader", dest="create_attention_mask_in_dataloader",
                   action="store_false", help="no attention mask from the dataset: attention is causal by construction")



# ----------------------------------------------------------------------------- rules (parser.validate_args's order)

def validate_sources(args: argparse.Namespace) -> None:
    """Some data, and a tokenizer for indexed data."""
    if not args.mock_data and not (args.data_path or args.train_data_path):
        refuse(f"no data: pass --mock-data, or --data-path PREFIX (built by {PREPROCESS}) with --tokenizer-type")
    if args.data_path and not args.tokenizer_type:
        refuse("--data-path needs --tokenizer-type (and its files) to know the vocabulary")


def validate_datasets(args: argparse.Namespace) -> None:
    """Blend weights Megatron-Core accepts, every split the run reads has documents, and a dataset index cache
    it can write (``data/checks.py``)."""
    from megatron.core.datasets.utils import get_blend_from_list

    from ..data.checks import blend_problem, cache_dir_problem, cache_directories
    from ..data.data_config import DataConfig
    from ..data.splits import DataSplitError, check_splits

    blends = {f"--{name.replace('_', '-')}": getattr(args, name, None)
              for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path")}
    for flag, values in blends.items():
        problem = blend_problem(flag, values)
        if problem:
            refuse(problem)
    try:
        check_splits(DataConfig.from_args(args))
    except DataSplitError as exc:
        refuse(str(exc))
    prefixes = [] if args.mock_data else [p for v in blends.values() if v for p in get_blend_from_list(v)[0]]
    if args.data_cache_path or prefixes:
        for directory in cache_directories(args.data_cache_path, prefixes):
            problem = cache_dir_problem(directory, given=bool(args.data_cache_path))
            if problem:
                refuse(problem)


def validate_split_paths(args: argparse.Namespace) -> None:
    """A dataset per split replaces --data-path (Megatron-LM's rule), and starts with the training one."""
    given = [s for s in ("train", "valid", "test") if getattr(args, f"{s}_data_path")]
    if not given:
        return
    if args.data_path:
        refuse("--data-path and --train-data-path/--valid-data-path/--test-data-path are exclusive (Megatron-LM's "
              "rule): give one of them")
    if "train" not in given:
        refuse("--valid-data-path/--test-data-path need --train-data-path")
    if not args.tokenizer_type:
        refuse("--train-data-path needs --tokenizer-type (and its files) to know the vocabulary")


# ----------------------------------------------------------------------------- substitutions (substitutions.py)

def tokenizer_substitutions(args: argparse.Namespace) -> List[Substitution]:
    if args.tiktoken_pattern and args.tokenizer_type != "TikTokenizer":
        return [Substitution(f"--tiktoken-pattern {args.tiktoken_pattern}", "not read",
                             f"only TikTokenizer reads it, the tokenizer is {args.tokenizer_type}")]
    return []


def reader_substitutions(args: argparse.Namespace) -> List[Substitution]:
    if args.num_workers:
        return [Substitution(f"--num-workers {args.num_workers}", "samples read in the training process",
                             "the job's data iterator has no worker processes")]
    return []

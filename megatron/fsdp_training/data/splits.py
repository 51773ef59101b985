"""Which dataset splits a run reads, and the start-up check that each has documents.

Megatron-Core's ``GPTDataset`` repeats a split's documents until it holds the
requested number of samples; a split that ``--split`` rounds to zero documents
(or zero tokens) makes that loop run forever, silently. So the job builds only
the splits it reads (validation only with evaluation, test never: this job has
no test phase, as Megatron-LM has none without ``--eval-iters`` and a test run),
and before anything is built it checks every used split of every ``--data-path``
prefix, stopping with one line that names the split, its document count and a
``--split`` that works.
"""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

from megatron.fsdp.commands import PREPROCESS

from .data_config import DataConfig

SPLIT_NAMES = ("train", "validation", "test")


class DataSplitError(ValueError):
    """A used split that would hold no documents, or data files that are missing."""


def split_samples(config: DataConfig) -> List[Optional[int]]:
    """Samples each split must supply over the whole run; None for a split the run never reads."""
    train = config.train_iters * config.largest_global_batch
    eval_runs = config.train_iters // config.eval_interval + 1 if config.eval_interval else 0
    valid = eval_runs * config.eval_iters * config.global_batch_size if config.eval_iters > 0 else 0
    return [train, valid or None, None]


def split_matrix(split: str) -> List[Optional[Tuple[float, float]]]:
    """Megatron-Core's book-ends of each split, as fractions of the documents (None: empty split)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                         parse_and_normalize_split)

    try:
        return convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    except (AssertionError, ValueError, ZeroDivisionError):
        raise DataSplitError(f"--split {split!r}: expected up to three non-negative weights with a positive "
                             "sum, train,validation,test (e.g. 969,30,1)") from None


def used_split_matrix(config: DataConfig) -> List[Optional[Tuple[float, float]]]:
    """The split matrix with the splits this run never reads set to None, so they are not built.

    The book-ends of the used splits stay where ``--split`` puts them: dropping a
    split does not move documents between the others.
    """
    return [bookend if size is not None else None
            for bookend, size in zip(split_matrix(config.split), split_samples(config))]


def _document_range(bookend: Optional[Tuple[float, float]], documents: int) -> Tuple[int, int]:
    if bookend is None:
        return 0, 0
    return int(round(bookend[0] * float(documents))), int(round(bookend[1] * float(documents)))


def _working_split(documents: int, config: DataConfig) -> str:
    """A ``--split`` (in documents) that gives every used split at least one document, or advice."""
    needs_valid = split_samples(config)[1] is not None
    if not needs_valid:
        return "--split 1,0,0"
    if documents < 2:
        return "--eval-iters 0 (no validation), or more documents"
    valid_fraction = (split_matrix(config.split)[1] or (0.0, 0.0))
    valid = min(documents - 1, max(1, int(round((valid_fraction[1] - valid_fraction[0]) * documents))))
    return f"--split {documents - valid},{valid},0 (or --eval-iters 0 for no validation)"


def check_splits(config: DataConfig) -> None:
    """Raise DataSplitError when a used split of a ``--data-path`` prefix has no documents or tokens.

    Reads only each prefix's ``.idx`` (document count and lengths) and the ``.bin``'s size
    (``checks.check_index_files``): cheap, on every rank, before any process group or
    collective exists. A validation split with no weight while ``--eval-iters`` asks for
    validation stops too (it was skipped silently).
    """
    wanted = split_samples(config)[1] is not None
    if wanted and split_matrix(config.split)[1] is None:
        raise DataSplitError(f"--eval-iters {config.eval_iters} asks for validation, but --split {config.split} gives "
                             "the validation split no weight; pass --eval-iters 0 (no validation) or a --split "
                             "with a validation weight (e.g. 98,2,0)")
    if config.mock_data or not config.data_path:
        return
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from .checks import check_index_files

    matrix = used_split_matrix(config)
    prefixes = config.blend()[0]
    for prefix in prefixes:
        missing = [p for p in (prefix + ".idx", prefix + ".bin") if not os.path.isfile(p)]
        if missing:
            raise DataSplitError(f"--data-path {prefix}: no file {missing[0]} (give the prefix that "
                                 f"{PREPROCESS} printed, without .bin/.idx)")
        problem = check_index_files(prefix)
        if problem:
            raise DataSplitError(f"--data-path {prefix}: {problem}")
        index = IndexedDataset(prefix, mmap=True)
        documents = index.document_indices.shape[0] - 1
        for name, bookend in zip(SPLIT_NAMES, matrix):
            if bookend is None and name != "train":
                continue
            begin, end = _document_range(bookend, documents)
            tokens = int(index.sequence_lengths[begin:end].sum()) if end > begin else 0
            if end <= begin or tokens == 0:
                what = f"{end - begin} documents" if end <= begin else f"{end - begin} documents but no tokens"
                raise DataSplitError(
                    f"--split {config.split} leaves the {name} split of {prefix} with {what} (of its {documents}); "
                    f"use {_working_split(documents, config)}")

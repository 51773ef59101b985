"""Datasets (Megatron-Core's mock or indexed GPT datasets) and per-rank micro-batch iterators.

Every data-parallel rank walks the same sample order; in each global batch, rank
``r`` takes rows ``[r * mbs, (r + 1) * mbs)`` of every chunk of ``dp * mbs``
consecutive samples (Megatron-LM's pretraining sampler), so the global batch is
the same whatever the data-parallel layout.
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional

import torch

from .data_config import DataConfig, TokenizerConfig


def build_tokenizer(config: TokenizerConfig):
    """The tokenizer ``--tokenizer-type`` and its files name (Megatron-LM's byte-level one by default)."""
    from .tokenizer import build_tokenizer as _build

    kind = config.tokenizer_type or "ByteLevelTokenizer"
    return _build(kind, vocab_file=config.vocab_file, merge_file=config.merge_file,
                  tokenizer_model=config.tokenizer_model, vocab_size=config.vocab_size)


def check_vocabulary(config: DataConfig, vocab_size: int) -> None:
    """Every token id of the ``--data-path`` files fits the tokenizer (``checks``): each rank reads a share of
    each ``.bin``, one all-reduce (every rank joins it) gives the largest id, and every rank raises the same
    ``DataSplitError`` line before the model sees a batch."""
    if config.mock_data or not config.data_path:
        return
    import torch.distributed as dist

    from .checks import largest_token, needs_scan, vocabulary_problem
    from .splits import DataSplitError

    prefixes = [p for p in config.blend()[0] if needs_scan(p, vocab_size)]
    if not prefixes:
        return
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    tops = torch.tensor([largest_token(p, rank, world) for p in prefixes], dtype=torch.int64)
    if world > 1:
        dist.all_reduce(tops, op=dist.ReduceOp.MAX)
    for prefix, top in zip(prefixes, tops.tolist()):
        problem = vocabulary_problem(prefix, top, vocab_size)
        if problem:
            raise DataSplitError(problem)


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tensor_model_parallel_size: int) -> int:
    """Megatron-LM's padding: a multiple of ``make_vocab_size_divisible_by x TP``."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def build_datasets(config: DataConfig, tokenizer):
    """Train, validation and test datasets sized for the whole run; None for a split the run never reads.

    Only the used splits are built (megatron/fsdp_training/data/splits.py says why); their
    document counts were checked at start-up.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    from .splits import split_samples, used_split_matrix

    per_split = config.train_data_path  # --train/valid/test-data-path: a blend per split
    blends = dict(blend_per_split=[config.blend(s) for s in ("train", "valid", "test")]) if per_split else dict(
        blend=None if config.mock_data else config.blend(), split=config.split)
    dataset_config = GPTDatasetConfig(
        random_seed=config.seed, sequence_length=config.seq_length, tokenizer=tokenizer, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=config.create_attention_mask_in_dataloader,
        path_to_cache=config.data_cache_path, mmap_bin_files=config.mmap_bin_files, **blends)
    sizes = [size or 0 for size in split_samples(config)]  # an unbuilt split's size is never read
    if per_split:  # a split without its path is not built
        sizes = [size if path else 0 for size, path in zip(sizes, blends["blend_per_split"])]
    else:
        used = used_split_matrix(config)
        dataset_config.split_matrix = [bookend if wanted is not None else None
                                       for bookend, wanted in zip(dataset_config.split_matrix, used)]
    cls = MockGPTDataset if config.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, dataset_config).build()


class MicroBatches:
    """Yields this rank's micro-batches in order, resumable at ``consumed_samples``."""

    def __init__(self, dataset, micro_batch_size: int, consumed_samples: int = 0):
        from megatron.core import parallel_state as ps

        self.dataset = dataset
        self.mbs = micro_batch_size
        self.dp = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.consumed = consumed_samples

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        if self.dataset is None:
            raise StopIteration
        start = self.consumed + self.dp_rank * self.mbs
        if self.consumed + self.dp * self.mbs > len(self.dataset):
            raise StopIteration
        rows = [self.dataset[i] for i in range(start, start + self.mbs)]
        self.consumed += self.dp * self.mbs
        batch = {}
        for key in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask"):
            if key in rows[0] and rows[0][key] is not None:
                batch[key] = torch.stack([torch.as_tensor(r[key]) for r in rows])
        return batch


def get_batch(iterator, device: Optional[torch.device] = None):
    """pretrain_gpt's ``get_batch``: next micro-batch on the device, then this CP rank's chunks."""
    from megatron.core import parallel_state as ps

    from megatron.fsdp.mcore_releases import batch_on_this_cp_rank

    batch = next(iterator)
    if device is not None and device.type != "cpu":
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return batch_on_this_cp_rank(batch, ps.get_context_parallel_group())

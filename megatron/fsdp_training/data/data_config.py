"""What the job's data reads of the arguments: the tokenizer's flags and the datasets' (``DataConfig``), built once.

Megatron-LM's flags of the same names; ``data_flags.py`` and ``training_flags.py`` (``arguments/``) check them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple


def _tuple(values: Optional[Sequence]) -> Optional[tuple]:
    return None if values is None else tuple(values)


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """``--tokenizer-type`` and its files (``tokenizer.build_tokenizer``'s keywords)."""

    tokenizer_type: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None

    @classmethod
    def from_args(cls, args) -> "TokenizerConfig":
        return cls(**{f.name: getattr(args, f.name, None) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The datasets (paths, split, sequence length, seed, cache), the micro-batches, the samples each split supplies."""

    data_path: Optional[Tuple[str, ...]]
    train_data_path: Optional[Tuple[str, ...]]  # --train/valid/test-data-path: a blend per split
    valid_data_path: Optional[Tuple[str, ...]]
    test_data_path: Optional[Tuple[str, ...]]
    split: str
    mock_data: bool
    data_cache_path: Optional[str]
    mmap_bin_files: bool
    create_attention_mask_in_dataloader: bool
    seed: int
    seq_length: int
    micro_batch_size: int
    tokenizer: TokenizerConfig
    # the samples each split supplies over the run (splits.split_samples)
    train_iters: int
    eval_interval: Optional[int]
    eval_iters: int
    global_batch_size: int
    largest_global_batch: int  # a step batch-size schedule (batch_rampup.py) may pass batches larger than the last

    @classmethod
    def from_args(cls, args) -> "DataConfig":
        steps = getattr(args, "step_batch_sizes", None) or ()
        return cls(
            data_path=_tuple(args.data_path), train_data_path=_tuple(getattr(args, "train_data_path", None)),
            valid_data_path=_tuple(getattr(args, "valid_data_path", None)),
            test_data_path=_tuple(getattr(args, "test_data_path", None)),
            split=args.split, mock_data=args.mock_data, data_cache_path=args.data_cache_path,
            mmap_bin_files=args.mmap_bin_files,
            create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader, seed=args.seed,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            tokenizer=TokenizerConfig.from_args(args), train_iters=args.train_iters,
            eval_interval=args.eval_interval, eval_iters=args.eval_iters, global_batch_size=args.global_batch_size,
            largest_global_batch=max([args.global_batch_size] + [batch for _, batch in steps]))

    def blend(self, split: Optional[str] = None):
        """Megatron-Core's ``(prefixes, weights)`` of ``--data-path``, or of ``--{split}-data-path`` (None: not given)."""
        from megatron.core.datasets.utils import get_blend_from_list

        paths = self.data_path if split is None else getattr(self, f"{split}_data_path")
        return get_blend_from_list(None if paths is None else list(paths))

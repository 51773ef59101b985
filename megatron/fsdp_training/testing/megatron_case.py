"""What every Megatron-Core case in a pool worker needs around it: a clean start and a clean end.

``megatron_case()`` releases everything one case creates (its process groups, Megatron's
parallel state, CPU mode), so the next case in the same worker starts from nothing. It
also keeps the mock dataset's sample indices in memory for the worker's later cases.

Why the index memo: ``--mock-data`` builds Megatron-Core's ``MockGPTDataset`` over
100,000 mock documents (~200M tokens), and the shuffle of its ~6M sample indices costs
~0.4 s per split per rank (measured: 0.82 s of a 2.2 s, 3-iteration, 4-rank run went to
the two shuffles, and rank 0 builds before the others). Megatron-Core keys its own
on-disk index cache by the dataset's description (``unique_identifiers``); the indices
depend on the sample count only through the number of epochs, so the memo's key is that
description less the sample count, plus the epoch count, and only single-epoch builds are
kept. The arrays returned are the ones a fresh build returns (the memo's test,
``megatron/fsdp/testing/test_megatron_case.py``, checks it bitwise).
"""

from __future__ import annotations

import collections
import contextlib
import json
from typing import Optional

from megatron.fsdp.testing.pool import releasing_new_groups

_KEPT = 4  # datasets kept per worker (train + validation of two configurations), ~80 MB each
_indices: "collections.OrderedDict[str, tuple]" = collections.OrderedDict()
_installed = False


def _memo_key(dataset) -> Optional[str]:
    if not dataset.config.mock:
        return None  # real datasets: Megatron-Core's own on-disk cache (--data-cache-path)
    if dataset._get_num_epochs(dataset._get_num_tokens_per_epoch()) != 1:
        return None
    identity = {k: v for k, v in dataset.unique_identifiers.items() if k != "num_samples"}
    return json.dumps(identity, default=lambda obj: obj.unique_identifiers)


def remember_mock_dataset_indices() -> None:
    """Install the memo in this worker (once); see the module docstring."""
    global _installed
    if _installed:
        return
    from megatron.core.datasets.gpt_dataset import GPTDataset

    build = GPTDataset._build_document_sample_shuffle_indices

    def build_or_recall(self):
        key = _memo_key(self)
        if key is None:
            return build(self)
        if key not in _indices:
            _indices[key] = build(self)
            while len(_indices) > _KEPT:
                _indices.popitem(last=False)
        _indices.move_to_end(key)
        return _indices[key]

    GPTDataset._build_document_sample_shuffle_indices = build_or_recall
    _installed = True


@contextlib.contextmanager
def megatron_case():
    """Run one Megatron-Core case: on exit, destroy its groups, its parallel state, CPU mode and the MoE
    loss tracker (it keeps the groups alive)."""
    from megatron.core import parallel_state as ps
    from megatron.fsdp.mcore_cpu.cuda_standins import disable_cpu_mode

    remember_mock_dataset_indices()
    ps.destroy_model_parallel()  # a case that failed mid-way may have left state behind
    with releasing_new_groups():
        try:
            yield
        finally:
            disable_cpu_mode()
            ps.destroy_model_parallel()
            # Megatron-Core's MoE aux-loss tracker is a module global that keeps the groups.
            from megatron.fsdp.mcore_releases import drop_moe_metrics

            drop_moe_metrics()
            from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

            MTPLossLoggingHelper.tracker.clear()  # the MTP loss tracker too (its averaging group)

"""A small real corpus and the model flags that read it, shared by the data tests (test_data_splits, test_data_checks)."""

import numpy as np


SMALL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--micro-batch-size", "1", "--train-iters", "2", "--tokenizer-type", "ByteLevelTokenizer"]


def corpus(directory, documents: int, tokens_per_document: int = 200) -> str:
    """Write ``documents`` random byte-token documents as an indexed dataset under ``directory``; its prefix."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(directory / f"corpus{documents}_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(documents)
    for _ in range(documents):
        doc = rng.integers(0, 256, tokens_per_document).astype(np.uint16)
        builder.add_document(doc, [doc.size])
    builder.finalize(prefix + ".idx")
    return prefix

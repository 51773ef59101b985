"""The one place that silences warnings a user cannot act on.

Megatron-Core 0.16.1 announces on import that Transformer Engine and Apex are
absent and that it falls back to torch implementations, and warns about its own
default ``cuda_graph_scope``; its MoE and sequence-parallel code calls torch's flat
collectives by their deprecated names. Nothing can be done about either on a machine without
those packages (the fallback is exactly what CPU mode runs), so they are filtered
here, once per process, before Megatron-Core is imported by the adapter or the
training job.
"""

import logging
import warnings

_PATTERNS = (
    r".*Transformer Engine and Apex are not installed.*",
    r"Apex is not installed\. Falling back to Torch Norm",
    r"full scope is deprecated\. Use empty cuda_graph_scope",
    r"You're using the legacy tokenizer system",  # the dataset API still takes legacy tokenizers
    # Megatron-Core's MoE dispatchers and SP mappings call the flat collectives by their old names.
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
)


class _MockIndexCacheFilter(logging.Filter):
    """Mock datasets are generated, not read: there is no index cache worth saving."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unable to save MockGPTDataset indexes")


def silence_unactionable_warnings() -> None:
    for pattern in _PATTERNS:
        warnings.filterwarnings("ignore", message=pattern)
    dataset_logger = logging.getLogger("megatron.core.datasets.gpt_dataset")
    if not any(isinstance(f, _MockIndexCacheFilter) for f in dataset_logger.filters):
        dataset_logger.addFilter(_MockIndexCacheFilter())

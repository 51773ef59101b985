"""The one place that silences warnings a user cannot act on.

Megatron-Core 0.16.1 announces on import that Transformer Engine and Apex are
absent and that it falls back to torch implementations, and warns about its own
default ``cuda_graph_scope``. Nothing can be done about either on a machine without
those packages (the fallback is exactly what CPU mode runs), so they are filtered
here, once per process, before Megatron-Core is imported by the adapter or the
training job.
"""

import warnings

_PATTERNS = (
    r".*Transformer Engine and Apex are not installed.*",
    r"Apex is not installed\. Falling back to Torch Norm",
    r"full scope is deprecated\. Use empty cuda_graph_scope",
    r"You're using the legacy tokenizer system",  # the dataset API still takes legacy tokenizers
)


def silence_unactionable_warnings() -> None:
    for pattern in _PATTERNS:
        warnings.filterwarnings("ignore", message=pattern)

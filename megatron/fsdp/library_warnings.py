"""The one place that silences warnings a user cannot act on.

Megatron-Core (0.16.1 to 0.19) announces on import that Transformer Engine and Apex are
absent and that it falls back to torch implementations, and warns about its own
default ``cuda_graph_scope``; its MoE and sequence-parallel code calls torch's flat
collectives by their deprecated names; its rerun state machine announces that it
was created implicitly, in its default (disabled) mode; its DistributedOptimizer
reads ``.grad`` of tensors that Megatron-Core's CPU mode hands it as non-leaf views.
Nothing can be done about any of these on a machine without those packages (the
fallback is exactly what CPU mode runs), so they are filtered here, once per process,
before Megatron-Core is imported by the adapter, the training job, the test pools'
workers and the report tools (whose table rows they would otherwise interleave).

It lives in the engine package, and imports nothing but the standard library, so
that a process can install the filters before it imports Megatron-Core (importing
``megatron.fsdp.mcore`` would import Megatron-Core first). The engine itself never
imports Megatron-Core.
"""

import logging
import warnings

_PATTERNS = (
    r".*Transformer Engine and Apex are not installed.*",
    r"Apex is not installed\. Falling back to Torch Norm",
    r"full scope is deprecated\. Use empty cuda_graph_(scope|modules)",  # 0.16.1 | 0.19
    r"You're using the legacy tokenizer system",  # the dataset API still takes legacy tokenizers
    # Megatron-Core's MoE dispatchers and SP mappings call the flat collectives by their old names.
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    # megatron.core.inference's import-time notice about its own module layout.
    r"The following imports from `dynamic_context\.py` will be removed",
)

# (message, module) pairs: filtered only where they are raised from.
_MODULE_PATTERNS = (
    # Megatron-Core's DistributedOptimizer under CPU mode: its .grad reads go through the
    # compatibility layer's TorchFunctionMode, whose tensors are views (the reads are correct).
    (r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
     r"megatron\.fsdp\.mcore_cpu\.cuda_standins"),
)

# Notices a person running one job should see once, but that a pool of CPU workers running
# many cases (tests, the report tools) would repeat per rank and per case between the rows
# of a table: CPU mode being on, and the CUDA tuning hint, which does not apply on CPU.
_POOL_NOTICES = (
    r"Megatron-Core CPU mode is on",
    r"When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
)

# Megatron-Core's own log records (logger name, message start) that announce defaults.
_LOG_RECORDS = (
    ("megatron.core.datasets.gpt_dataset", "Unable to save MockGPTDataset indexes"),  # mock data is generated
    ("megatron.core.rerun_state_machine", "Implicit initialization of Rerun State Machine!"),
    ("megatron.core.rerun_state_machine", "RerunStateMachine initialized in mode RerunMode.DISABLED"),
    # 0.19: GPTModel's constructor points to HybridModel (pretrain_gpt.py builds Megatron-LM's GPTModel), and
    # reading a torch_dist checkpoint an older release wrote (its common.pt) calls a deprecated reader.
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
    ("megatron.core.dist_checkpointing.strategies.common", "load_common is deprecated"),
    # a CUDA build of torch on a machine without a GPU (CPU mode), when Megatron-Core imports cpp_extension
    ("torch.utils.cpp_extension", "No CUDA runtime is found"),
)


class _RecordFilter(logging.Filter):
    """Drops the log records of one logger whose message starts with one of ``starts``."""

    def __init__(self, starts):
        super().__init__()
        self.starts = tuple(starts)

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def silence_unactionable_warnings(cpu_worker_pool: bool = False) -> None:
    """Install the filters (idempotent); ``cpu_worker_pool``: also the notices a CPU worker pool repeats."""
    for pattern in _PATTERNS + (_POOL_NOTICES if cpu_worker_pool else ()):
        warnings.filterwarnings("ignore", message=pattern)
    for pattern, module in _MODULE_PATTERNS:
        warnings.filterwarnings("ignore", message=pattern, module=module)
    by_logger = {}
    for name, start in _LOG_RECORDS:
        by_logger.setdefault(name, []).append(start)
    for name, starts in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _RecordFilter) for f in logger.filters):
            logger.addFilter(_RecordFilter(starts))

"""The job's data: Megatron-Core's datasets and per-rank micro-batches, splits, tokenizers.

Owns ``data_config`` (what it reads of the arguments, as frozen views), ``datasets`` (mock or indexed GPT
datasets, the per-rank iterators), ``splits`` (which splits a run reads, and their start-up check) and
``tokenizer`` (the job's and the preprocessing tool's).

May import: Megatron-Core, ``megatron.fsdp_training.errors``, ``megatron.fsdp.commands`` (the tools' names).
"""

"""``python tools/bench/run.py``: this project against PyTorch FSDP2 and Megatron-Core's wrappers.

A package so the worker processes can import the cases by name (``tools.bench.torch_case:run``).
See docs/performance.md.
"""

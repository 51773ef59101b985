"""The suite's shared helpers: each holds the cases and checks that several test modules run.

Worker-side cases (``fn(ctx, **kwargs)``, run in the gloo pools of ``megatron/fsdp/testing/pool.py``)
and pytest-side checks. A test module keeps its own cases and reads in one helper at most; a helper
imports no other module of ``tests/`` (docs/testing.md, "Where things live").
"""

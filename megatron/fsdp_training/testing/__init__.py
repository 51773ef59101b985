"""Megatron-level cases that tests and tools share: GPT set-ups, the adapter and DDP runs, the job in a pool.

The Megatron-Core side of ``megatron.fsdp.testing``: worker-side cases (``fn(ctx, **kwargs)``)
run in its gloo worker pools, the session's pools (``pools``), and the set-up and teardown of
a Megatron case in a long-lived worker (``megatron_case``). Installed, so that ``tools/`` never
imports ``tests/``.

May import: anything in ``megatron`` and Megatron-Core.
"""

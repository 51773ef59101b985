"""The suite's shared cases and checks, in one place an IDE can follow.

Worker-side cases (``fn(ctx, **kwargs)``, run in the gloo pools of
``megatron/fsdp/testing/pool.py`` and passed to ``WorkerPool.run`` as functions), the models
and Megatron-Core set-ups they build, and the pytest-side checks and arguments that
more than one test module uses. Test modules import from here, never from each other.
"""

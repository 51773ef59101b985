"""The job's command-line tools, installed with it: checkpoint conversion and inspection, preprocessing, generation.

Owns ``checkpoint`` (``convert``, ``inspect`` and the converters they run), ``preprocess_data`` and
``generate``. They live in the package, not only in a clone's ``tools/``, so that an installed wheel has
them: each is a console script (``megatron.fsdp.commands`` names them) and a ``python -m`` module; the
clone's ``tools/*.py`` of the same names run these.

May import: anything in ``megatron`` but ``testing``, and Megatron-Core.
"""

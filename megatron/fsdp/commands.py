"""The commands this distribution installs (pyproject.toml's ``[project.scripts]``): their names and their start.

A line that tells a user to run a tool (convert a checkpoint, rebuild a dataset, ``--help``) names the
command their install has: a console script exists in a wheel and an editable install alike, where
``python tools/...`` exists only in a clone. Like ``library_warnings`` it lives in the engine package
and imports nothing of the project, so that the adapter, the job and the job's data code name the same
commands without importing one another; tests/test_installed_package.py checks the names against
pyproject.toml.
"""

import os

PRETRAIN = "megatron-fsdp-pretrain"  # the training job, pretrain_gpt.py's flags (python -m megatron.fsdp_training)
CONVERT = "megatron-fsdp-convert"  # checkpoint <-> torch file, HuggingFace, torch_dist, Megatron-LM's trainer
INSPECT = "megatron-fsdp-inspect"  # what a checkpoint holds; --verify checks its files
PREPROCESS = "megatron-fsdp-preprocess"  # a corpus -> Megatron-Core indexed datasets (--data-path)
GENERATE = "megatron-fsdp-generate"  # what a checkpoint's model says
ESTIMATE = "megatron-fsdp-estimate"  # a configuration's memory, collectives and checkpoint per rank at any world size


def set_command_defaults() -> None:
    """What a command that builds a model sets first, before Megatron-Core is imported: TorchDynamo off unless
    ``TORCHDYNAMO_DISABLE`` says otherwise (Megatron-Core compiles its fused functions at import, and on CPU a
    first compiled step takes seconds to minutes)."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

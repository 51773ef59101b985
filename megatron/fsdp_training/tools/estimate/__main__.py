"""``python -m megatron.fsdp_training.tools.estimate``: ``megatron-fsdp-estimate``."""

from .cli import main

main()

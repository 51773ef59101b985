"""Checkpoint tools: ``convert`` (torch file, HuggingFace, torch_dist, Megatron-LM's trainer) and ``inspect``.

The converters' modules import each other as siblings; ``output`` (where a converter may write) and
``source`` (what it reads) are the rules every command follows.

May import: what ``megatron.fsdp_training.tools`` may.
"""

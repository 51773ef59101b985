"""Megatron-Core and Transformer Engine emulated on CPU processes (gloo), kept apart from the adapter.

Megatron-Core assumes CUDA (and, for FP8, Transformer Engine) in many small places; this package is the one
place that stands in for them, so the engine never needs any of it and the adapter stays the mapping of
Megatron-Core onto the engine. May import: the engine, ``megatron.fsdp.mcore_releases`` and Megatron-Core;
never the adapter or the job (the adapter, the job and the trainer runners import it).

- ``cuda_standins``: CPU mode (``enable_cpu_mode``): the memory buffer, RNG tracker, ``torch.cuda`` stand-ins.
- ``layer_spec``: the layer spec GPTModel builds on CPU (SDPA attention, torch norms).
- ``fp8_matmul``, ``fp8_linears``: FP8 GEMMs and Megatron-Core's local linears with them, without TE.
- ``trainer_bridges``: what Megatron-LM's trainer and Megatron-Bridge need on top of CPU mode.
- ``patch_record``: the record of what is replaced in other packages (``Patches``), shared with the runners.
"""

"""The job's checkpoints: ``--save`` / ``--load`` in Megatron-LM's layout, sync and async, with integrity checks.

Owns save and load (``save_load``), the three-step save (``save_steps``) and its background thread
(``async_save``), directories published atomically (``files``), who owns a temporary
(``ownership``), start-up path checks and free space (``paths``), what a checkpoint must agree with
(``compatibility``), the CRC manifest (``manifest``), layout-1 checkpoints (``layout_v1``) and the
Megatron-Core DDP baseline's ``torch_dist`` format (``torch_dist``), and Megatron-LM's non-persistent
checkpoints (``non_persistent``, their flags: ``arguments.checkpointing``). What it reads of a run is one frozen
value (``checkpoint_config.CheckpointConfig``), not the namespace.

May import: the engine (``megatron.fsdp``), Megatron-Core, ``megatron.fsdp_training.errors`` and
``megatron.fsdp_training.logs``.
"""

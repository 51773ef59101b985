"""The job's logs: Megatron-shaped log lines, scalars for TensorBoard and wandb, timers, throughput, MoE losses.

Owns ``lines`` (log lines, memory per rank, the start-up summary), ``writers`` (scalar writers),
``timers``, ``throughput`` (``--log-throughput``) and ``moe_losses`` (the routers' auxiliary losses), and
the frozen views they read of the arguments: ``logging_config``, ``model_size`` (FLOPs) and
``aux_loss_config``.

May import: Megatron-Core, ``megatron.fsdp_training.errors``, ``megatron.fsdp_training.model_shape``.
"""

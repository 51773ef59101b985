"""The training job as a command: ``python -m megatron.fsdp_training`` and ``megatron-fsdp-pretrain``.

The same job, flags and behaviour as ``pretrain_gpt.py``, which runs this ``main`` too.
"""

from megatron.fsdp.commands import set_command_defaults


def main(argv=None) -> None:
    set_command_defaults()
    from megatron.fsdp_training.training import main as train

    train(argv)


if __name__ == "__main__":
    main()

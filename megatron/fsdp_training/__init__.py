"""The training job: arguments, initialisation, data, model, loop and logs (see pretrain_gpt.py)."""

from megatron.fsdp.library_warnings import silence_unactionable_warnings

silence_unactionable_warnings()

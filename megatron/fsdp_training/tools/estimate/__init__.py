"""The estimate (``megatron-fsdp-estimate``): the job's build and one step at any world size, in one process.

Owns the simulated rank (``world``: torch's fake process group, fake tensors), the count of what torch allocates
(``allocations``), the measured build and step (``one_step``), the time model (``time_model``), the report and its
JSON (``report``) and the command (``cli``). docs/estimate.md says what it measures and how to read it.

May import: anything in ``megatron`` but ``testing``, and Megatron-Core.
"""

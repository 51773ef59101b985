"""The job's command line: Megatron-LM's flag names, defaults and meanings, their checks and the start-up line.

One module per concern, each with its flags (``add_*_args``, one ``--help`` group), its rules and its
substitutions: ``model`` (size, architecture, MLA/MTP, kernels), ``moe``, ``parallelism``,
``megatron_fsdp``, ``precision`` (bf16, FP8, the precision-aware optimizer), ``optimizer`` (with the
learning-rate schedule), ``data``, ``training`` (batches, length, recompute, memory and time),
``checkpointing`` (with non-persistent checkpoints and fault tolerance), ``logging`` (with profiling).
``parser`` assembles them and runs ``validate_args`` (every inconsistency is one ``ArgumentError``
before any process group exists); ``help`` formats ``--help``, ``not_built`` answers the flags this
job does not build, and ``substitutions`` says in one start-up line what this machine ran instead of
what a flag asked for (docs/arguments.md, "Arguments" and "Coming from Megatron-LM").

May import: the engine, errors, model_shape, and the job's modules whose decisions a flag's rule or
substitution reads (schedule, profiling, MoE dispatch, data and checkpoint checks); nothing heavy at
module level, since it runs before any process group exists.
"""

from ..errors import ArgumentError
from .parser import build_parser, parse_args, validate_args

__all__ = ["ArgumentError", "build_parser", "parse_args", "validate_args"]

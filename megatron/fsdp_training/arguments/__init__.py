"""The job's command line: Megatron-LM's flag names, defaults and meanings, their checks and the start-up line.

``parser`` builds the parser and runs ``validate_args`` (every inconsistency is one ``ArgumentError``
before any process group exists); the flag groups live beside it (``megatron_lm``: Megatron-LM's
everyday flags; ``fsdp_recipe``: the Megatron-FSDP user guide's; ``megatron_fsdp``: Megatron-LM
0.19/0.20's Megatron-FSDP flags and what ``--use-megatron-fsdp`` implies there; ``non_persistent``:
the non-persistent checkpoint flags), ``help`` formats ``--help``, and ``substitutions`` says in one start-up line what this
machine ran instead of what a flag asked for (each provider returns ``substitution_record.Substitution``).

May import: the engine, errors, architecture, logs, and the job's modules whose flags it parses (the
parser reads the schedule, profiling and MoE-dispatch groups); nothing heavy at module level, since it
runs before any process group exists.
"""

from ..errors import ArgumentError
from .parser import build_parser, parse_args, validate_args

__all__ = ["ArgumentError", "build_parser", "parse_args", "validate_args"]

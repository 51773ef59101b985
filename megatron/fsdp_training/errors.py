"""The job's error types, imported by every module that validates something.

``ArgumentError`` is raised by argument validation (``arguments``, the scalar writers' checks) and
caught once by ``training.run_entry_point``, which prints it on rank 0 and exits. Its own module, so
that the modules that raise it never import each other for it.
"""

from typing import NoReturn


class ArgumentError(ValueError):
    """An inconsistent argument set; the message names the arguments and the fix."""


def refuse(message: str) -> NoReturn:
    """Stop start-up with one line naming the arguments and the fix (every rule of ``arguments``)."""
    raise ArgumentError(message)

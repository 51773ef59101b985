"""The job's error types, imported by every module that validates something.

``ArgumentError`` is raised by argument validation (``arguments``, ``architecture``, the scalar
writers' checks) and caught once by ``training.main``, which prints it on rank 0 and exits. Its
own module, so that the modules that raise it never import each other for it.
"""


class ArgumentError(ValueError):
    """An inconsistent argument set; the message names the arguments and the fix."""

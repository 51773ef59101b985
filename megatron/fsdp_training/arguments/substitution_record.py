"""One substitution: the value every provider of ``substitutions.py`` returns (its own module, so the
providers, which ``substitutions.py`` imports, do not import it back)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Substitution:
    """``flag`` as the user wrote it, what runs ``instead``, and ``why`` (what this machine lacks)."""

    flag: str
    instead: str
    why: str

    def __str__(self) -> str:
        return f"{self.flag} -> {self.instead} ({self.why})"

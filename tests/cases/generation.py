"""Worker side of tests/tools/test_generate.py: ``tools/generate.py`` inside a Megatron pool."""

from __future__ import annotations

import io
from typing import List


def generate_in_pool(ctx, argv: List[str]) -> dict:
    """``tools/generate.py argv`` on the whole pool: the ids every rank generated and rank 0's streamed text."""
    from megatron.fsdp_training.testing.megatron_case import megatron_case
    from megatron.fsdp_training.tools import generate

    out = io.StringIO()
    with megatron_case():
        ids = generate.run(generate.parse_args(argv), out=out)
    return {"ids": ids, "text": out.getvalue() if ctx.rank == 0 else None}

"""Tokenise a corpus into Megatron-Core indexed datasets (``.bin`` + ``.idx``).

The installed ``megatron-fsdp-preprocess`` (``python -m megatron.fsdp_training.tools.preprocess_data``),
run from a clone.
"""

import os
import sys

if __name__ == "__main__":
    # the clone on sys.path, not tools/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    from megatron.fsdp_training.tools.preprocess_data import cli

    sys.exit(cli())
